//! The cache directory, which holds downloaded models, compiled CUDA kernels and the chat
//! history, and the progress bar a download into it shows. Below [`crate::source`],
//! [`crate::hub`] and the backends, so that each of them can use it.

use crate::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// The cache directory: `$AXIOM_CACHE`, else the platform cache dir's `axiom`.
pub fn dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("AXIOM_CACHE").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    dirs::cache_dir()
        .map(|d| d.join("axiom"))
        .ok_or_else(|| Error::Download("no cache directory: set AXIOM_CACHE".into()))
}

/// A progress bar for a download of `size` bytes (unknown: no length).
pub(crate) fn download_bar(size: Option<u64>) -> ProgressBar {
    let bar = match size {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::no_length(),
    };
    let style = ProgressStyle::with_template("{msg} {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}");
    bar.set_style(style.unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar
}
