//! Models from the Hugging Face hub: `hf:ORG/REPO[@REVISION][:QUANT]` or
//! `hf:ORG/REPO[@REVISION]/FILE`.
//!
//! The cache is huggingface_hub's own (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`), laid out as it lays it out, so each finds what the other fetched:
//! `models--ORG--REPO/refs/REVISION` holds the commit, `blobs/ETAG` the bytes, and
//! `snapshots/COMMIT/FILE` links to its blob. The repository's files are listed through the hub's
//! API; a blob is resumed from `blobs/ETAG.incomplete` with a range request, checked against its
//! ETag (sha256 for LFS files, the git blob sha1 for others) and renamed into place only when
//! complete. `HF_HUB_OFFLINE=1` uses the cache only; an unreachable hub falls back to it too.
//! `HF_TOKEN` (else `HF_HOME/token`) and `HF_ENDPOINT` are honoured.

use crate::cache::download_bar;
use crate::{Error, Result};
use sha1::Sha1;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The quantization a repository of GGUF files is read in when `hf:` names none, as in llama.cpp.
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// A parsed `hf:` source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubModel {
    pub repo: String,
    pub revision: String,
    /// A single file to fetch (a GGUF).
    pub file: Option<String>,
    /// The quantization whose GGUF to pick from the repository's files (`:Q4_K_M`).
    pub quant: Option<String>,
}

impl HubModel {
    pub fn parse(source: &str) -> Result<HubModel> {
        let bad = || {
            Error::InvalidArgument(format!(
                "{source:?} is not hf:ORG/REPO[@REVISION][:QUANT] or hf:ORG/REPO[@REVISION]/FILE"
            ))
        };
        let rest = source.strip_prefix("hf:").ok_or_else(bad)?;
        let mut parts = rest.splitn(3, '/');
        let (org, repo_part) = (parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?);
        let file = parts.next().map(str::to_owned);
        let (repo_rev, quant) = match repo_part.split_once(':') {
            Some(_) if file.is_some() => return Err(bad()),
            Some((repo_rev, quant)) => (repo_rev, Some(quant)),
            None => (repo_part, None),
        };
        let (repo, revision) = repo_rev.split_once('@').unwrap_or((repo_rev, "main"));
        if !safe_name(org)
            || !safe_name(repo)
            || !safe_name(revision)
            || file.as_deref().is_some_and(|f| !safe_path(f))
            || quant.is_some_and(|q| q.is_empty() || !q.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            return Err(bad());
        }
        Ok(HubModel {
            repo: format!("{org}/{repo}"),
            revision: revision.into(),
            file,
            quant: quant.map(str::to_owned),
        })
    }

    fn describe(&self) -> String {
        format!("{}@{}", self.repo, self.revision)
    }
}

/// A name that stays inside the directory it is joined to.
fn safe_name(s: &str) -> bool {
    !s.is_empty() && !s.starts_with('.') && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

fn safe_path(path: &str) -> bool {
    path.split('/').all(safe_name)
}

/// Where and how to fetch.
#[derive(Debug, Clone)]
pub struct Hub {
    pub endpoint: String,
    pub token: Option<String>,
    /// The hub cache directory (the one holding `models--ORG--REPO`).
    pub cache: PathBuf,
    /// Never use the network (`HF_HUB_OFFLINE`).
    pub offline: bool,
}

/// huggingface_hub's home: `HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
pub fn hf_home() -> Result<PathBuf> {
    if let Some(home) = non_empty_var("HF_HOME") {
        return Ok(PathBuf::from(home));
    }
    if let Some(xdg) = non_empty_var("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(xdg).join("huggingface"));
    }
    dirs::home_dir()
        .map(|home| home.join(".cache/huggingface"))
        .ok_or_else(|| Error::Download("no home directory for the hub cache: set HF_HOME or HF_HUB_CACHE".into()))
}

/// The hub cache: `HF_HUB_CACHE`, else `hf_home()/hub`.
pub fn hub_cache_dir() -> Result<PathBuf> {
    match non_empty_var("HF_HUB_CACHE") {
        Some(dir) => Ok(PathBuf::from(dir)),
        None => Ok(hf_home()?.join("hub")),
    }
}

/// `HF_HUB_OFFLINE` set to a true value, as huggingface_hub reads it.
pub fn offline_from_env() -> bool {
    non_empty_var("HF_HUB_OFFLINE")
        .is_some_and(|v| ["1", "on", "yes", "true"].contains(&v.to_ascii_lowercase().as_str()))
}

fn non_empty_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// What a source names once the repository's files are known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// A Hugging Face model directory (`config.json`, tokenizer, safetensors).
    Directory,
    /// One file of the repository.
    File(String),
}

