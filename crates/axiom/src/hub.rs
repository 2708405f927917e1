//! Models from the Hugging Face hub: `hf:ORG/REPO[@REVISION][/FILE]`.
//!
//! Files are downloaded into `<cache>/hub/ORG--REPO/REVISION/` with a progress bar, resumed from
//! a partial file with an HTTP range request, checked against the sha256 the hub sends as the ETag
//! of large files, and renamed into place only when complete. A snapshot that was completed once
//! is used from the cache without the network. `HF_ENDPOINT` and `HF_TOKEN` are honoured.

use crate::cache::download_bar;
use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// A parsed `hf:` source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubModel {
    pub repo: String,
    pub revision: String,
    /// A single file to fetch (a GGUF), or `None` for a model directory.
    pub file: Option<String>,
}

impl HubModel {
    pub fn parse(source: &str) -> Result<HubModel> {
        let bad = || Error::InvalidArgument(format!("{source:?} is not hf:ORG/REPO[@REVISION][/FILE]"));
        let rest = source.strip_prefix("hf:").ok_or_else(bad)?;
        let mut parts = rest.splitn(3, '/');
        let (org, repo_rev) = (parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?);
        let (repo, revision) = repo_rev.split_once('@').unwrap_or((repo_rev, "main"));
        let file = parts.next().map(str::to_owned);
        let ok = |s: &str| {
            !s.is_empty() && !s.starts_with('.') && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if !ok(org) || !ok(repo) || !ok(revision) || file.as_deref().is_some_and(|f| f.split('/').any(|p| !ok(p))) {
            return Err(bad());
        }
        Ok(HubModel {
            repo: format!("{org}/{repo}"),
            revision: revision.into(),
            file,
        })
    }
}

/// Where and how to fetch.
#[derive(Debug, Clone)]
pub struct Hub {
    pub endpoint: String,
    pub token: Option<String>,
    pub cache: PathBuf,
}

impl Hub {
    pub fn from_env() -> Result<Hub> {
        Ok(Hub {
            endpoint: std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into()),
            token: std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()),
            cache: crate::cache::dir()?.join("hub"),
        })
    }

    /// The local path of the model: the GGUF file, or the snapshot directory.
    pub fn fetch(&self, model: &HubModel) -> Result<PathBuf> {
        let dir = self.cache.join(model.repo.replace('/', "--")).join(&model.revision);
        let complete = dir.join(".complete");
        let target = match &model.file {
            Some(file) => dir.join(file),
            None => dir.clone(),
        };
        if complete.is_file() && (model.file.is_none() || target.is_file()) {
            return Ok(target);
        }
        fs::create_dir_all(&dir).map_err(Error::io(format!("creating {}", dir.display())))?;
        match &model.file {
            Some(file) => self.download(model, file, &dir)?,
            None => {
                for file in ["config.json", "tokenizer.json"] {
                    self.download(model, file, &dir)?;
                }
                for optional in ["tokenizer_config.json", "generation_config.json", "chat_template.jinja"] {
                    match self.download(model, optional, &dir) {
                        Ok(()) | Err(Error::Download(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                match self.download(model, "model.safetensors.index.json", &dir) {
                    Ok(()) => {
                        let index = fs::read_to_string(dir.join("model.safetensors.index.json"))
                            .map_err(Error::io("reading the shard index"))?;
                        let json: serde_json::Value =
                            serde_json::from_str(&index).map_err(|e| Error::Download(format!("shard index: {e}")))?;
                        let shards: std::collections::BTreeSet<&str> = json["weight_map"]
                            .as_object()
                            .into_iter()
                            .flatten()
                            .filter_map(|(_, v)| v.as_str())
                            .collect();
                        for shard in shards {
                            if shard.contains('/') || shard.starts_with('.') {
                                return Err(Error::Download(format!(
                                    "shard name {shard:?} leaves the model directory"
                                )));
                            }
                            self.download(model, shard, &dir)?;
                        }
                    }
                    Err(Error::Download(_)) => self.download(model, "model.safetensors", &dir)?,
                    Err(e) => return Err(e),
                }
            }
        }
        fs::write(&complete, b"").map_err(Error::io(format!("writing {}", complete.display())))?;
        Ok(target)
    }

    /// Downloads one file into `dir`, resuming a partial one; a missing file is `Error::Download`.
    fn download(&self, model: &HubModel, file: &str, dir: &Path) -> Result<()> {
        let target = dir.join(file);
        if target.is_file() {
            return Ok(());
        }
        let url = format!(
            "{}/{}/resolve/{}/{file}",
            self.endpoint.trim_end_matches('/'),
            model.repo,
            model.revision
        );
        let partial = dir.join(format!("{file}.partial"));
        let have = fs::metadata(&partial).map_or(0, |m| m.len());
        let mut request = ureq::get(&url);
        if let Some(token) = &self.token {
            request = request.header("Authorization", &format!("Bearer {token}"));
        }
        if have > 0 {
            request = request.header("Range", &format!("bytes={have}-"));
        }
        let response = request.call().map_err(|e| Error::Download(format!("{url}: {e}")))?;
        let resumed = response.status() == 206;
        // Large (LFS) files carry their sha256 as the ETag.
        let expected = ["x-linked-etag", "etag"]
            .iter()
            .filter_map(|h| response.headers().get(*h).and_then(|v| v.to_str().ok()))
            .map(|v| v.trim_start_matches("W/").trim_matches('"').to_ascii_lowercase())
            .find(|v| v.len() == 64 && v.chars().all(|c| c.is_ascii_hexdigit()));
        let length = response
            .body()
            .content_length()
            .map(|n| n + if resumed { have } else { 0 });
        let mut out = fs::OpenOptions::new()
            .create(true)
            .append(resumed)
            .write(true)
            .truncate(!resumed)
            .open(&partial)
            .map_err(Error::io(format!("opening {}", partial.display())))?;
        let bar = download_bar(length);
        bar.set_message(file.to_string());
        bar.set_position(if resumed { have } else { 0 });
        let mut body = response.into_body().into_reader();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = body
                .read(&mut buf)
                .map_err(|e| Error::Download(format!("{url}: {e} (the partial file is kept to resume)")))?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n])
                .map_err(Error::io(format!("writing {}", partial.display())))?;
            bar.inc(n as u64);
        }
        bar.finish_and_clear();
        drop(out);
        if let Some(expected) = expected {
            let mut hasher = Sha256::new();
            let mut f = fs::File::open(&partial).map_err(Error::io("reading back the download"))?;
            loop {
                let n = f.read(&mut buf).map_err(Error::io("reading back the download"))?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
            }
            let got: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
            if got != expected {
                let _ = fs::remove_file(&partial);
                return Err(Error::Download(format!(
                    "{url}: sha256 mismatch: got {got}, the hub says {expected}"
                )));
            }
        }
        fs::rename(&partial, &target).map_err(Error::io(format!("renaming into {}", target.display())))
    }
}
