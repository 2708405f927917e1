//! FP8 E4M3 (the `float8_e4m3fn` of PyTorch and safetensors' `F8_E4M3`): one sign bit, four
//! exponent bits (bias 7), three mantissa bits, no infinities, a NaN at `S.1111.111`, at most 448.
//! Checkpoints store such codes with f32 scales; axiom keeps them as [`GgmlType::Fp8`] blocks
//! (a scale, then 32 codes of a row) and writes them block-wise, one scale per [`ScaleBlock`].
//!
//! [`GgmlType::Fp8`]: super::quant::GgmlType::Fp8

/// The largest finite E4M3 value; larger magnitudes saturate to it when encoding.
pub const E4M3_MAX: f32 = 448.0;

/// Codes per [`GgmlType::Fp8`](super::quant::GgmlType::Fp8) block, after its f32 scale.
pub const CODES_PER_BLOCK: usize = 32;

/// Bytes of one such block: the scale and the codes.
pub const BLOCK_BYTES: usize = 4 + CODES_PER_BLOCK;

/// The rows and columns of the weights that share one scale in a block-wise checkpoint
/// (`weight_block_size`), its scales a row-major grid over the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScaleBlock {
    pub rows: usize,
    pub cols: usize,
}

impl ScaleBlock {
    pub const fn square(n: usize) -> ScaleBlock {
        ScaleBlock { rows: n, cols: n }
    }

    /// The scale grid of an `[n_out, n_in]` matrix: `[ceil(n_out / rows), ceil(n_in / cols)]`.
    pub fn grid(self, n_out: usize, n_in: usize) -> [usize; 2] {
        [n_out.div_ceil(self.rows), n_in.div_ceil(self.cols)]
    }

    /// Whether an `[n_out, n_in]` matrix is whole blocks; readers split a partial edge block
    /// differently (transformers a share of the grid, vLLM the remainder), so only whole ones agree.
    pub fn whole(self, n_out: usize, n_in: usize) -> bool {
        n_out.is_multiple_of(self.rows) && n_in.is_multiple_of(self.cols)
    }

    /// The index in the grid of the scale of weight `(r, c)` of a matrix of `n_in` columns.
    pub fn index(self, r: usize, c: usize, n_in: usize) -> usize {
        r / self.rows * n_in.div_ceil(self.cols) + c / self.cols
    }
}

impl std::fmt::Display for ScaleBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.rows, self.cols)
    }
}

/// The value of every E4M3 code.
pub static E4M3_VALUES: [f32; 256] = decode_table();

const fn decode_table() -> [f32; 256] {
    let mut table = [0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = decode(code as u8);
        code += 1;
    }
    table
}