/// The quantization tag in a GGUF file name (`Llama-3.2-1B-Q4_K_M.gguf` -> `Q4_K_M`), upper case.
pub fn quant_tag(file: &str) -> Option<String> {
    let name = file.rsplit('/').next().unwrap_or(file);
    let stem = strip_suffix_ignore_case(name, ".gguf")?;
    let stem = split_part(stem).map_or(stem, |(first, _)| first);
    stem.split(['-', '.']).rev().find_map(|token| {
        let upper = token.to_ascii_uppercase();
        let numbered = ["Q", "IQ", "TQ"].iter().any(|prefix| {
            upper
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        });
        let float = ["F16", "BF16", "F32"].contains(&upper.as_str());
        ((numbered || float) && upper.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')).then_some(upper)
    })
}

fn strip_suffix_ignore_case<'a>(s: &'a str, suffix: &str) -> Option<&'a str> {
    let cut = s.len().checked_sub(suffix.len())?;
    (s.is_char_boundary(cut) && s[cut..].eq_ignore_ascii_case(suffix)).then(|| &s[..cut])
}

/// `(stem, parts)` of a split GGUF's stem, `NAME-00001-of-00003`.
fn split_part(stem: &str) -> Option<(&str, &str)> {
    let (rest, total) = stem.rsplit_once("-of-")?;
    let (first, index) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.chars().all(|c| c.is_ascii_digit());
    (digits(index) && digits(total)).then_some((first, total))
}

fn is_gguf(file: &str) -> bool {
    let name = file.rsplit('/').next().unwrap_or(file);
    // Multimodal projectors sit beside the models in GGUF repositories; they are not models.
    strip_suffix_ignore_case(name, ".gguf").is_some() && !name.to_ascii_lowercase().starts_with("mmproj")
}

/// The refusal of a split GGUF's part, `None` for a whole file.
fn split_error(file: &str) -> Option<Error> {
    let stem = strip_suffix_ignore_case(file, ".gguf").unwrap_or(file);
    split_part(stem).map(|(_, total)| {
        Error::InvalidArgument(format!(
            "{file} is one of {} parts of a split GGUF; axiom reads single-file GGUFs: join the parts \
             with llama.cpp's `llama-gguf-split --merge` and pass the file with -m",
            total.trim_start_matches('0')
        ))
    })
}

