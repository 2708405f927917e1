//! GGUF reader over a memory map (versions 2 and 3).
//!
//! Every count, length, dimension and offset read from the file is checked against the bytes that
//! are actually there before anything is allocated or indexed, so a hostile or truncated file
//! yields a [`GgufError`] naming the problem rather than a panic or a huge allocation.

use super::quant::{type_id_name, GgmlType};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays may hold arrays; real files nest at most one level, so a few levels are plenty.
const MAX_ARRAY_DEPTH: usize = 4;
/// Most memory the parsed metadata may take. An array element of one byte in the file becomes a
/// 32-byte [`Value`], so the file's size alone does not bound it; real vocabularies take a few
/// tens of MiB (Llama 3's about 22).
pub const METADATA_MEMORY_LIMIT: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a GGUF file: magic is {0:?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (only 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("file truncated: needed {needed} bytes for {what} at offset {offset}, file has {len}")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("{what} count {count} is impossible: the file has only {remaining} bytes left")]
    ImpossibleCount { what: String, count: u64, remaining: u64 },
    #[error("metadata key {key:?} has unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },
    #[error("metadata key {0:?} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")]
    ArrayTooDeep(String),
    #[error(
        "metadata key {key:?} takes the parsed metadata past its memory limit of {} MiB",
        METADATA_MEMORY_LIMIT >> 20
    )]
    MetadataTooLarge { key: String },
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 { what: String },
    #[error("duplicate {kind} {name:?}")]
    Duplicate { kind: &'static str, name: String },
    #[error("general.alignment {0} is not a power of two between 1 and 2^20")]
    BadAlignment(u64),
    #[error("tensor {name:?} has {n_dims} dimensions (at most {MAX_DIMS} are allowed)")]
    TooManyDims { name: String, n_dims: u32 },
    #[error("tensor {name:?} has dimensions {dims:?} whose size overflows or is zero")]
    BadDims { name: String, dims: Vec<u64> },
    #[error("tensor {name:?} has type {type_name}, which this engine does not support")]
    UnsupportedType { name: String, type_name: String },
    #[error("tensor {name:?}: row length {row} is not a multiple of the {ty} block size {block}")]
    PartialBlock {
        name: String,
        ty: GgmlType,
        row: u64,
        block: usize,
    },
    #[error("tensor {name:?}: data offset {offset} is not aligned to {alignment}")]
    MisalignedOffset { name: String, offset: u64, alignment: u64 },
    #[error("tensor {name:?}: data [{start}, {end}) lies outside the {len}-byte data section")]
    TensorOutOfBounds {
        name: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("tensors {a:?} and {b:?} overlap in the data section")]
    OverlappingTensors { a: String, b: String },
    #[error("metadata key {key:?}: {problem}")]
    BadMetadata { key: String, problem: String },
}

