//! `hf:` sources against a stand-in hub on 127.0.0.1 that answers as the real one does: the API's
//! file listing (`/api/models/ORG/REPO/revision/REV`), `resolve` URLs with the commit and ETag
//! headers (a git blob sha1 for small files; for LFS files a sha256 and a redirect to a
//! "CDN" that serves the bytes, with range requests), a token check, and injected faults.
//! The cache is checked against huggingface_hub's own code (Python), both ways.
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
use sha1::Sha1;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Faults {
    /// Files whose first download breaks off halfway.
    truncate_once: HashSet<String>,
    /// Files announced with an ETag that does not match their bytes.
    wrong_sha: HashSet<String>,
}

/// A request seen: path, range header, whether it carried the token.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    range: Option<String>,
    token: bool,
}

struct StandIn {
    url: String,
    log: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    addrs: [std::net::SocketAddr; 2],
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for addr in self.addrs {
            let _ = TcpStream::connect(addr);
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256(body: &[u8]) -> String {
    hex(&Sha256::digest(body))
}

/// The id git gives a file's bytes, which the hub sends as the ETag of files outside LFS.
fn git_sha1(body: &[u8]) -> String {
    let mut hasher = Sha1::new();
    hasher.update(format!("blob {}\0", body.len()).as_bytes());
    hasher.update(body);
    hex(&hasher.finalize())
}

/// The commit the stand-in says `main` of `repo` is at.
fn commit_of(repo: &str) -> String {
    git_sha1(repo.as_bytes())
}

fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors") || name.ends_with(".gguf")
}

/// A repository's files, name -> bytes.
type Repo = BTreeMap<String, Vec<u8>>;

fn repo_of(dir: &Path) -> Repo {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            (
                path.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&path).unwrap(),
            )
        })
        .collect()
}