/// Picks what `model` names among the repository's `files`: its file; the GGUF of its quantization;
/// else a model directory if there are a `config.json` and safetensors, else the `DEFAULT_QUANT`
/// GGUF or the only one.
pub fn choose(model: &HubModel, files: &[String]) -> Result<Choice> {
    if let Some(file) = &model.file {
        return match split_error(file) {
            Some(refusal) => Err(refusal),
            None => Ok(Choice::File(file.clone())),
        };
    }
    let ggufs: Vec<&String> = files.iter().filter(|f| is_gguf(f)).collect();
    let listed = |name: &str| files.iter().any(|f| f == name);
    let available = || {
        let mut tags: Vec<String> = ggufs
            .iter()
            .map(|f| quant_tag(f).unwrap_or_else(|| f.to_string()))
            .collect();
        tags.sort();
        tags.dedup();
        tags.join(", ")
    };
    let quant = match &model.quant {
        Some(quant) => quant.as_str(),
        // GGUF repositories may carry a config.json too: a directory needs its safetensors.
        None if listed("config.json") && (listed("model.safetensors") || listed(SHARD_INDEX) || ggufs.is_empty()) => {
            return Ok(Choice::Directory)
        }
        None if ggufs.is_empty() => {
            return Err(Error::InvalidArgument(format!(
                "{} has neither a config.json nor GGUF files",
                model.describe()
            )))
        }
        None if ggufs.len() == 1 => {
            return match split_error(ggufs[0]) {
                Some(refusal) => Err(refusal),
                None => Ok(Choice::File(ggufs[0].clone())),
            };
        }
        None => DEFAULT_QUANT,
    };
    // Whole files first; a split file is refused only when nothing else holds the quantization.
    let mut matching = Vec::new();
    let mut split = None;
    for file in ggufs
        .iter()
        .filter(|f| quant_tag(f).is_some_and(|tag| tag.eq_ignore_ascii_case(quant)))
    {
        match split_error(file) {
            Some(refusal) => split = split.or(Some(refusal)),
            None => matching.push(*file),
        }
    }
    if let (true, Some(refusal)) = (matching.is_empty(), split) {
        return Err(refusal);
    }
    match matching.as_slice() {
        [] if model.quant.is_none() => Err(Error::InvalidArgument(format!(
            "{} holds several GGUFs and no {DEFAULT_QUANT}; pick one with hf:{}:QUANT, from: {}",
            model.describe(),
            model.repo,
            available()
        ))),
        [] if ggufs.is_empty() => Err(Error::InvalidArgument(format!(
            "{} has no GGUF files to pick {quant} from",
            model.describe()
        ))),
        [] => Err(Error::InvalidArgument(format!(
            "{} has no GGUF in {quant}; it has: {}",
            model.describe(),
            available()
        ))),
        [file] => Ok(Choice::File((*file).clone())),
        several => {
            let names: Vec<&str> = several.iter().map(|f| f.as_str()).collect();
            Err(Error::InvalidArgument(format!(
                "{} has several {quant} GGUFs: {}; name one with hf:{}/FILE",
                model.describe(),
                names.join(", "),
                model.repo
            )))
        }
    }
}

/// The optional files of a model directory, fetched when the repository has them.
const OPTIONAL_FILES: [&str; 3] = ["tokenizer_config.json", "generation_config.json", "chat_template.jinja"];
const SHARD_INDEX: &str = "model.safetensors.index.json";

/// Fetches (or finds) every file a model directory needs through `get`, which returns a file's
/// path; `missing` says that a file it needs is not among `files`.
fn gather_directory(
    files: &[String],
    mut get: impl FnMut(&str) -> Result<PathBuf>,
    missing: impl Fn(&str) -> Error,
) -> Result<()> {
    let listed = |name: &str| files.iter().any(|f| f == name);
    for required in ["config.json", "tokenizer.json"] {
        if !listed(required) {
            return Err(missing(required));
        }
        get(required)?;
    }
    for optional in OPTIONAL_FILES {
        if listed(optional) {
            get(optional)?;
        }
    }
    if !listed(SHARD_INDEX) {
        if !listed("model.safetensors") {
            return Err(missing("model.safetensors"));
        }
        return get("model.safetensors").map(drop);
    }
    let index = fs::read_to_string(get(SHARD_INDEX)?).map_err(Error::io("reading the shard index"))?;
    let json: serde_json::Value =
        serde_json::from_str(&index).map_err(|e| Error::Download(format!("shard index: {e}")))?;
    let shards: std::collections::BTreeSet<&str> = json["weight_map"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(_, v)| v.as_str())
        .collect();
    for shard in shards {
        if !safe_name(shard) {
            return Err(Error::Download(format!(
                "shard name {shard:?} leaves the model directory"
            )));
        }
        if !listed(shard) {
            return Err(missing(shard));
        }
        get(shard)?;
    }
    Ok(())
}

/// What a HEAD on a file's `resolve` URL says.
struct FileMeta {
    etag: String,
    size: Option<u64>,
    /// Where the bytes are (a CDN's signed URL, or the resolve URL itself).
    url: String,
}