/// The value of one E4M3 code.
pub const fn decode(code: u8) -> f32 {
    let sign = ((code as u32) & 0x80) << 24;
    let exponent = ((code >> 3) & 0x0f) as u32;
    let mantissa = (code & 0x07) as u32;
    let magnitude = if exponent == 0x0f && mantissa == 0x07 {
        return f32::NAN;
    } else if exponent == 0 {
        // Subnormal: mantissa / 8 * 2^-6, exactly an f32 normal (or zero).
        mantissa as f32 * (1.0 / 512.0)
    } else {
        f32::from_bits((exponent + 127 - 7) << 23 | mantissa << 20)
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

/// The E4M3 code nearest `x`, ties to even; magnitudes beyond 448 (infinities too) saturate to
/// ±448, and NaN stays NaN.
pub fn encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Below the smallest normal (2^-6) the codes are multiples of 2^-9; rounding onto 8 lands on
    // the code of 2^-6 itself.
    if a < 1.0 / 64.0 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let exponent = (bits >> 23) - 127 + 7;
    let kept = (bits >> 20) & 0x07;
    let dropped = bits & 0x000f_ffff;
    let mut code = exponent << 3 | kept;
    // A carry out of the mantissa steps the exponent, as the next code up is.
    if dropped > 0x8_0000 || (dropped == 0x8_0000 && kept & 1 == 1) {
        code += 1;
    }
    sign | code.min(0x7e) as u8
}

/// Block-wise FP8 of a row-major `[n_out, n_in]` matrix: the codes, and one scale per `block`
/// (its grid, row-major) such that a weight is its code's value times its block's scale. Each
/// scale is the block's largest magnitude over 448 (1 for a block of zeros), so that the largest
/// lands on 448.
pub fn quantize_blockwise(w: &[f32], n_in: usize, n_out: usize, block: ScaleBlock) -> (Vec<u8>, Vec<f32>) {
    let [block_rows, block_cols] = block.grid(n_out, n_in);
    let mut largest = vec![0f32; block_rows * block_cols];
    for (r, row) in w.chunks_exact(n_in).enumerate() {
        for (c, v) in row.iter().enumerate() {
            let m = &mut largest[block.index(r, c, n_in)];
            *m = m.max(v.abs());
        }
    }
    let scales: Vec<f32> = largest
        .iter()
        .map(|&m| if m > 0.0 { m / E4M3_MAX } else { 1.0 })
        .collect();
    let codes = w
        .iter()
        .enumerate()
        .map(|(i, v)| encode(v / scales[block.index(i / n_in, i % n_in, n_in)]))
        .collect();
    (codes, scales)
}

/// Appends a row-major `[n_out, n_in]` matrix of E4M3 `codes` as `Fp8` blocks, the scale of the
/// block at row `r` starting at column `c` given by `scale(r, c)`. `n_in` is a multiple of 32.
pub fn pack(codes: &[u8], n_in: usize, scale: impl Fn(usize, usize) -> f32, out: &mut [u8]) {
    let blocks = out.chunks_exact_mut(BLOCK_BYTES);
    for (i, (block, chunk)) in blocks.zip(codes.chunks_exact(CODES_PER_BLOCK)).enumerate() {
        let (row, col) = (i * CODES_PER_BLOCK / n_in, i * CODES_PER_BLOCK % n_in);
        block[..4].copy_from_slice(&scale(row, col).to_le_bytes());
        block[4..].copy_from_slice(chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_encodes_back_to_itself() {
        for code in 0..=255u8 {
            let v = decode(code);
            if !v.is_nan() {
                assert_eq!(encode(v), code, "code {code:#04x} ({v})");
            }
        }
    }

    #[test]
    fn beyond_448_saturates_and_nan_stays_nan() {
        assert_eq!(decode(encode(1e6)), 448.0);
        assert_eq!(decode(encode(f32::NEG_INFINITY)), -448.0);
        assert_eq!(decode(encode(463.0)), 448.0);
        assert!(decode(encode(f32::NAN)).is_nan());
    }

    #[test]
    fn blockwise_scales_put_each_blocks_largest_on_448() {
        let (n_in, n_out) = (160, 130);
        let w: Vec<f32> = (0..n_in * n_out)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01 * (1 + i / n_in % 7) as f32)
            .collect();
        // (the block, its grid)
        for (block, grid) in [
            (ScaleBlock::square(128), [2, 2]),
            (ScaleBlock::square(32), [5, 5]),
            (ScaleBlock { rows: 1, cols: 64 }, [130, 3]),
        ] {
            let (codes, scales) = quantize_blockwise(&w, n_in, n_out, block);
            assert_eq!(block.grid(n_out, n_in), grid);
            assert_eq!(scales.len(), grid[0] * grid[1], "{block}");
            let mut largest = vec![0f32; scales.len()];
            for (i, (&code, &v)) in codes.iter().zip(&w).enumerate() {
                let at = block.index(i / n_in, i % n_in, n_in);
                assert_eq!(at, i / n_in / block.rows * grid[1] + i % n_in / block.cols);
                let got = decode(code) * scales[at];
                largest[at] = largest[at].max(decode(code).abs());
                // Three mantissa bits: within half a step, 1/16 of the value, or of the subnormal step.
                assert!(
                    (got - v).abs() <= v.abs() / 16.0 + scales[at] / 1024.0,
                    "{block} {i}: {got} vs {v}"
                );
            }
            assert!(largest.iter().all(|&m| m == E4M3_MAX), "{block}: {largest:?}");
        }
        assert!(ScaleBlock::square(64).whole(192, 576) && !ScaleBlock::square(128).whole(192, 576));
        assert!(!ScaleBlock { rows: 3, cols: 32 }.whole(130, 160) && ScaleBlock { rows: 2, cols: 32 }.whole(130, 160));
    }
}