type Result<T> = std::result::Result<T, GgufError>;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short description for `axiom info`: scalars in full, arrays by type and length.
    pub fn summary(&self) -> String {
        match self {
            Value::String(s) if s.len() > 80 => format!("{:?}... ({} bytes)", &s[..s.floor_char_boundary(60)], s.len()),
            Value::String(s) => format!("{s:?}"),
            Value::Array(a) => match a.first() {
                Some(first) => format!("[{}; {}]", first.type_name(), a.len()),
                None => "[]".to_string(),
            },
            Value::U8(v) => v.to_string(),
            Value::I8(v) => v.to_string(),
            Value::U16(v) => v.to_string(),
            Value::I16(v) => v.to_string(),
            Value::U32(v) => v.to_string(),
            Value::I32(v) => v.to_string(),
            Value::U64(v) => v.to_string(),
            Value::I64(v) => v.to_string(),
            Value::F32(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
            Value::Bool(v) => v.to_string(),
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// A tensor's description from the header; its bytes are `GgufFile::tensor_bytes`.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// Dimensions in GGML order: `dims[0]` is the contiguous one (the row length of a matrix).
    pub dims: Vec<usize>,
    /// Offset from the start of the data section.
    pub offset: usize,
    pub size_bytes: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An open GGUF file: parsed metadata and tensor table over a shared memory map.
pub struct GgufFile {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    meta_index: HashMap<String, usize>,
    data_start: usize,
    map: Arc<Mmap>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; a file changed underneath us by another process can give
        // wrong values, but every value is validated before use, so not undefined behaviour here.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Arc::new(map))
    }

    /// Parses a GGUF image held in memory (tests and fuzzing use this).
    pub fn from_bytes(bytes: &[u8]) -> Result<GgufFile> {
        let io = |source| GgufError::Io {
            path: "<memory>".into(),
            source,
        };
        if bytes.len() < 4 {
            return Err(GgufError::Truncated {
                what: "magic".into(),
                offset: 0,
                needed: 4,
                len: bytes.len() as u64,
            });
        }
        let mut anon = memmap2::MmapMut::map_anon(bytes.len()).map_err(io)?;
        anon.copy_from_slice(bytes);
        Self::parse(Arc::new(anon.make_read_only().map_err(io)?))
    }

    fn parse(map: Arc<Mmap>) -> Result<GgufFile> {
        let len = map.len();
        let mut r = Reader {
            buf: &map[..],
            pos: 0,
            metadata_budget: METADATA_MEMORY_LIMIT,
        };
        let magic: [u8; 4] = r.array("magic")?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at
        // least 8 + 4 + 4 + 8.
        r.check_count("metadata", n_kv, 13)?;
        r.check_count("tensor", n_tensors, 24)?;

        // Capacities are capped: vectors grow with what is actually parsed, not with claims.
        let mut metadata = Vec::with_capacity(n_kv.min(1024) as usize);
        let mut meta_index = HashMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            // The pair in `metadata` and the key's copy in `meta_index`.
            let entry = size_of::<(String, Value)>() + size_of::<(String, usize)>() + 2 * key.len();
            r.charge(&key, entry as u64)?;
            let type_id = r.u32("metadata value type")?;
            let value = r.value(&key, type_id, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::Duplicate {
                    kind: "metadata key",
                    name: key,
                });
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
                Some(a) => return Err(GgufError::BadAlignment(a)),
                None => {
                    return Err(GgufError::BadMetadata {
                        key: "general.alignment".into(),
                        problem: "not an integer".into(),
                    })
                }
            },
        };

        let mut raw_tensors = Vec::with_capacity(n_tensors.min(1024) as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor name #{i}"))?;
            let n_dims = r.u32("tensor dimension count")?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::TooManyDims { name, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64("tensor dimension")?);
            }
            let type_id = r.u32("tensor type")?;
            let offset = r.u64("tensor offset")?;
            raw_tensors.push((name, dims, type_id, offset));
        }

        let data_start = align_up(r.pos as u64, alignment).min(len as u64);
        let data_len = len as u64 - data_start;

        let mut tensors = Vec::with_capacity(raw_tensors.len());
        let mut index = HashMap::new();
        for (name, dims, type_id, offset) in raw_tensors {
            let info = tensor_info(name, dims, type_id, offset, alignment, data_len)?;
            if index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Duplicate {
                    kind: "tensor",
                    name: info.name,
                });
            }
            tensors.push(info);
        }
        check_no_overlap(&tensors)?;

        Ok(GgufFile {
            version,
            metadata,
            tensors,
            index,
            meta_index,
            data_start: data_start as usize,
            map,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The count or size under `key`, if present; an error if it is not a non-negative integer.
    pub fn get_usize(&self, key: &str) -> crate::Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| crate::Error::Model(format!("{key} is not a non-negative integer"))),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor from this file (bounds were checked when the file was opened).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = self.data_start + info.offset;
        &self.map[start..start + info.size_bytes]
    }

    /// The shared map and absolute byte range of a tensor, for zero-copy weights.
    pub fn tensor_region(&self, info: &TensorInfo) -> (Arc<Mmap>, std::ops::Range<usize>) {
        let start = self.data_start + info.offset;
        (self.map.clone(), start..start + info.size_bytes)
    }

    pub fn file_size(&self) -> usize {
        self.map.len()
    }
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a).saturating_mul(a)
}

