//! `hf:` sources against a stand-in hub on 127.0.0.1 serving the paths the client asks for
//! (`/ORG/REPO/resolve/REVISION/FILE`), with the hub's sha256 ETags, range requests, a token
//! check, and injected faults.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

#[path = "../../axiom/tests/common/mod.rs"]
mod common;

use axiom::backend::cpu::CpuBackend;
use axiom::hub::{Hub, HubModel};
use common::{hf_fixture, worst_error};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Faults {
    /// Files whose first download breaks off halfway.
    truncate_once: HashSet<String>,
    /// Files served with an ETag that does not match their bytes.
    wrong_sha: HashSet<String>,
}

/// Requests seen: (path, range header).
type RequestLog = Arc<Mutex<Vec<(String, Option<String>)>>>;

struct StandIn {
    url: String,
    log: RequestLog,
    stop: Arc<std::sync::atomic::AtomicBool>,
    addr: std::net::SocketAddr,
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// Serves `repos` (name -> directory of files) to requests carrying `Bearer token`.
fn stand_in(repos: &[(&str, PathBuf)], token: &str, faults: Faults) -> StandIn {
    let mut files: HashMap<String, Vec<u8>> = HashMap::new();
    for (repo, dir) in repos {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            files.insert(format!("/{repo}/resolve/main/{name}"), std::fs::read(&path).unwrap());
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (log2, stop2, token) = (log.clone(), stop.clone(), token.to_string());
    let faults = Mutex::new(faults);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            if stop2.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let path = request_line.split_whitespace().nth(1).unwrap_or("").to_string();
            let mut headers = HashMap::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((k, v)) = line.trim_end().split_once(':') {
                    headers.insert(k.to_ascii_lowercase(), v.trim().to_string());
                }
            }
            let range = headers.get("range").cloned();
            log2.lock().unwrap().push((path.clone(), range.clone()));
            let name = path.rsplit('/').next().unwrap_or("").to_string();
            let respond = |stream: &mut TcpStream, status: &str, extra: &str, body: &[u8]| {
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(body);
            };
            if headers.get("authorization") != Some(&format!("Bearer {token}")) {
                respond(&mut stream, "401 Unauthorized", "", b"no token");
                continue;
            }
            let Some(body) = files.get(&path) else {
                respond(&mut stream, "404 Not Found", "", b"missing");
                continue;
            };
            let mut faults = faults.lock().unwrap();
            let sha: String = Sha256::digest(body).iter().map(|b| format!("{b:02x}")).collect();
            let etag = if faults.wrong_sha.contains(&name) {
                "0".repeat(64)
            } else {
                sha
            };
            let start = range
                .as_deref()
                .and_then(|r| r.strip_prefix("bytes=")?.strip_suffix('-')?.parse::<usize>().ok())
                .unwrap_or(0)
                .min(body.len());
            let (status, extra) = if start > 0 {
                (
                    "206 Partial Content",
                    format!(
                        "ETag: \"{etag}\"\r\nContent-Range: bytes {start}-{}/{}\r\n",
                        body.len() - 1,
                        body.len()
                    ),
                )
            } else {
                ("200 OK", format!("ETag: \"{etag}\"\r\n"))
            };
            if faults.truncate_once.remove(&name) {
                // Announce everything, send half, hang up.
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body[..body.len() / 2]);
                continue;
            }
            respond(&mut stream, status, &extra, &body[start..]);
            let mut rest = Vec::new();
            let _ = reader.read_to_end(&mut rest);
        }
    });
    StandIn {
        url: format!("http://{addr}"),
        log,
        stop,
        addr,
    }
}

