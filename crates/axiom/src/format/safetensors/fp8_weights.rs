//! FP8 weights of a checkpoint packed with their scales into [`GgmlType::Fp8`] blocks at open,
//! as the config's `quantization_config` lays the scales out.

use super::{SafetensorsModel, StEntry};
use crate::format::fp8::{pack, BLOCK_BYTES, CODES_PER_BLOCK};
use crate::format::quant::{dequantize, GgmlType};
use crate::model::quantization::{Fp8Quantization, Fp8Scales};
use crate::{Error, Result};
use std::sync::Arc;

/// An FP8 E4M3 tensor as stored, before it is packed with its scales.
pub(super) struct RawFp8 {
    pub name: String,
    pub dims: Vec<usize>,
    pub file: usize,
    pub range: std::ops::Range<usize>,
}

impl SafetensorsModel {
    /// Packs each FP8 weight with its scales into `Fp8` blocks, in one map of their own; the
    /// scale tensors are consumed.
    pub(super) fn pack_fp8(&mut self, mut fp8: Vec<RawFp8>, quantization: Option<&Fp8Quantization>) -> Result<()> {
        let Some(first) = fp8.first() else {
            return match quantization {
                Some(q) => Err(Error::Model(format!(
                    "config.json names {} quantization, but no tensor is F8_E4M3",
                    q.method
                ))),
                None => Ok(()),
            };
        };
        let Some(quantization) = quantization else {
            return Err(Error::Model(format!(
                "tensor {} is F8_E4M3, but config.json has no quantization_config to scale it",
                first.name
            )));
        };
        // Every weight's shape first, then every weight's scales, each in name order: a file
        // with several faults is refused for the same one every load.
        fp8.sort_by(|a, b| a.name.cmp(&b.name));
        for raw in &fp8 {
            let &[n_in, n_out] = raw.dims.as_slice() else {
                return Err(Error::Model(format!(
                    "FP8 tensor {} has shape {:?}, expected a matrix",
                    raw.name, raw.dims
                )));
            };
            if !n_in.is_multiple_of(CODES_PER_BLOCK) {
                return Err(Error::Model(format!(
                    "FP8 tensor {}: rows of {n_in} are not a multiple of {CODES_PER_BLOCK}",
                    raw.name
                )));
            }
            if let Fp8Scales::Blocks(block) = quantization.scales {
                if !block.whole(n_out, n_in) {
                    return Err(Error::Model(format!(
                        "FP8 tensor {}: {n_out} x {n_in} is not whole {block} blocks",
                        raw.name
                    )));
                }
            }
        }
        let mut scales = Vec::with_capacity(fp8.len());
        let mut total = 0usize;
        for raw in &fp8 {
            let (n_in, n_out) = (raw.dims[0], raw.dims[1]);
            let scale_name = quantization.scale_name(&raw.name);
            let entry = self
                .tensors
                .remove(&scale_name)
                .ok_or_else(|| Error::Model(format!("missing tensor {scale_name} (the scales of FP8 {})", raw.name)))?;
            let expected = match quantization.scales {
                Fp8Scales::Blocks(block) => block.grid(n_out, n_in).into_iter().rev().collect(),
                Fp8Scales::Channel => vec![1, n_out],
                Fp8Scales::Tensor => vec![1],
            };
            // A scale per channel may also be stored as a vector, one per tensor as a scalar.
            let same = entry.dims == expected
                || (quantization.scales == Fp8Scales::Channel && entry.dims == [n_out])
                || (quantization.scales == Fp8Scales::Tensor && entry.dims.is_empty());
            if !same {
                return Err(Error::Model(format!(
                    "tensor {scale_name} has shape {:?}, expected {:?} for FP8 {} of {:?}",
                    entry.dims, expected, raw.name, raw.dims
                )));
            }
            let mut values = vec![0f32; entry.dims.iter().product()];
            dequantize(entry.ty, self.bytes(&entry), &mut values);
            scales.push(values);
            total += n_in * n_out / CODES_PER_BLOCK * BLOCK_BYTES;
        }
        let mut packed = memmap2::MmapMut::map_anon(total.max(1)).map_err(Error::io("mapping FP8 weights"))?;
        let packed_file = self.files.len();
        let mut offset = 0;
        for (raw, scales) in fp8.into_iter().zip(scales) {
            let (n_in, n_out) = (raw.dims[0], raw.dims[1]);
            let len = n_in * n_out / CODES_PER_BLOCK * BLOCK_BYTES;
            let codes = &self.files[raw.file][raw.range.clone()];
            let out = &mut packed[offset..offset + len];
            match quantization.scales {
                Fp8Scales::Blocks(block) => pack(codes, n_in, |r, c| scales[block.index(r, c, n_in)], out),
                Fp8Scales::Channel => pack(codes, n_in, |r, _| scales[r], out),
                Fp8Scales::Tensor => pack(codes, n_in, |_, _| scales[0], out),
            }
            let entry = StEntry {
                name: raw.name.clone(),
                ty: GgmlType::Fp8,
                dims: raw.dims,
                file: packed_file,
                range: offset..offset + len,
            };
            if self.tensors.insert(raw.name.clone(), entry).is_some() {
                return Err(Error::Model(format!("tensor {} appears in two shards", raw.name)));
            }
            offset += len;
        }
        let packed = packed.make_read_only().map_err(Error::io("mapping FP8 weights"))?;
        self.files.push(Arc::new(packed));
        Ok(())
    }
}