fn tensor_info(
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
    alignment: u64,
    data_len: u64,
) -> Result<TensorInfo> {
    let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnsupportedType {
        name: name.clone(),
        type_name: type_id_name(type_id),
    })?;
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n > 0 && dims.iter().all(|&d| d > 0) && n <= data_len.saturating_mul(ty.block_len() as u64))
        .ok_or_else(|| GgufError::BadDims {
            name: name.clone(),
            dims: dims.clone(),
        })?;
    let row = dims.first().copied().unwrap_or(1);
    if row % ty.block_len() as u64 != 0 {
        return Err(GgufError::PartialBlock {
            name,
            ty,
            row,
            block: ty.block_len(),
        });
    }
    let size_bytes = n_elements / ty.block_len() as u64 * ty.block_bytes() as u64;
    if !offset.is_multiple_of(alignment) {
        return Err(GgufError::MisalignedOffset {
            name,
            offset,
            alignment,
        });
    }
    let end = offset.checked_add(size_bytes).filter(|&e| e <= data_len);
    let Some(end) = end else {
        return Err(GgufError::TensorOutOfBounds {
            name,
            start: offset,
            end: offset.saturating_add(size_bytes),
            len: data_len,
        });
    };
    debug_assert!(end <= data_len);
    Ok(TensorInfo {
        name,
        ty,
        dims: dims.iter().map(|&d| d as usize).collect(),
        offset: offset as usize,
        size_bytes: size_bytes as usize,
    })
}

fn check_no_overlap(tensors: &[TensorInfo]) -> Result<()> {
    let mut spans: Vec<&TensorInfo> = tensors.iter().collect();
    spans.sort_by_key(|t| t.offset);
    for pair in spans.windows(2) {
        if pair[0].offset + pair[0].size_bytes > pair[1].offset {
            return Err(GgufError::OverlappingTensors {
                a: pair[0].name.clone(),
                b: pair[1].name.clone(),
            });
        }
    }
    Ok(())
}

/// A cursor over the header bytes; every read is bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Bytes the parsed metadata may still take (see [`METADATA_MEMORY_LIMIT`]).
    metadata_budget: u64,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let start = self.pos;
        let bytes = self.take(N as u64, what)?;
        bytes.try_into().map_err(|_| GgufError::Truncated {
            what: what.to_string(),
            offset: start as u64,
            needed: N as u64,
            len: self.buf.len() as u64,
        })
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Fails unless `count` items of at least `min_size` bytes each can fit in what is left.
    fn check_count(&self, what: &str, count: u64, min_size: u64) -> Result<()> {
        if count.saturating_mul(min_size) > self.remaining() {
            return Err(GgufError::ImpossibleCount {
                what: what.to_string(),
                count,
                remaining: self.remaining(),
            });
        }
        Ok(())
    }

    /// Counts `bytes` of parsed metadata for `key` against [`METADATA_MEMORY_LIMIT`].
    fn charge(&mut self, key: &str, bytes: u64) -> Result<()> {
        self.metadata_budget = self
            .metadata_budget
            .checked_sub(bytes)
            .ok_or_else(|| GgufError::MetadataTooLarge { key: key.into() })?;
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 { what: what.to_string() })
    }

    fn value(&mut self, key: &str, type_id: u32, depth: usize) -> Result<Value> {
        Ok(match type_id {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(key)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(GgufError::BadMetadata {
                        key: key.into(),
                        problem: format!("bool byte {b}"),
                    })
                }
            },
            8 => {
                let s = self.string(key)?;
                self.charge(key, s.len() as u64)?;
                Value::String(s)
            }
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::ArrayTooDeep(key.into()));
                }
                let elem_type = self.u32(key)?;
                let count = self.u64(key)?;
                let min_size = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    _ => {
                        return Err(GgufError::UnknownValueType {
                            key: key.into(),
                            type_id: elem_type,
                        })
                    }
                };
                self.check_count(&format!("array {key:?} element"), count, min_size)?;
                // Charged before allocating, so the capacity can be exact.
                self.charge(key, count.saturating_mul(size_of::<Value>() as u64))?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(key, elem_type, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(key)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            _ => {
                return Err(GgufError::UnknownValueType {
                    key: key.into(),
                    type_id,
                })
            }
        })
    }
}
