//! Hugging Face checkpoints: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, each memory-mapped and parsed by the `safetensors` crate (which
//! checks the header size, the JSON, the dtypes and that offsets tile the data exactly). Every
//! tensor's byte range is checked again here against its shape and dtype. FP8 E4M3 weights are
//! packed with their scales (as the config's `quantization_config` lays them out) into
//! [`GgmlType::Fp8`] blocks at open.

mod fp8_weights;

use super::quant::GgmlType;
use crate::model::quantization::Fp8Quantization;
use crate::{Error, Result};
use fp8_weights::RawFp8;
use memmap2::Mmap;
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// The largest safetensors JSON header accepted (the format's own limit is 100 MB).
const MAX_HEADER: usize = 100 << 20;

#[derive(Debug, Clone)]
pub struct StEntry {
    pub name: String,
    pub ty: GgmlType,
    /// GGML order (reversed from safetensors' row-major shape): `dims[0]` is the row length.
    pub dims: Vec<usize>,
    file: usize,
    range: std::ops::Range<usize>,
}

pub struct SafetensorsModel {
    /// The files' maps, then the one holding the FP8 weights as `Fp8` blocks, if any.
    files: Vec<Arc<Mmap>>,
    tensors: HashMap<String, StEntry>,
    /// Bytes of the files on disk.
    disk_bytes: usize,
}

fn bad(path: &Path, problem: impl std::fmt::Display) -> Error {
    Error::Model(format!("{}: {problem}", path.display()))
}

impl SafetensorsModel {
    /// Opens the checkpoint in a model directory, its FP8 weights scaled as `quantization` says
    /// (the config's).
    pub fn open_dir(dir: &Path, quantization: Option<&Fp8Quantization>) -> Result<SafetensorsModel> {
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<String> = if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(Error::io(format!("reading {}", index.display())))?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(&index, e))?;
            let map = json["weight_map"]
                .as_object()
                .ok_or_else(|| bad(&index, "no weight_map"))?;
            let files: BTreeSet<String> = map.values().filter_map(|v| v.as_str().map(str::to_owned)).collect();
            if files
                .iter()
                .any(|f| f.contains('/') || f.contains('\\') || f.starts_with('.'))
            {
                return Err(bad(&index, "a shard name leaves the model directory"));
            }
            files.into_iter().collect()
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut model = SafetensorsModel {
            files: Vec::new(),
            tensors: HashMap::new(),
            disk_bytes: 0,
        };
        let mut fp8 = Vec::new();
        for name in names {
            model.add_file(&dir.join(name), &mut fp8)?;
        }
        model.pack_fp8(fp8, quantization)?;
        Ok(model)
    }

    /// Parses one `.safetensors` file held in memory (tests and fuzzing use this).
    pub fn from_bytes(bytes: &[u8]) -> Result<SafetensorsModel> {
        let mut anon = memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(Error::io("mapping"))?;
        anon[..bytes.len()].copy_from_slice(bytes);
        let map = anon.make_read_only().map_err(Error::io("mapping"))?;
        let mut model = SafetensorsModel {
            files: Vec::new(),
            tensors: HashMap::new(),
            disk_bytes: 0,
        };
        let mut fp8 = Vec::new();
        model.add_map(Path::new("<memory>"), Arc::new(map), bytes.len(), &mut fp8)?;
        model.pack_fp8(fp8, None)?;
        Ok(model)
    }

    fn add_file(&mut self, path: &Path, fp8: &mut Vec<RawFp8>) -> Result<()> {
        let file = File::open(path).map_err(Error::io(format!("opening {}", path.display())))?;
        // SAFETY: read-only map; every offset is validated before use.
        let map = unsafe { Mmap::map(&file) }.map_err(Error::io(format!("mapping {}", path.display())))?;
        let len = map.len();
        self.add_map(path, Arc::new(map), len, fp8)
    }

    /// Adds a file's tensors; its FP8 ones go to `fp8`, to be packed with their scales.
    fn add_map(&mut self, path: &Path, map: Arc<Mmap>, len: usize, fp8: &mut Vec<RawFp8>) -> Result<()> {
        let bytes = &map[..len];
        let Some(&header_len) = bytes.first_chunk::<8>() else {
            return Err(bad(path, "truncated: no header length"));
        };
        let header = u64::from_le_bytes(header_len);
        if header as usize > MAX_HEADER || header as usize > bytes.len() - 8 {
            return Err(bad(
                path,
                format!(
                    "header length {header} is past the end of the {}-byte file",
                    bytes.len()
                ),
            ));
        }
        let (header_len, metadata) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(path, format!("invalid safetensors: {e}")))?;
        let data_start = 8 + header_len;
        let file_index = self.files.len();
        for (name, info) in metadata.tensors() {
            let ty = match info.dtype {
                safetensors::Dtype::F32 => Some(GgmlType::F32),
                safetensors::Dtype::F16 => Some(GgmlType::F16),
                safetensors::Dtype::BF16 => Some(GgmlType::BF16),
                safetensors::Dtype::F8_E4M3 => None,
                other => {
                    return Err(Error::UnsupportedTensorType {
                        name: name.clone(),
                        ty: format!("{other:?}"),
                        op: "the safetensors loader",
                    })
                }
            };
            let (start, end) = info.data_offsets;
            let elements = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let element_bytes = ty.map_or(1, GgmlType::block_bytes);
            let expected = elements.and_then(|n| n.checked_mul(element_bytes));
            if expected != Some(end.wrapping_sub(start)) || end < start {
                return Err(bad(
                    path,
                    format!(
                        "tensor {name}: shape {:?} does not match its {} bytes",
                        info.shape,
                        end.wrapping_sub(start)
                    ),
                ));
            }
            let range = data_start + start..data_start + end;
            if range.end > bytes.len() {
                return Err(bad(path, format!("tensor {name} lies past the end of the file")));
            }
            let dims = info.shape.iter().rev().copied().collect();
            let Some(ty) = ty else {
                fp8.push(RawFp8 {
                    name: name.clone(),
                    dims,
                    file: file_index,
                    range,
                });
                continue;
            };
            if self
                .tensors
                .insert(
                    name.clone(),
                    StEntry {
                        name: name.clone(),
                        ty,
                        dims,
                        file: file_index,
                        range,
                    },
                )
                .is_some()
            {
                return Err(bad(path, format!("tensor {name} appears in two shards")));
            }
        }
        self.files.push(map);
        self.disk_bytes += len;
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&StEntry> {
        self.tensors.get(name)
    }

    pub fn bytes(&self, entry: &StEntry) -> &[u8] {
        &self.files[entry.file][entry.range.clone()]
    }

    pub fn region(&self, entry: &StEntry) -> (Arc<Mmap>, std::ops::Range<usize>) {
        (self.files[entry.file].clone(), entry.range.clone())
    }

    pub fn names(&self) -> impl Iterator<Item = (&String, &StEntry)> {
        self.tensors.iter()
    }

    /// Bytes of all its files together, headers included.
    pub fn file_size(&self) -> usize {
        self.disk_bytes
    }
}