impl Hub {
    pub fn from_env() -> Result<Hub> {
        let token = match non_empty_var("HF_TOKEN") {
            Some(token) => Some(token),
            None => fs::read_to_string(hf_home()?.join("token"))
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty()),
        };
        Ok(Hub {
            endpoint: non_empty_var("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()),
            token,
            cache: hub_cache_dir()?,
            offline: offline_from_env(),
        })
    }

    /// The cache directory of `repo`, `models--ORG--REPO`.
    pub fn repo_dir(&self, repo: &str) -> PathBuf {
        self.cache.join(format!("models--{}", repo.replace('/', "--")))
    }

    /// The local path of the model: the GGUF file, or the snapshot directory.
    pub fn fetch(&self, model: &HubModel) -> Result<PathBuf> {
        if self.offline {
            return self
                .from_cache(model)
                .map_err(|e| Error::Download(format!("HF_HUB_OFFLINE is set and the cache cannot serve it: {e}")));
        }
        let (commit, files) = match self.list(model) {
            Ok(listing) => listing,
            Err(Unreachable(e)) => {
                tracing::warn!("the hub is unreachable ({e}); looking in the cache");
                return self
                    .from_cache(model)
                    .map_err(|cached| Error::Download(format!("{e}; and the cache cannot serve it: {cached}")));
            }
            Err(Failed(e)) => return Err(e),
        };
        let repo_dir = self.repo_dir(&model.repo);
        if model.revision != commit {
            let refs = repo_dir.join("refs");
            fs::create_dir_all(&refs).map_err(Error::io(format!("creating {}", refs.display())))?;
            let ref_file = refs.join(&model.revision);
            fs::write(&ref_file, &commit).map_err(Error::io(format!("writing {}", ref_file.display())))?;
        }
        let snapshot = repo_dir.join("snapshots").join(&commit);
        match choose(model, &files)? {
            Choice::File(file) => self.download(model, &commit, &file),
            Choice::Directory => {
                let missing = |file: &str| Error::Download(format!("{} has no {file}", model.describe()));
                gather_directory(&files, |file| self.download(model, &commit, file), missing)?;
                Ok(snapshot)
            }
        }
    }

    /// The model from the cache alone: the revision's commit from `refs/`, the files its snapshot holds.
    pub fn from_cache(&self, model: &HubModel) -> Result<PathBuf> {
        let repo_dir = self.repo_dir(&model.repo);
        let ref_file = repo_dir.join("refs").join(&model.revision);
        let commit = match fs::read_to_string(&ref_file) {
            Ok(commit) => commit.trim().to_string(),
            Err(_) if is_commit(&model.revision) => model.revision.clone(),
            Err(_) => {
                return Err(Error::Download(format!(
                    "{} is not in the hub cache ({} is missing)",
                    model.describe(),
                    ref_file.display()
                )))
            }
        };
        let snapshot = repo_dir.join("snapshots").join(&commit);
        let mut files = Vec::new();
        list_snapshot(&snapshot, "", &mut files)?;
        let missing = |file: &str| {
            Error::Download(format!(
                "{file} of {} is not in the hub cache ({})",
                model.describe(),
                snapshot.join(file).display()
            ))
        };
        match choose(model, &files)? {
            Choice::File(file) if files.contains(&file) => Ok(snapshot.join(file)),
            Choice::File(file) => Err(missing(&file)),
            Choice::Directory => {
                gather_directory(&files, |file| Ok(snapshot.join(file)), missing)?;
                Ok(snapshot)
            }
        }
    }

    fn agent(&self) -> ureq::Agent {
        ureq::Agent::config_builder().max_redirects(0).build().new_agent()
    }

    fn authorized<B>(&self, request: ureq::RequestBuilder<B>, url: &str) -> ureq::RequestBuilder<B> {
        // The token goes to the hub only, never to the CDN a file redirects to.
        match &self.token {
            Some(token) if url.starts_with(&self.endpoint) => {
                request.header("Authorization", &format!("Bearer {token}"))
            }
            _ => request,
        }
    }

