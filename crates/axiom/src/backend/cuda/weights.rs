//! Weights in device memory: repacked at upload into the split layout the kernels read
//! (kernels/dequant.cuh), and their fields' addresses as the kernels take them.

use super::device::driver_error;
use super::memory::ALIGN;
use super::CudaBackend;
use crate::backend::{BlockHandle, HostTensor, Kernels};
use crate::format::quant::GgmlType;
use crate::{Error, Result};

/// A weight matrix in device memory, in its stored type, split by field (see `split_weight`):
/// quants in `q`, per-block scales or K-quant metadata in `s`, minimums or high bits in `m`.
pub struct CudaWeight {
    pub ty: GgmlType,
    pub n_out: usize,
    pub n_in: usize,
    pub(super) q: BlockHandle,
    pub(super) s: Option<BlockHandle>,
    pub(super) m: Option<BlockHandle>,
    /// FP8 weights' scales as cuBLASLt's FP8 GEMM reads them, where the backend multiplies on FP8
    /// tensor cores and a layout it has holds them (`Fp8ScaleGrid::lt_table`).
    pub(super) lt_scales: Option<(BlockHandle, LtScales)>,
}

crate::backend::impl_matrix!(CudaWeight);

impl CudaWeight {
    /// Whether prompts multiply this weight on the FP8 tensor cores (`CudaBackend::fp8_product`):
    /// an FP8 weight whose scales cuBLASLt takes, on a backend that multiplies there.
    pub fn takes_fp8_tensor_cores(&self) -> bool {
        self.lt_scales.is_some()
    }
}

/// A weight's fields in the split layout the kernels read (kernels/dequant.cuh): every row's
/// quants contiguous, so a lane loads 16 or 32 aligned bytes at once (Q4_K's and Q6_K's
/// interleaved: `interleave_row`), and the small per-block fields in side arrays (FP8's scales in
/// the compact table of `Fp8ScaleGrid::kernel_table`, the grid kept in `fp8`). Float weights stay
/// as they are.
struct SplitWeight {
    q: Vec<u8>,
    s: Vec<u8>,
    m: Vec<u8>,
    fp8: Option<Fp8ScaleGrid>,
}

fn split_weight(ty: GgmlType, bytes: &[u8], n_in: usize) -> SplitWeight {
    let (mut q, mut s, mut m, mut fp8) = (Vec::with_capacity(bytes.len()), Vec::new(), Vec::new(), None);
    let blocks = bytes.chunks_exact(ty.block_bytes());
    match ty {
        GgmlType::Q8_0 => blocks.for_each(|b| {
            s.extend_from_slice(&b[0..2]);
            q.extend_from_slice(&b[2..34]);
        }),
        GgmlType::Q4_0 => blocks.for_each(|b| {
            s.extend_from_slice(&b[0..2]);
            q.extend_from_slice(&b[2..18]);
        }),
        GgmlType::Q4_1 => blocks.for_each(|b| {
            s.extend_from_slice(&b[0..2]);
            m.extend_from_slice(&b[2..4]);
            q.extend_from_slice(&b[4..20]);
        }),
        GgmlType::Q5_0 => blocks.for_each(|b| {
            s.extend_from_slice(&b[0..2]);
            m.extend_from_slice(&b[2..6]);
            q.extend_from_slice(&b[6..22]);
        }),
        GgmlType::Q4K => {
            let mut row = Vec::with_capacity(n_in / 2);
            for row_blocks in bytes.chunks_exact(n_in / 256 * ty.block_bytes()) {
                row.clear();
                for b in row_blocks.chunks_exact(ty.block_bytes()) {
                    s.extend_from_slice(&b[0..16]);
                    row.extend_from_slice(&b[16..144]);
                }
                interleave_row(&row, Q4K_GROUP_BYTES, &mut q);
            }
        }
        GgmlType::Q6K => {
            let mut row = Vec::with_capacity(n_in / 64 * Q6K_GROUP_BYTES);
            for row_blocks in bytes.chunks_exact(n_in / 256 * ty.block_bytes()) {
                row.clear();
                for b in row_blocks.chunks_exact(ty.block_bytes()) {
                    let values = q6k_values(b);
                    for group in values.chunks_exact(64) {
                        row.extend(q6k_group(group));
                    }
                    s.extend_from_slice(&b[192..208]);
                    m.extend_from_slice(&half::f16::from_le_bytes([b[208], b[209]]).to_f32().to_le_bytes());
                }
                interleave_row(&row, Q6K_GROUP_BYTES, &mut q);
            }
        }
        GgmlType::Fp8 => {
            blocks.for_each(|b| q.extend_from_slice(&b[4..]));
            fp8 = Fp8ScaleGrid::new(bytes, n_in);
            s = fp8.as_ref().map_or_else(Vec::new, Fp8ScaleGrid::kernel_table);
        }
        _ => q.extend_from_slice(bytes),
    }
    SplitWeight { q, s, m, fp8 }
}