/// Serves `repos` to requests carrying `Bearer token`.
fn stand_in(repos: Vec<(&str, Repo)>, token: &str, faults: Faults) -> StandIn {
    let repos: HashMap<String, Repo> = repos
        .into_iter()
        .map(|(name, files)| (name.to_string(), files))
        .collect();
    let blobs: HashMap<String, Vec<u8>> = repos
        .values()
        .flat_map(|files| files.iter())
        .filter(|(name, _)| is_lfs(name))
        .map(|(_, body)| (sha256(body), body.clone()))
        .collect();
    // The hub and its CDN at different addresses, as the real ones are.
    let listeners = [
        TcpListener::bind("127.0.0.1:0").unwrap(),
        TcpListener::bind("127.0.0.1:0").unwrap(),
    ];
    let addrs = [listeners[0].local_addr().unwrap(), listeners[1].local_addr().unwrap()];
    let url = format!("http://{}", addrs[0]);
    let cdn = format!("http://{}", addrs[1]);
    let log = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (log2, token) = (log.clone(), token.to_string());
    let faults = Mutex::new(faults);
    let handle = Arc::new(move |mut stream: TcpStream| {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).is_err() {
            return;
        }
        let mut words = request_line.split_whitespace();
        let method = words.next().unwrap_or("").to_string();
        let path = words.next().unwrap_or("").to_string();
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
        let authorized = headers.get("authorization") == Some(&format!("Bearer {token}"));
        log2.lock().unwrap().push(Seen {
            path: path.clone(),
            range: range.clone(),
            token: authorized,
        });
        let head = method == "HEAD";
        let respond = |stream: &mut TcpStream, status: &str, extra: &str, body: &[u8]| {
            let head_text = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
                body.len()
            );
            let _ = stream.write_all(head_text.as_bytes());
            if !head {
                let _ = stream.write_all(body);
            }
        };
        // The CDN: signed URLs, so no token; range requests.
        if let Some(sha) = path.strip_prefix("/cdn/") {
            let Some(body) = blobs.get(sha) else {
                respond(&mut stream, "404 Not Found", "", b"missing");
                return;
            };
            let name = repos
                .values()
                .flat_map(|files| files.iter())
                .find(|(_, b)| sha256(b) == sha)
                .map(|(n, _)| n.clone())
                .unwrap_or_default();
            let start = range
                .as_deref()
                .and_then(|r| r.strip_prefix("bytes=")?.strip_suffix('-')?.parse::<usize>().ok())
                .unwrap_or(0)
                .min(body.len());
            let (status, extra) = match start {
                0 => ("200 OK", String::new()),
                _ => (
                    "206 Partial Content",
                    format!("Content-Range: bytes {start}-{}/{}\r\n", body.len() - 1, body.len()),
                ),
            };
            if faults.lock().unwrap().truncate_once.remove(&name) {
                // Announce everything, send half, hang up.
                let head_text = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
                    body.len() - start
                );
                let _ = stream.write_all(head_text.as_bytes());
                let _ = stream.write_all(&body[start..start + (body.len() - start) / 2]);
                return;
            }
            respond(&mut stream, status, &extra, &body[start..]);
            return;
        }
        if !authorized {
            respond(&mut stream, "401 Unauthorized", "", b"no token");
            return;
        }
        // /api/models/ORG/REPO/revision/REV and /ORG/REPO/resolve/REV/FILE
        let (repo, rest) = match path.strip_prefix("/api/models/") {
            Some(api) => match api.split_once("/revision/") {
                Some((repo, rev)) => (repo.to_string(), ("api", rev.to_string(), String::new())),
                None => (String::new(), ("", String::new(), String::new())),
            },
            None => {
                let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
                match parts.as_slice() {
                    [org, name, "resolve", rev, file] => {
                        (format!("{org}/{name}"), ("resolve", rev.to_string(), file.to_string()))
                    }
                    _ => (String::new(), ("", String::new(), String::new())),
                }
            }
        };
        let (kind, rev, file) = rest;
        let Some(files) = repos.get(&repo) else {
            respond(&mut stream, "404 Not Found", "", b"no such repository");
            return;
        };
        let commit = commit_of(&repo);
        if rev != "main" && rev != commit {
            respond(&mut stream, "404 Not Found", "", b"no such revision");
            return;
        }
        if kind == "api" {
            let siblings: Vec<serde_json::Value> =
                files.keys().map(|f| serde_json::json!({ "rfilename": f })).collect();
            let body = serde_json::json!({ "id": repo, "sha": commit, "siblings": siblings }).to_string();
            respond(
                &mut stream,
                "200 OK",
                "Content-Type: application/json\r\n",
                body.as_bytes(),
            );
            return;
        }
        let Some(body) = files.get(&file) else {
            respond(&mut stream, "404 Not Found", "", b"missing");
            return;
        };
        let wrong = faults.lock().unwrap().wrong_sha.contains(&file);
        let commit_header = format!("X-Repo-Commit: {commit}\r\n");
        if is_lfs(&file) {
            let sha = sha256(body);
            let etag = if wrong { "0".repeat(64) } else { sha.clone() };
            let extra = format!(
                "{commit_header}X-Linked-Etag: \"{etag}\"\r\nX-Linked-Size: {}\r\nLocation: {cdn}/cdn/{sha}\r\n",
                body.len()
            );
            respond(&mut stream, "302 Found", &extra, b"");
        } else {
            let etag = if wrong { "0".repeat(40) } else { git_sha1(body) };
            respond(
                &mut stream,
                "200 OK",
                &format!("{commit_header}ETag: \"{etag}\"\r\n"),
                body,
            );
        }
        let mut rest = Vec::new();
        let _ = reader.read_to_end(&mut rest);
    });
    for listener in listeners {
        let (handle, stop) = (handle.clone(), stop.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                if let Ok(stream) = stream {
                    handle(stream);
                }
            }
        });
    }
    StandIn { url, log, stop, addrs }
}