    /// The commit `model.revision` points at and the repository's files, from the hub's API.
    fn list(&self, model: &HubModel) -> std::result::Result<(String, Vec<String>), Fetch> {
        let url = format!(
            "{}/api/models/{}/revision/{}",
            self.endpoint.trim_end_matches('/'),
            model.repo,
            model.revision
        );
        let response = self
            .authorized(self.agent().get(&url), &url)
            .call()
            .map_err(|e| classify(&url, e))?;
        let body = response
            .into_body()
            .read_to_string()
            .map_err(|e| Failed(Error::Download(format!("{url}: {e}"))))?;
        let json: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| Failed(Error::Download(format!("{url}: {e}"))))?;
        let commit = json["sha"]
            .as_str()
            .filter(|sha| is_commit(sha))
            .ok_or_else(|| Failed(Error::Download(format!("{url}: no commit (`sha`) in the answer"))))?;
        let files = json["siblings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["rfilename"].as_str().map(str::to_owned))
            .collect();
        Ok((commit.to_string(), files))
    }

    /// Where a file's bytes are and what they hash to, from a HEAD that follows the hub's own
    /// (relative) redirects but not the CDN's, whose answer lacks the hub's headers.
    fn meta(&self, url: &str) -> Result<FileMeta> {
        let mut url = url.to_string();
        for _ in 0..5 {
            // Uncompressed, so that the sizes are the file's (as huggingface_hub asks).
            let response = self
                .authorized(self.agent().head(&url), &url)
                .header("Accept-Encoding", "identity")
                .call()
                .map_err(|e| Error::Download(format!("{url}: {e}")))?;
            let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
            let location = header("location").map(str::to_owned);
            if let Some(relative) = location.as_deref().filter(|l| l.starts_with('/')) {
                url = format!("{}{relative}", self.endpoint.trim_end_matches('/'));
                continue;
            }
            let etag = header("x-linked-etag")
                .or_else(|| header("etag"))
                .map(|v| v.trim_start_matches("W/").trim_matches('"').to_string())
                .filter(|etag| safe_name(etag))
                .ok_or_else(|| Error::Download(format!("{url}: the hub sent no usable ETag")))?;
            let size = header("x-linked-size")
                .or_else(|| header("content-length"))
                .and_then(|v| v.parse().ok());
            return Ok(FileMeta {
                etag,
                size,
                url: location.unwrap_or(url),
            });
        }
        Err(Error::Download(format!("{url}: too many redirects")))
    }

    /// The snapshot path of `file` at `commit`, downloading its blob first if it is not cached.
    fn download(&self, model: &HubModel, commit: &str, file: &str) -> Result<PathBuf> {
        if !safe_path(file) {
            return Err(Error::Download(format!(
                "file name {file:?} leaves the model directory"
            )));
        }
        let repo_dir = self.repo_dir(&model.repo);
        let target = repo_dir.join("snapshots").join(commit).join(file);
        if target.is_file() {
            return Ok(target);
        }
        let url = format!(
            "{}/{}/resolve/{commit}/{file}",
            self.endpoint.trim_end_matches('/'),
            model.repo
        );
        let meta = self.meta(&url)?;
        let blobs = repo_dir.join("blobs");
        fs::create_dir_all(&blobs).map_err(Error::io(format!("creating {}", blobs.display())))?;
        let blob = blobs.join(&meta.etag);
        if !blob.is_file() {
            self.download_blob(&meta, file, &blob)?;
        }
        let parent = target.parent().unwrap_or(&repo_dir);
        fs::create_dir_all(parent).map_err(Error::io(format!("creating {}", parent.display())))?;
        link_to_blob(&target, file, &meta.etag)?;
        Ok(target)
    }