/// The granularities FP8 scales are looked for in, coarsest first, as (row shift, chunk shift),
/// the scale of row r's 32-value chunk c being shared by those of equal (r >> row shift,
/// c >> chunk shift): the whole matrix, 128 x 128, 64 x 64 and 32 x 32 blocks (block-wise
/// checkpoints), a row (per-channel ones), 128 values of a row. A shift of 31 spans any matrix
/// the kernels index.
const FP8_SCALE_GRAINS: [(u32, u32); 6] = [(31, 31), (7, 2), (6, 1), (5, 0), (0, 31), (0, 2)];

/// The scales of FP8 blocks at the coarsest of `FP8_SCALE_GRAINS` where they agree to the bit,
/// else one a block: the scale of row r's chunk c is `table[(r >> row_shift) * per_row + (c >>
/// chunk_shift)]`. A block holding a NaN code has a NaN scale, so every product it enters is NaN,
/// as the reference's is.
struct Fp8ScaleGrid {
    row_shift: u32,
    chunk_shift: u32,
    per_row: usize,
    table: Vec<u32>,
}

impl Fp8ScaleGrid {
    fn new(bytes: &[u8], n_in: usize) -> Option<Fp8ScaleGrid> {
        let chunks = n_in / 32;
        // A block with a NaN code gets a NaN scale: the kernels decode codes without a NaN check.
        let scales: Vec<u32> = bytes
            .chunks_exact(GgmlType::Fp8.block_bytes())
            .map(|b| match b[4..].iter().any(|c| c & 0x7f == 0x7f) {
                true => f32::NAN.to_bits(),
                false => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            })
            .collect();
        if scales.is_empty() {
            return None;
        }
        let n_out = scales.len() / chunks;
        let grained = |&(row_shift, chunk_shift): &(u32, u32)| -> Option<Fp8ScaleGrid> {
            let per_row = ((chunks - 1) >> chunk_shift) + 1;
            let mut table: Vec<Option<u32>> = vec![None; (((n_out - 1) >> row_shift) + 1) * per_row];
            for (i, &scale) in scales.iter().enumerate() {
                let slot = &mut table[((i / chunks) >> row_shift) * per_row + ((i % chunks) >> chunk_shift)];
                if *slot.get_or_insert(scale) != scale {
                    return None;
                }
            }
            let table = table.into_iter().flatten().collect();
            Some(Fp8ScaleGrid {
                row_shift,
                chunk_shift,
                per_row,
                table,
            })
        };
        let finest = || Fp8ScaleGrid {
            row_shift: 0,
            chunk_shift: 0,
            per_row: chunks,
            table: scales.clone(),
        };
        Some(FP8_SCALE_GRAINS.iter().find_map(grained).unwrap_or_else(finest))
    }

    /// The scale of row `row`'s 32-value chunk `chunk`.
    fn at(&self, row: usize, chunk: usize) -> u32 {
        self.table[(row >> self.row_shift) * self.per_row + (chunk >> self.chunk_shift)]
    }