fn hub(server: &StandIn, cache: &std::path::Path) -> Hub {
    Hub {
        endpoint: server.url.clone(),
        token: Some("secret".into()),
        cache: cache.to_path_buf(),
    }
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("axiom-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn sources_parse() {
    let m = HubModel::parse("hf:org/repo@v1.0/model.Q4_K.gguf").unwrap();
    assert_eq!(
        (m.repo.as_str(), m.revision.as_str(), m.file.as_deref()),
        ("org/repo", "v1.0", Some("model.Q4_K.gguf"))
    );
    assert_eq!(HubModel::parse("hf:org/repo").unwrap().revision, "main");
    for bad in ["hf:org", "hf:/repo", "hf:org/../x", "hf:org/repo/../../etc", "org/repo"] {
        assert!(HubModel::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn directories_download_load_and_then_work_offline() {
    let cache = temp("dir");
    let server = stand_in(
        &[("test/qwen3", hf_fixture("qwen3")), ("test/llama", hf_fixture("llama"))],
        "secret",
        Faults::default(),
    );
    for name in ["qwen3", "llama"] {
        let model = HubModel::parse(&format!("hf:test/{name}")).unwrap();
        let dir = hub(&server, &cache).fetch(&model).unwrap();
        assert!(dir.join("config.json").is_file());
        let err = worst_error(&dir, &hf_fixture(name), CpuBackend::reference(1));
        assert!(err < 1e-4, "{name}: {err}");
    }
    // The sharded llama came through its index.
    assert!(server
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|(p, _)| p.ends_with("model-00004-of-00004.safetensors")));
    // Without a token the stand-in refuses.
    let no_token = Hub {
        token: None,
        ..hub(&server, &temp("no-token"))
    };
    assert!(no_token.fetch(&HubModel::parse("hf:test/qwen3").unwrap()).is_err());
    let url = server.url.clone();
    drop(server);
    // Offline: the completed snapshot is used as it is.
    let offline = Hub {
        endpoint: url,
        token: None,
        cache: cache.clone(),
    };
    let dir = offline.fetch(&HubModel::parse("hf:test/qwen3").unwrap()).unwrap();
    assert!(dir.join("model.safetensors").is_file());
    std::fs::remove_dir_all(cache).unwrap();
}

#[test]
fn a_broken_download_resumes_with_a_range_request() {
    let cache = temp("resume");
    let faults = Faults {
        truncate_once: ["model.safetensors".to_string()].into(),
        ..Default::default()
    };
    let server = stand_in(&[("test/qwen3", hf_fixture("qwen3"))], "secret", faults);
    let model = HubModel::parse("hf:test/qwen3").unwrap();
    let first = hub(&server, &cache).fetch(&model);
    assert!(first.is_err(), "the connection broke off");
    let dir = hub(&server, &cache).fetch(&model).unwrap();
    let ranged = server
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|(p, r)| p.ends_with("model.safetensors") && r.is_some());
    assert!(ranged, "the second attempt asked for the rest only");
    assert_eq!(
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        std::fs::read(hf_fixture("qwen3").join("model.safetensors")).unwrap()
    );
    std::fs::remove_dir_all(cache).unwrap();
}

#[test]
fn a_bad_checksum_is_rejected() {
    let cache = temp("sha");
    let faults = Faults {
        wrong_sha: ["model.safetensors".to_string()].into(),
        ..Default::default()
    };
    let server = stand_in(&[("test/qwen3", hf_fixture("qwen3"))], "secret", faults);
    let model = HubModel::parse("hf:test/qwen3").unwrap();
    let err = hub(&server, &cache).fetch(&model).unwrap_err().to_string();
    assert!(err.contains("sha256 mismatch"), "{err}");
    let dir = cache.join("test--qwen3/main");
    assert!(!dir.join("model.safetensors").exists() && !dir.join(".complete").exists());
    std::fs::remove_dir_all(cache).unwrap();
}

#[test]
fn a_single_gguf_file_and_the_cli() {
    let cache = temp("gguf");
    let repo = temp("gguf-repo");
    axiom::convert::convert_hf_dir(
        &hf_fixture("qwen2"),
        &repo.join("tiny.Q8_0.gguf"),
        axiom::format::quant::GgmlType::Q8_0,
        |_, _, _| {},
    )
    .unwrap();
    let server = stand_in(
        &[("test/tiny-gguf", repo.clone()), ("test/qwen2", hf_fixture("qwen2"))],
        "secret",
        Faults::default(),
    );
    let path = hub(&server, &cache)
        .fetch(&HubModel::parse("hf:test/tiny-gguf/tiny.Q8_0.gguf").unwrap())
        .unwrap();
    assert!(path.is_file() && path.ends_with("tiny.Q8_0.gguf"));
    // `axiom run -m hf:...` with the hub's address and token from the environment.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_axiom"))
        .args([
            "run",
            "-m",
            "hf:test/qwen2",
            "-n",
            "4",
            "--temp",
            "0",
            "-q",
            "The license",
        ])
        .env("HF_ENDPOINT", &server.url)
        .env("HF_TOKEN", "secret")
        .env("AXIOM_CACHE", &cache)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(cache.join("hub/test--qwen2/main/.complete").is_file());
    // Again with the stand-in gone: from the cache, with the same text.
    let url = server.url.clone();
    drop(server);
    let again = std::process::Command::new(env!("CARGO_BIN_EXE_axiom"))
        .args([
            "run",
            "-m",
            "hf:test/qwen2",
            "-n",
            "4",
            "--temp",
            "0",
            "-q",
            "The license",
        ])
        .env("HF_ENDPOINT", &url)
        .env("AXIOM_CACHE", &cache)
        .output()
        .unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(again.stdout, out.stdout);
    std::fs::remove_dir_all(cache).unwrap();
    std::fs::remove_dir_all(repo).unwrap();
}