    /// Downloads into `blob.incomplete`, resuming what is there, checks the bytes against the
    /// ETag, and renames the file into place.
    fn download_blob(&self, meta: &FileMeta, file: &str, blob: &Path) -> Result<()> {
        let partial = blob.with_extension("incomplete");
        let have = fs::metadata(&partial).map_or(0, |m| m.len());
        // A partial file as long as the blob was complete before the rename: check it as it is.
        if have == 0 || meta.size.is_none_or(|size| have < size) {
            self.fetch_into(meta, file, &partial, have)?;
        }
        if let Err(e) = check_blob(&partial, meta) {
            let _ = fs::remove_file(&partial);
            return Err(Error::Download(format!("{file} from {}: {e}", meta.url)));
        }
        fs::rename(&partial, blob).map_err(Error::io(format!("renaming into {}", blob.display())))
    }

    /// Appends the rest of the file after the `have` bytes already in `partial`.
    fn fetch_into(&self, meta: &FileMeta, file: &str, partial: &Path, have: u64) -> Result<()> {
        let mut request = self
            .authorized(ureq::Agent::new_with_defaults().get(&meta.url), &meta.url)
            .header("Accept-Encoding", "identity");
        if have > 0 {
            request = request.header("Range", &format!("bytes={have}-"));
        }
        let url = &meta.url;
        let response = request.call().map_err(|e| Error::Download(format!("{url}: {e}")))?;
        let resumed = response.status() == 206;
        let mut out = fs::OpenOptions::new()
            .create(true)
            .append(resumed)
            .write(true)
            .truncate(!resumed)
            .open(partial)
            .map_err(Error::io(format!("opening {}", partial.display())))?;
        let bar = download_bar(meta.size);
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
        Ok(())
    }
}

/// Why a listing failed: the hub could not be reached (the cache may serve), or it answered no.
enum Fetch {
    Unreachable(Error),
    Failed(Error),
}
use Fetch::{Failed, Unreachable};

fn classify(url: &str, e: ureq::Error) -> Fetch {
    match e {
        ureq::Error::StatusCode(401) => Failed(Error::Download(format!(
            "{url}: HTTP 401 (a gated or private repository needs HF_TOKEN)"
        ))),
        ureq::Error::StatusCode(code) => Failed(Error::Download(format!("{url}: HTTP {code}"))),
        other => Unreachable(Error::Download(format!("{url}: {other}"))),
    }
}

fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// Checks a downloaded file against its ETag: a sha256 (LFS files) or a git blob sha1.
fn check_blob(path: &Path, meta: &FileMeta) -> std::result::Result<(), String> {
    let size = fs::metadata(path).map_err(|e| e.to_string())?.len();
    if let Some(expected) = meta.size.filter(|&expected| expected != size) {
        return Err(format!("{size} bytes, the hub says {expected}"));
    }
    let etag = meta.etag.to_ascii_lowercase();
    let got = match etag.len() {
        64 => hash_file(path, Sha256::new(), &[])?,
        40 => hash_file(path, Sha1::new(), format!("blob {size}\0").as_bytes())?,
        _ => {
            return Err(format!(
                "ETag {etag:?} is neither a sha256 nor a git sha1; the bytes cannot be checked"
            ))
        }
    };
    match got == etag {
        true => Ok(()),
        false => Err(format!("checksum mismatch: got {got}, the hub says {etag}")),
    }
}

fn hash_file<D: Digest>(path: &Path, mut hasher: D, prefix: &[u8]) -> std::result::Result<String, String> {
    hasher.update(prefix);
    let mut f = fs::File::open(path).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Points `target` (`snapshots/COMMIT/FILE`) at `blobs/ETAG` with a relative link, as
/// huggingface_hub does; a copy where the platform has no symbolic links.
fn link_to_blob(target: &Path, file: &str, etag: &str) -> Result<()> {
    let up = "../".repeat(1 + file.split('/').count());
    let relative = PathBuf::from(format!("{up}blobs/{etag}"));
    // A link left dangling by a deleted blob is replaced.
    match fs::remove_file(target) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("replacing {}", target.display()))(e)),
    }
    #[cfg(unix)]
    let linked = std::os::unix::fs::symlink(&relative, target);
    #[cfg(not(unix))]
    let linked = target
        .parent()
        .map_or(Ok(0), |dir| fs::copy(dir.join(&relative), target))
        .map(drop);
    linked.map_err(Error::io(format!("linking {}", target.display())))
}