    /// The table as the kernels read it (`Fp8Scales` in kernels/dequant.cuh): a header of u32s
    /// (row shift, chunk shift, scales a row of the table, 0), then the f32 table. A token then
    /// reads about a byte a weight, whatever the checkpoint.
    fn kernel_table(&self) -> Vec<u8> {
        [self.row_shift, self.chunk_shift, self.per_row as u32, 0]
            .into_iter()
            .chain(self.table.iter().copied())
            .flat_map(u32::to_le_bytes)
            .collect()
    }

    /// The scales as cuBLASLt's FP8 GEMM reads those of its A operand (the weight, `n_out` rows
    /// of `n_in`), where a layout it has holds them: 128 x 128 blocks (a whole-matrix scale is
    /// one in every block), their table K-major with each block row padded to a multiple of 4;
    /// or a scale per 128 values of a row (a row's scale repeated), M-major. Not for a scale per
    /// 32 values, nor rows that are not whole 128-value groups.
    fn lt_table(&self, n_in: usize, n_out: usize) -> Option<(LtScales, Vec<u8>)> {
        if !n_in.is_multiple_of(128) {
            return None;
        }
        let groups = n_in / 128;
        let (mode, scales): (LtScales, Vec<u32>) = match (self.row_shift, self.chunk_shift) {
            (31, 31) | (7, 2) => {
                let stride = groups.next_multiple_of(4);
                let blocks = (0..n_out.div_ceil(128))
                    .flat_map(|rb| (0..stride).map(move |g| if g < groups { self.at(rb * 128, g * 4) } else { 0 }));
                (LtScales::Blocks, blocks.collect())
            }
            (0, 31) | (0, 2) => {
                let rows = (0..groups).flat_map(|g| (0..n_out).map(move |row| self.at(row, g * 4)));
                (LtScales::Rows, rows.collect())
            }
            _ => return None,
        };
        Some((mode, scales.into_iter().flat_map(u32::to_le_bytes).collect()))
    }
}

/// How an FP8 weight's scales are laid out for cuBLASLt (`Fp8ScaleGrid::lt_table`): a scale per
/// 128 x 128 block, or per 128 values of a row.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum LtScales {
    Blocks,
    Rows,
}

/// Units per tile of the interleaved layout (INTERLEAVE_UNITS in kernels/common.cuh).
const INTERLEAVE_UNITS: usize = 8;

/// A Q4_K lane's unit of quants: 32 bytes, two sub-blocks.
const Q4K_GROUP_BYTES: usize = 32;

/// A Q6_K lane's unit of quants: 48 bytes, 64 values (four sub-blocks).
const Q6K_GROUP_BYTES: usize = 48;

/// The 256 unsigned 6-bit values (0..63, the quant plus 32) of a Q6_K super-block, in order:
/// low four bits in `ql` (values l and l + 64 of a half in byte l's nibbles, l + 32 and l + 96 in
/// byte 32 + l's), the top two in `qh` (byte l holds those of l, l + 32, l + 64, l + 96).
fn q6k_values(block: &[u8]) -> [u8; 256] {
    let (ql, qh) = (&block[0..128], &block[128..192]);
    let mut values = [0u8; 256];
    for half in 0..2 {
        let (ql, qh, v) = (&ql[64 * half..], &qh[32 * half..], &mut values[128 * half..]);
        for l in 0..32 {
            v[l] = (ql[l] & 15) | (qh[l] & 3) << 4;
            v[l + 32] = (ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4;
            v[l + 64] = (ql[l] >> 4) | (qh[l] >> 4 & 3) << 4;
            v[l + 96] = (ql[l + 32] >> 4) | (qh[l] >> 6) << 4;
        }
    }
    values
}

/// A Q6_K group of 64 values as the kernels read it (kernels/dequant.cuh): three 16-byte pieces,
/// byte i of piece k holding value 16k + i in its low six bits and two bits of value 48 + i in
/// its top two (bits 2k and 2k + 1 of it). Values 0-47 are then one mask from a dp4a operand,
/// and 48-63 three shifts and masks.
fn q6k_group(values: &[u8]) -> impl Iterator<Item = u8> + '_ {
    (0..Q6K_GROUP_BYTES).map(move |b| {
        let (k, i) = (b / 16, b % 16);
        values[16 * k + i] | (values[48 + i] >> (2 * k) & 3) << 6
    })
}

