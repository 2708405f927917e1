//! Writing GGUF files (version 3): metadata, then tensor infos, then the 32-byte aligned data.

use super::gguf::Value;
use super::quant::GgmlType;
use crate::{Error, Result};
use std::io::Write;
use std::path::Path;

const ALIGNMENT: usize = 32;

#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, GgmlType, Vec<usize>, Vec<u8>)>,
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_string(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(items) => {
            // An empty array is written as an array of u8.
            out.extend_from_slice(&items.first().map_or(0, value_type).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|item| put_value(out, item));
        }
    }
}

impl GgufWriter {
    pub fn set(&mut self, key: &str, value: Value) {
        self.metadata.push((key.to_string(), value));
    }

    /// Adds a tensor: `dims` in GGML order, `data` already in `ty`.
    pub fn tensor(&mut self, name: &str, ty: GgmlType, dims: &[usize], data: Vec<u8>) -> Result<()> {
        let n: usize = dims.iter().product();
        if ty.bytes_for(n) != Some(data.len()) {
            return Err(Error::Model(format!(
                "tensor {name}: {} bytes for {dims:?} of {ty}",
                data.len()
            )));
        }
        self.tensors.push((name.to_string(), ty, dims.to_vec(), data));
        Ok(())
    }

    /// Writes the file, through a temporary name renamed into place when complete.
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut header = b"GGUF".to_vec();
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value_type(value).to_le_bytes());
            put_value(&mut header, value);
        }
        let mut offset = 0usize;
        for (name, ty, dims, data) in &self.tensors {
            put_string(&mut header, name);
            header.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            dims.iter()
                .for_each(|&d| header.extend_from_slice(&(d as u64).to_le_bytes()));
            header.extend_from_slice(&ty.id().to_le_bytes());
            header.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += data.len().next_multiple_of(ALIGNMENT);
        }
        header.resize(header.len().next_multiple_of(ALIGNMENT), 0);
        let tmp = path.with_extension("gguf.partial");
        let io = |what: &str| Error::io(format!("{what} {}", tmp.display()));
        let mut file = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(io("creating"))?);
        file.write_all(&header).map_err(io("writing"))?;
        for (_, _, _, data) in &self.tensors {
            file.write_all(data).map_err(io("writing"))?;
            file.write_all(&vec![0u8; data.len().next_multiple_of(ALIGNMENT) - data.len()])
                .map_err(io("writing"))?;
        }
        file.into_inner().map_err(|e| Error::Io {
            context: format!("writing {}", tmp.display()),
            source: e.into_error(),
        })?;
        std::fs::rename(&tmp, path).map_err(Error::io(format!("renaming into {}", path.display())))
    }
}