/// The files of a snapshot directory, as paths relative to it with `/` separators.
fn list_snapshot(dir: &Path, prefix: &str, files: &mut Vec<String>) -> Result<()> {
    let entries = fs::read_dir(dir).map_err(Error::io(format!("reading {}", dir.display())))?;
    for entry in entries {
        let entry = entry.map_err(Error::io(format!("reading {}", dir.display())))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if path.is_dir() {
            list_snapshot(&path, &format!("{prefix}{name}/"), files)?;
        } else if path.is_file() {
            files.push(format!("{prefix}{name}"));
        }
    }
    files.sort();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn quant_tags_come_from_file_names() {
        for (name, tag) in [
            ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", Some("Q4_K_M")),
            ("qwen2.5-0.5b-instruct-q8_0.gguf", Some("Q8_0")),
            ("model.IQ4_XS.GGUF", Some("IQ4_XS")),
            ("sub/gemma-3-270m-it-BF16.gguf", Some("BF16")),
            ("big-Q6_K-00001-of-00003.gguf", Some("Q6_K")),
            ("model.gguf", None),
            ("config.json", None),
        ] {
            assert_eq!(quant_tag(name).as_deref(), tag, "{name}");
        }
    }

    #[test]
    fn a_quantization_picks_its_gguf() {
        let repo = files(&[
            "README.md",
            "m-Q4_K_M.gguf",
            "m-Q4_K_S.gguf",
            "m-Q8_0.gguf",
            "mmproj-m-F16.gguf",
            "m-Q6_K-00001-of-00002.gguf",
            "m-Q6_K-00002-of-00002.gguf",
            "m-Q2_K.gguf",
            "v2/m-Q2_K.gguf",
        ]);
        let pick = |source: &str| choose(&HubModel::parse(source).unwrap(), &repo);
        assert_eq!(pick("hf:o/r:q4_k_s").unwrap(), Choice::File("m-Q4_K_S.gguf".into()));
        assert_eq!(pick("hf:o/r").unwrap(), Choice::File("m-Q4_K_M.gguf".into()));
        let none = pick("hf:o/r:Q5_K_M").unwrap_err().to_string();
        assert!(none.contains("Q2_K, Q4_K_M, Q4_K_S, Q6_K, Q8_0"), "{none}");
        assert!(!none.contains("F16"), "projectors are not models: {none}");
        let split = pick("hf:o/r:Q6_K").unwrap_err().to_string();
        assert!(
            split.contains("one of 2 parts") && split.contains("llama-gguf-split"),
            "{split}"
        );
        let several = pick("hf:o/r:Q2_K").unwrap_err().to_string();
        assert!(several.contains("m-Q2_K.gguf, v2/m-Q2_K.gguf"), "{several}");
        let explicit = pick("hf:o/r/m-Q6_K-00001-of-00002.gguf").unwrap_err().to_string();
        assert!(explicit.contains("split GGUF"), "{explicit}");
    }

    #[test]
    fn without_a_quantization() {
        let pick = |names: &[&str]| choose(&HubModel::parse("hf:o/r").unwrap(), &files(names));
        assert_eq!(
            pick(&["config.json", "model.safetensors", "m-Q4_K_M.gguf"]).unwrap(),
            Choice::Directory
        );
        assert_eq!(pick(&["config.json"]).unwrap(), Choice::Directory);
        assert_eq!(
            pick(&["config.json", "m-Q4_K_M.gguf", "m-Q8_0.gguf"]).unwrap(),
            Choice::File("m-Q4_K_M.gguf".into())
        );
        assert_eq!(pick(&["m-F16.gguf"]).unwrap(), Choice::File("m-F16.gguf".into()));
        let err = pick(&["m-F16.gguf", "m-Q8_0.gguf"]).unwrap_err().to_string();
        assert!(err.contains("no Q4_K_M") && err.contains("F16, Q8_0"), "{err}");
        assert!(pick(&["README.md"]).unwrap_err().to_string().contains("neither"));
    }
}