/// Appends a row of units of `unit_bytes` (a multiple of 16) in the interleaved order of
/// kernels/common.cuh: tiles of `INTERLEAVE_UNITS` units, each stored 16-byte piece by piece.
fn interleave_row(row: &[u8], unit_bytes: usize, out: &mut Vec<u8>) {
    for tile in row.chunks(unit_bytes * INTERLEAVE_UNITS) {
        for piece in (0..unit_bytes).step_by(16) {
            for unit in tile.chunks_exact(unit_bytes) {
                out.extend_from_slice(&unit[piece..piece + 16]);
            }
        }
    }
}

impl CudaBackend {
    pub(super) fn upload_split_weight(&mut self, t: &HostTensor) -> Result<CudaWeight> {
        let (n_in, n_out) = checked_shape(t, DENSE_ROW_MULTIPLE)?;
        let split = split_weight(t.ty, t.bytes, n_in);
        let fp8_lt = self.fp8_tensor_cores();
        let mut upload = |data: &[u8]| -> Result<Option<BlockHandle>> {
            if data.is_empty() {
                return Ok(None);
            }
            let block = self.alloc(data.len())?;
            self.copy_in(block, data)?;
            Ok(Some(block))
        };
        let q = upload(&split.q)?.ok_or_else(|| Error::Model(format!("tensor {} is empty", t.name)))?;
        let (s, m) = (upload(&split.s)?, upload(&split.m)?);
        let lt_table = match (&split.fp8, fp8_lt) {
            (Some(grid), true) => grid.lt_table(n_in, n_out),
            _ => None,
        };
        let lt_scales = match lt_table {
            Some((layout, table)) => upload(&table)?.map(|block| (block, layout)),
            None => None,
        };
        self.largest_weight = self.largest_weight.max(n_in * n_out);
        self.capture_max_tokens = self.capture_max_tokens.min(self.paths.gemv_max_tokens(t.ty));
        Ok(CudaWeight {
            ty: t.ty,
            n_out,
            n_in,
            q,
            s,
            m,
            lt_scales,
        })
    }

    /// `Kernels::upload_experts`: one matrix of every expert, repacked as `upload_weight` repacks
    /// a matrix, each field in one block, expert after expert at a fixed stride (a multiple of
    /// `ALIGN`), so that a kernel finds expert e's at e strides from expert 0's (`expert_stack`).
    /// They never reach cuBLAS, so they leave its staging and the graphs' token bound alone.
    pub(super) fn upload_expert_stack(&mut self, tensors: &[HostTensor]) -> Result<Vec<CudaWeight>> {
        let Some(first) = tensors.first() else {
            return Err(Error::Model("a mixture of no experts".into()));
        };
        // The expert kernels read float rows 16 bytes at a time (float_row), quantized ones a
        // block at a time: a float expert's rows need only be a multiple of 8 values (the tiny
        // mixtures' experts are 48 wide).
        let row_multiple = if first.ty.block_len() > 1 { 32 } else { 8 };
        let (n_in, n_out) = checked_shape(first, row_multiple)?;
        let mut splits = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.ty != first.ty || t.matrix_shape()? != (n_in, n_out) {
                return Err(Error::Model(format!(
                    "experts {} and {} differ in type or shape",
                    first.name, t.name
                )));
            }
            splits.push(split_weight(t.ty, t.bytes, n_in));
        }
        // Each field of every expert in one block: (its block, stride, length) per expert. A field's
        // length is its longest expert's: FP8 experts' scale tables may differ in granularity.
        let mut stack = |field: fn(&SplitWeight) -> &[u8]| -> Result<Option<(BlockHandle, usize, usize)>> {
            let len = splits.iter().map(|split| field(split).len()).max().unwrap_or(0);
            if len == 0 {
                return Ok(None);
            }
            let stride = len.next_multiple_of(ALIGN);
            let block = self.alloc(stride * splits.len())?;
            for (e, split) in splits.iter().enumerate() {
                self.copy_in(block.slice(e * stride, field(split).len()), field(split))?;
            }
            Ok(Some((block, stride, len)))
        };
        let q = stack(|w| &w.q)?.ok_or_else(|| Error::Model(format!("tensor {} is empty", first.name)))?;
        let (s, m) = (stack(|w| &w.s)?, stack(|w| &w.m)?);
        let part = |(block, stride, len): (BlockHandle, usize, usize), e: usize| block.slice(e * stride, len);
        Ok((0..tensors.len())
            .map(|e| CudaWeight {
                ty: first.ty,
                n_out,
                n_in,
                q: part(q, e),
                s: s.map(|f| part(f, e)),
                m: m.map(|f| part(f, e)),
                lt_scales: None,
            })
            .collect())
    }

    /// Copies `data` into `block` (at least as long), from pageable host memory.
    fn copy_in(&self, block: BlockHandle, data: &[u8]) -> Result<()> {
        assert!(data.len() <= block.len);
        let dst = self.base + block.offset as u64;
        // SAFETY: the block holds `data.len()` bytes; the copy from pageable host memory completes
        // before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream()) }
            .map_err(driver_error("weight upload"))
    }

    /// Device pointers of a weight's three fields (0 for a field it does not have).
    pub(super) fn weight_ptrs(&self, w: &CudaWeight) -> (u64, u64, u64) {
        let field = |b: Option<BlockHandle>| b.map_or(0, |b| self.ptr(b));
        (self.ptr(w.q), field(w.s), field(w.m))
    }
}