fn hub(server: &StandIn, cache: &Path) -> Hub {
    Hub {
        endpoint: server.url.clone(),
        token: Some("secret".into()),
        cache: cache.to_path_buf(),
        offline: false,
    }
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("axiom-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs Python code with `env`, returning its stdout; fails the test if it fails.
fn python(code: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new("python3")
        .args(["-c", code])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(out.status.success(), "python: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `axiom run` on `model` for a few greedy tokens, with `env`.
fn axiom_run(model: &str, env: &[(&str, &Path)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_axiom"))
        .args(["run", "-m", model, "-n", "4", "--temp", "0", "-q", "The license"])
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

#[test]
fn sources_parse() {
    let m = HubModel::parse("hf:org/repo@v1.0/model.Q4_K.gguf").unwrap();
    assert_eq!(
        (m.repo.as_str(), m.revision.as_str(), m.file.as_deref()),
        ("org/repo", "v1.0", Some("model.Q4_K.gguf"))
    );
    assert_eq!(HubModel::parse("hf:org/repo").unwrap().revision, "main");
    let q = HubModel::parse("hf:org/repo@dev:q4_k_m").unwrap();
    assert_eq!((q.revision.as_str(), q.quant.as_deref()), ("dev", Some("q4_k_m")));
    for bad in [
        "hf:org",
        "hf:/repo",
        "hf:org/../x",
        "hf:org/repo/../../etc",
        "org/repo",
        "hf:org/repo:",
        "hf:org/repo:Q4-K",
        "hf:org/repo:Q4_K/file.gguf",
    ] {
        assert!(HubModel::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn directories_download_load_and_then_work_offline() {
    let cache = temp("dir");
    let server = stand_in(
        vec![
            ("test/qwen3", repo_of(&hf_fixture("qwen3"))),
            ("test/llama", repo_of(&hf_fixture("llama"))),
        ],
        "secret",
        Faults::default(),
    );
    for name in ["qwen3", "llama"] {
        let model = HubModel::parse(&format!("hf:test/{name}")).unwrap();
        let dir = hub(&server, &cache).fetch(&model).unwrap();
        let commit = commit_of(&format!("test/{name}"));
        assert_eq!(dir, cache.join(format!("models--test--{name}/snapshots/{commit}")));
        let refs = std::fs::read_to_string(cache.join(format!("models--test--{name}/refs/main"))).unwrap();
        assert_eq!(refs, commit);
        let err = worst_error(&dir, &hf_fixture(name), CpuBackend::reference(1));
        assert!(err < 1e-4, "{name}: {err}");
    }
    let log = server.log.lock().unwrap().clone();
    // The sharded llama came through its index, from the CDN, which never saw the token.
    assert!(log.iter().any(|s| s.path.starts_with("/cdn/")));
    assert!(log.iter().filter(|s| s.path.starts_with("/cdn/")).all(|s| !s.token));
    let shard = cache.join(format!(
        "models--test--llama/snapshots/{}/model-00004-of-00004.safetensors",
        commit_of("test/llama")
    ));
    let body = std::fs::read(hf_fixture("llama").join("model-00004-of-00004.safetensors")).unwrap();
    assert_eq!(
        std::fs::read_link(&shard).unwrap(),
        PathBuf::from(format!("../../blobs/{}", sha256(&body)))
    );
    // A cached snapshot is used without fetching its files again.
    let before = log.len();
    hub(&server, &cache)
        .fetch(&HubModel::parse("hf:test/qwen3").unwrap())
        .unwrap();
    let again: Vec<Seen> = server.log.lock().unwrap()[before..].to_vec();
    assert!(
        again.len() == 1 && again[0].path.starts_with("/api/"),
        "only the listing: {again:?}"
    );
    // Without a token the stand-in refuses, and the error says what to set.
    let no_token = Hub {
        token: None,
        ..hub(&server, &temp("no-token"))
    };
    let err = no_token
        .fetch(&HubModel::parse("hf:test/qwen3").unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("401") && err.contains("HF_TOKEN"), "{err}");
    let url = server.url.clone();
    drop(server);
    // The hub unreachable: the cache serves.
    let unreachable = Hub {
        endpoint: url.clone(),
        token: None,
        cache: cache.clone(),
        offline: false,
    };
    let dir = unreachable.fetch(&HubModel::parse("hf:test/qwen3").unwrap()).unwrap();
    assert!(dir.join("model.safetensors").is_file());
    // Offline: the cache or an error naming what is missing.
    let offline = Hub {
        offline: true,
        ..unreachable
    };
    assert!(offline.fetch(&HubModel::parse("hf:test/llama").unwrap()).is_ok());
    std::fs::remove_file(shard).unwrap();
    let err = offline
        .fetch(&HubModel::parse("hf:test/llama").unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("HF_HUB_OFFLINE")
            && err.contains("model-00004-of-00004.safetensors of test/llama@main is not in the hub cache"),
        "{err}"
    );
    let err = offline
        .fetch(&HubModel::parse("hf:test/other").unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("test/other@main is not in the hub cache"), "{err}");
    std::fs::remove_dir_all(cache).unwrap();
}

#[test]
fn a_broken_download_resumes_with_a_range_request() {
    let cache = temp("resume");
    let faults = Faults {
        truncate_once: ["model.safetensors".to_string()].into(),
        ..Default::default()
    };
    let server = stand_in(vec![("test/qwen3", repo_of(&hf_fixture("qwen3")))], "secret", faults);
    let model = HubModel::parse("hf:test/qwen3").unwrap();
    let first = hub(&server, &cache).fetch(&model);
    assert!(first.is_err(), "the connection broke off");
    let body = std::fs::read(hf_fixture("qwen3").join("model.safetensors")).unwrap();
    let incomplete = cache.join(format!("models--test--qwen3/blobs/{}.incomplete", sha256(&body)));
    assert_eq!(std::fs::metadata(&incomplete).unwrap().len(), body.len() as u64 / 2);
    let dir = hub(&server, &cache).fetch(&model).unwrap();
    let ranged = server
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|s| s.path.starts_with("/cdn/") && s.range.is_some());
    assert!(ranged, "the second attempt asked for the rest only");
    assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), body);
    assert!(!incomplete.exists());
    std::fs::remove_dir_all(cache).unwrap();
}

#[test]
fn a_bad_checksum_is_rejected() {
    for file in ["model.safetensors", "tokenizer.json"] {
        let cache = temp("sha");
        let faults = Faults {
            wrong_sha: [file.to_string()].into(),
            ..Default::default()
        };
        let server = stand_in(vec![("test/qwen3", repo_of(&hf_fixture("qwen3")))], "secret", faults);
        let model = HubModel::parse("hf:test/qwen3").unwrap();
        let err = hub(&server, &cache).fetch(&model).unwrap_err().to_string();
        assert!(err.contains("checksum mismatch") && err.contains(file), "{err}");
        let snapshot = cache.join(format!("models--test--qwen3/snapshots/{}", commit_of("test/qwen3")));
        assert!(!snapshot.join(file).exists());
        let blobs: Vec<_> = std::fs::read_dir(cache.join("models--test--qwen3/blobs"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(blobs.iter().all(|b| !b.starts_with("0000")), "{blobs:?}");
        std::fs::remove_dir_all(cache).unwrap();
    }
}

/// A repository of GGUFs in several quantizations (the same tiny model under each name).
fn gguf_repo() -> Repo {
    let dir = temp("gguf-repo");
    let path = dir.join("tiny.gguf");
    axiom::convert::convert_hf_dir(
        &hf_fixture("qwen2"),
        &path,
        axiom::format::quant::GgmlType::Q8_0,
        |_, _, _| {},
    )
    .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    [
        "tiny-Q8_0.gguf",
        "tiny-Q4_K_M.gguf",
        "tiny-Q6_K-00001-of-00002.gguf",
        "tiny-Q6_K-00002-of-00002.gguf",
    ]
    .into_iter()
    .map(|name| (name.to_string(), bytes.clone()))
    .chain([("README.md".to_string(), b"tiny".to_vec())])
    .collect()
}

#[test]
fn a_quantization_from_a_repository_of_ggufs_and_the_cli() {
    let cache = temp("gguf");
    let server = stand_in(
        vec![
            ("test/tiny-gguf", gguf_repo()),
            ("test/qwen2", repo_of(&hf_fixture("qwen2"))),
        ],
        "secret",
        Faults::default(),
    );
    let snapshot = cache.join(format!(
        "models--test--tiny-gguf/snapshots/{}",
        commit_of("test/tiny-gguf")
    ));
    let fetch = |source: &str| hub(&server, &cache).fetch(&HubModel::parse(source).unwrap());
    assert_eq!(
        fetch("hf:test/tiny-gguf:q8_0").unwrap(),
        snapshot.join("tiny-Q8_0.gguf")
    );
    // No quantization named: Q4_K_M, as llama.cpp picks.
    assert_eq!(fetch("hf:test/tiny-gguf").unwrap(), snapshot.join("tiny-Q4_K_M.gguf"));
    assert_eq!(
        fetch("hf:test/tiny-gguf/tiny-Q8_0.gguf").unwrap(),
        snapshot.join("tiny-Q8_0.gguf")
    );
    // Both names share one blob.
    assert_eq!(std::fs::read_dir(snapshot.join("../../blobs")).unwrap().count(), 1);
    let err = fetch("hf:test/tiny-gguf:Q5_K_M").unwrap_err().to_string();
    assert!(
        err.contains("no GGUF in Q5_K_M") && err.contains("Q4_K_M, Q6_K, Q8_0"),
        "{err}"
    );
    let err = fetch("hf:test/tiny-gguf:Q6_K").unwrap_err().to_string();
    assert!(err.contains("split GGUF"), "{err}");

    // `axiom run -m hf:...` with the hub's address, token and cache from the environment.
    let endpoint = PathBuf::from(&server.url);
    let out = axiom_run(
        "hf:test/tiny-gguf:Q8_0",
        &[
            ("HF_ENDPOINT", &endpoint),
            ("HF_TOKEN", Path::new("secret")),
            ("HF_HOME", &cache.join("home")),
        ],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(cache.join("home/hub/models--test--tiny-gguf/refs/main").is_file());
    let dir_run = axiom_run(
        "hf:test/qwen2",
        &[
            ("HF_ENDPOINT", &endpoint),
            ("HF_TOKEN", Path::new("secret")),
            ("HF_HUB_CACHE", &cache),
        ],
    );
    assert!(dir_run.status.success(), "{}", String::from_utf8_lossy(&dir_run.stderr));
    drop(server);
    // Offline, from the cache, with the same text.
    let again = axiom_run(
        "hf:test/qwen2",
        &[
            ("HF_ENDPOINT", &endpoint),
            ("HF_HUB_CACHE", &cache),
            ("HF_HUB_OFFLINE", Path::new("1")),
        ],
    );
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(again.stdout, dir_run.stdout);
    let missing = axiom_run(
        "hf:test/qwen2:Q8_0",
        &[("HF_HUB_CACHE", &cache), ("HF_HUB_OFFLINE", Path::new("1"))],
    );
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && stderr.contains("HF_HUB_OFFLINE"),
        "{stderr}"
    );
    std::fs::remove_dir_all(cache).unwrap();
}

/// huggingface_hub fills a cache from the stand-in and axiom runs from it offline; axiom fills
/// one and huggingface_hub finds every file in it.
#[test]
fn the_cache_is_shared_with_huggingface_hub() {
    let ours = temp("interop-axiom");
    let theirs = temp("interop-python");
    let server = stand_in(
        vec![
            ("test/qwen2", repo_of(&hf_fixture("qwen2"))),
            ("test/llama", repo_of(&hf_fixture("llama"))),
        ],
        "secret",
        Faults::default(),
    );
    let files: Vec<String> = repo_of(&hf_fixture("qwen2")).into_keys().collect();
    let theirs_text = theirs.to_string_lossy().into_owned();
    let env = [
        ("HF_ENDPOINT", server.url.as_str()),
        ("HF_TOKEN", "secret"),
        ("HF_HUB_CACHE", theirs_text.as_str()),
        ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ];
    python(
        &format!(
            "from huggingface_hub import hf_hub_download\n\
             for f in {files:?}: hf_hub_download('test/qwen2', f)"
        ),
        &env,
    );
    let python_made = axiom_run(
        "hf:test/qwen2",
        &[("HF_HUB_CACHE", &theirs), ("HF_HUB_OFFLINE", Path::new("1"))],
    );
    assert!(
        python_made.status.success(),
        "{}",
        String::from_utf8_lossy(&python_made.stderr)
    );

    let dir = hub(&server, &ours)
        .fetch(&HubModel::parse("hf:test/llama").unwrap())
        .unwrap();
    drop(server);
    let ours_text = ours.to_string_lossy().into_owned();
    let report = python(
        "from huggingface_hub import scan_cache_dir, try_to_load_from_cache\n\
         info = scan_cache_dir()\n\
         assert not info.warnings, info.warnings\n\
         (repo,) = info.repos\n\
         (rev,) = repo.revisions\n\
         print(repo.repo_id, sorted(rev.refs), rev.commit_hash)\n\
         for f in sorted(f.file_name for f in rev.files): print(f, try_to_load_from_cache('test/llama', f))",
        &[("HF_HUB_CACHE", &ours_text), ("HF_HUB_OFFLINE", "1")],
    );
    let mut lines = report.lines();
    assert_eq!(
        lines.next().unwrap(),
        format!("test/llama ['main'] {}", commit_of("test/llama"))
    );
    let found: Vec<(&str, &str)> = lines.map(|l| l.split_once(' ').unwrap()).collect();
    let mut fetched: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    fetched.sort();
    assert_eq!(found.iter().map(|(f, _)| f.to_string()).collect::<Vec<_>>(), fetched);
    for (file, path) in found {
        assert_eq!(Path::new(path), dir.join(file));
    }
    std::fs::remove_dir_all(ours).unwrap();
    std::fs::remove_dir_all(theirs).unwrap();
}