/// The multiple of 32 values every dense weight's rows must be: the matrix-vector kernels' float4
/// reads and cuBLAS's staging take it for granted.
const DENSE_ROW_MULTIPLE: usize = 32;

/// A weight's `(n_in, n_out)`, refused unless the kernels take its type and its rows are a
/// multiple of `row_multiple` values.
fn checked_shape(t: &HostTensor, row_multiple: usize) -> Result<(usize, usize)> {
    let (n_in, n_out) = t.matrix_shape()?;
    CudaBackend::type_suffix(t.ty).map_err(|_| Error::UnsupportedTensorType {
        name: t.name.to_string(),
        ty: t.ty.to_string(),
        op: "the CUDA backend",
    })?;
    if !n_in.is_multiple_of(row_multiple) {
        return Err(Error::Model(format!(
            "tensor {}: rows of {n_in} are not a multiple of {row_multiple}",
            t.name
        )));
    }
    Ok((n_in, n_out))
}

/// `Kernels::weight_bytes`: the arena bytes the weights of `matrices` bytes take once split.
pub(super) fn arena_bytes(matrices: &[usize]) -> usize {
    // Up to three fields per matrix, each aligned; Q6_K's d grows by 2 bytes a block (f32).
    matrices.iter().map(|b| b + b / 100 + 3 * ALIGN).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::fp8;

    /// Every block's scale found in `table` as the kernels look it up (`fp8_scale` in
    /// kernels/dequant.cuh); the header's shifts.
    fn looked_up(table: &[u8], n_in: usize, n_out: usize) -> ((u32, u32), Vec<f32>) {
        let word = |i: usize| u32::from_le_bytes(table[4 * i..4 * i + 4].try_into().unwrap());
        let (row_shift, chunk_shift, per_row) = (word(0), word(1), word(2) as usize);
        let scales = (0..n_out * n_in / 32).map(|i| {
            let (row, chunk) = (i / (n_in / 32), i % (n_in / 32));
            f32::from_bits(word(4 + (row >> row_shift) * per_row + (chunk >> chunk_shift)))
        });
        ((row_shift, chunk_shift), scales.collect())
    }

    #[test]
    fn fp8_scales_are_kept_at_the_coarsest_granularity_they_have() {
        // 130 x 160: the last 128 x 128 block is 2 rows by one chunk.
        let (n_in, n_out) = (160, 130);
        let codes = vec![0x38u8; n_in * n_out];
        // (what a scale covers, the scales, the shifts expected, the table's length)
        type Case = (&'static str, fn(usize, usize) -> f32, (u32, u32), usize);
        let cases: [Case; 7] = [
            ("a matrix", |_, _| 0.5, (31, 31), 1),
            ("128 x 128", |r, c| (1 + r / 128 * 2 + c / 128) as f32, (7, 2), 4),
            ("64 x 64", |r, c| (1 + r / 64 * 3 + c / 64) as f32, (6, 1), 9),
            ("32 x 32", |r, c| (1 + r / 32 * 5 + c / 32) as f32, (5, 0), 25),
            ("a row", |r, _| r as f32 + 0.25, (0, 31), 130),
            ("128 of a row", |r, c| (r * 2 + c / 128) as f32, (0, 2), 260),
            ("a block", |r, c| (r * 5 + c / 32) as f32, (0, 0), 650),
        ];
        for (what, scale, shifts, len) in cases {
            let mut blocks = vec![0u8; n_in * n_out / 32 * fp8::BLOCK_BYTES];
            fp8::pack(&codes, n_in, scale, &mut blocks);
            let table = Fp8ScaleGrid::new(&blocks, n_in).unwrap().kernel_table();
            assert_eq!(table.len(), 16 + 4 * len, "{what}");
            let (got_shifts, scales) = looked_up(&table, n_in, n_out);
            assert_eq!(got_shifts, shifts, "{what}");
            let want = blocks
                .chunks_exact(fp8::BLOCK_BYTES)
                .map(|b| f32::from_le_bytes(b[..4].try_into().unwrap()));
            assert!(scales.into_iter().eq(want), "{what}");
            let split = split_weight(GgmlType::Fp8, &blocks, n_in);
            assert_eq!((split.q, split.s), (codes.clone(), table), "{what}");
        }
        // A NaN code (0xff) in block 7: its scale alone is NaN, one a block.
        let mut nan_codes = codes.clone();
        nan_codes[7 * 32 + 5] = 0xff;
        let mut blocks = vec![0u8; n_in * n_out / 32 * fp8::BLOCK_BYTES];
        fp8::pack(&nan_codes, n_in, |_, _| 0.5, &mut blocks);
        let (shifts, scales) = looked_up(&Fp8ScaleGrid::new(&blocks, n_in).unwrap().kernel_table(), n_in, n_out);
        assert_eq!(shifts, (0, 0));
        assert!(scales
            .iter()
            .enumerate()
            .all(|(i, s)| (i == 7) == s.is_nan() && (i == 7 || *s == 0.5)));
    }

    #[test]
    fn fp8_scales_for_cublaslt_are_in_its_block_or_row_layouts() {
        // 130 rows of 256: two 128-value groups a row, the last 128 x 128 block two rows tall.
        let (n_in, n_out) = (256, 130);
        let codes = vec![0x38u8; n_in * n_out];
        // (what a scale covers, the scale of (row, column), the layout expected)
        type Case = (&'static str, fn(usize, usize) -> f32, Option<LtScales>);
        let cases: [Case; 5] = [
            ("a matrix", |_, _| 0.5, Some(LtScales::Blocks)),
            (
                "128 x 128",
                |r, c| (1 + r / 128 * 2 + c / 128) as f32,
                Some(LtScales::Blocks),
            ),
            ("a row", |r, _| r as f32 + 0.25, Some(LtScales::Rows)),
            ("128 of a row", |r, c| (r * 2 + c / 128) as f32, Some(LtScales::Rows)),
            ("a block", |r, c| (r * 8 + c / 32) as f32, None),
        ];
        for (what, scale, layout) in cases {
            let mut blocks = vec![0u8; n_in * n_out / 32 * fp8::BLOCK_BYTES];
            fp8::pack(&codes, n_in, scale, &mut blocks);
            let lt = Fp8ScaleGrid::new(&blocks, n_in).unwrap().lt_table(n_in, n_out);
            assert_eq!(lt.as_ref().map(|(l, _)| *l), layout, "{what}");
            let Some((layout, table)) = lt else { continue };
            let table: Vec<f32> = table
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let want: Vec<f32> = match layout {
                // K-major, each block row padded to 4 scales with zeros.
                LtScales::Blocks => (0..2)
                    .flat_map(|rb| (0..4).map(move |g| if g < 2 { scale(rb * 128, g * 128) } else { 0.0 }))
                    .collect(),
                // M-major: every row's scale of group 0, then of group 1.
                LtScales::Rows => (0..2)
                    .flat_map(|g| (0..n_out).map(move |row| scale(row, g * 128)))
                    .collect(),
            };
            assert_eq!(table, want, "{what}");
        }
        // Rows that are not whole 128-value groups have no cuBLASLt layout.
        let mut blocks = vec![0u8; 160 * n_out / 32 * fp8::BLOCK_BYTES];
        fp8::pack(&vec![0x38u8; 160 * n_out], 160, |_, _| 0.5, &mut blocks);
        assert!(Fp8ScaleGrid::new(&blocks, 160).unwrap().lt_table(160, n_out).is_none());
    }

    #[test]
    fn interleaved_rows_are_tiles_stored_piece_by_piece() {
        // Twelve 32-byte units, byte j of unit u = 32 u + j: a tile of eight, then one of four.
        let row: Vec<u8> = (0..12 * 32).map(|i| i as u8).collect();
        let mut out = Vec::new();
        interleave_row(&row, 32, &mut out);
        let pieces: Vec<u8> = out.chunks_exact(16).map(|p| p[0]).collect();
        let piece = |unit: u8, k: u8| 32 * unit + 16 * k;
        let mut expected: Vec<u8> = Vec::new();
        expected.extend((0..8).map(|u| piece(u, 0)));
        expected.extend((0..8).map(|u| piece(u, 1)));
        expected.extend((8..12).map(|u| piece(u, 0)));
        expected.extend((8..12).map(|u| piece(u, 1)));
        assert_eq!(pieces, expected);
        assert!(out.chunks_exact(16).all(|p| p.windows(2).all(|w| w[1] == w[0] + 1)));
    }

    #[test]
    fn q6k_split_rows_read_as_the_kernels_read_them_give_the_reference_values() {
        use rand::{Rng, SeedableRng};
        // Rows of 12 groups: a full tile of eight, then a narrow one of four.
        let (n_in, n_out) = (768, 3);
        let ty = GgmlType::Q6K;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
        let mut bytes = vec![0u8; n_in * n_out / 256 * ty.block_bytes()];
        rng.fill(&mut bytes[..]);
        for block in bytes.chunks_exact_mut(ty.block_bytes()) {
            block[208..210].copy_from_slice(&half::f16::from_f32(rng.random_range(-2.0..2.0)).to_le_bytes());
        }
        let mut reference = vec![0.0f32; n_in * n_out];
        crate::format::quant::dequantize(ty, &bytes, &mut reference);
        let split = split_weight(ty, &bytes, n_in);
        let n_groups = n_in / 64;
        // Value v of a row as int_chunk<TY_Q6_K> (kernels/dequant.cuh) finds it.
        let read = |row: usize, v: usize| -> f32 {
            let (group, i) = (v / 64, v % 64);
            let first = group / INTERLEAVE_UNITS * INTERLEAVE_UNITS;
            let width = INTERLEAVE_UNITS.min(n_groups - first);
            let piece = |k: usize| {
                let at = row * n_in / 4 * 3 + 16 * (first * 3 + group - first + k * width);
                &split.q[at..at + 16]
            };
            let q = if i < 48 {
                piece(i / 16)[i % 16] & 63
            } else {
                (0..3).map(|k| (piece(k)[i - 48] >> 6) << (2 * k)).sum()
            };
            let sb = row * (n_in / 256) + group / 4;
            let scale = split.s[16 * sb + (v % 256) / 16] as i8;
            let d = f32::from_le_bytes(split.m[4 * sb..4 * sb + 4].try_into().unwrap());
            d * scale as f32 * (q as i32 - 32) as f32
        };
        for row in 0..n_out {
            for v in 0..n_in {
                assert_eq!(read(row, v), reference[row * n_in + v], "row {row} value {v}");
            }
        }
    }
}
