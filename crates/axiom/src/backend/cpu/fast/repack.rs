//! Weights repacked for the AVX-512 integer kernels: rows interleaved in panels of 16.
//!
//! In a panel, each run of four consecutive weights of the 16 rows sits in one 64-byte vector
//! (four bytes per row), so one `vpdpbusd` against the four matching activation bytes,
//! broadcast, advances all 16 dot products at once: the 16 lanes of the accumulator are the 16
//! output rows, and no horizontal sum is ever needed. Per block of `block_len` weights each row
//! has a scale `a` and offset `b`, the weight being `a * u + b` for its unsigned quant `u`:
//! f16 where that is exact (the simple quants' own scales), f32 for the K-quants, whose
//! `d * sc` products need more bits. 4-bit quants keep their density: one vector holds two runs,
//! in low and high nibbles.

use super::{portable, Stage, CHUNK, GROUP};
use crate::format::quant::GgmlType;
use half::f16;

/// Rows per panel: the lanes of one AVX-512 vector of i32.
pub const PANEL: usize = 16;

/// How the quants of one panel-block are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// 4-bit quants, two runs per vector (Q4_0, Q4_1, Q4_K).
    Nibbles,
    /// 8-bit quants, one run per vector (Q8_0, Q5_0, Q6_K).
    Bytes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub packing: Packing,
    /// Weights per block sharing one scale and offset (16 or 32).
    pub block_len: usize,
    /// Scales and offsets stored as f32 (else f16).
    pub f32_scales: bool,
}

impl Layout {
    pub fn for_type(ty: GgmlType) -> Option<Layout> {
        Some(match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => Layout {
                packing: Packing::Nibbles,
                block_len: 32,
                f32_scales: false,
            },
            GgmlType::Q4K => Layout {
                packing: Packing::Nibbles,
                block_len: 32,
                f32_scales: true,
            },
            GgmlType::Q8_0 | GgmlType::Q5_0 => Layout {
                packing: Packing::Bytes,
                block_len: 32,
                f32_scales: false,
            },
            GgmlType::Q6K => Layout {
                packing: Packing::Bytes,
                block_len: 16,
                f32_scales: true,
            },
            _ => return None,
        })
    }

    /// Bytes of quants of one panel-block.
    pub fn quant_bytes(&self) -> usize {
        match self.packing {
            Packing::Nibbles => PANEL * self.block_len / 2,
            Packing::Bytes => PANEL * self.block_len,
        }
    }

    /// Bytes of one scale or offset.
    pub fn scale_bytes(&self) -> usize {
        if self.f32_scales {
            4
        } else {
            2
        }
    }

    /// Bytes of one panel-block: quants, then 16 scales, then 16 offsets.
    pub fn block_bytes(&self) -> usize {
        self.quant_bytes() + 2 * PANEL * self.scale_bytes()
    }
}

/// A repacked weight matrix. Panels past `n_out` are padded with zero rows.
pub struct Repacked {
    pub layout: Layout,
    pub n_in: usize,
    pub n_out: usize,
    pub n_blocks: usize,
    data: Vec<u64>,
}

impl Repacked {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: u64 storage (for 8-byte alignment) viewed as bytes.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.data.len() * 8) }
    }

    pub fn panels(&self) -> usize {
        self.n_out.div_ceil(PANEL)
    }

    pub fn panel_bytes(&self) -> usize {
        self.n_blocks * self.layout.block_bytes()
    }

    /// Repacks a `[n_out, n_in]` weight of `ty` (which must have a layout; `n_in` a multiple of 32).
    pub fn new(ty: GgmlType, w: &[u8], n_in: usize, n_out: usize) -> Repacked {
        #[allow(
            clippy::expect_used,
            reason = "weights are repacked only when `Layout::for_type` has one"
        )]
        let layout = Layout::for_type(ty).expect("type has an integer layout");
        let n_blocks = n_in.div_ceil(layout.block_len);
        let panels = n_out.div_ceil(PANEL);
        let panel_bytes = n_blocks * layout.block_bytes();
        let mut data = vec![0u64; (panels * panel_bytes).div_ceil(8)];
        // SAFETY: as in `bytes`, mutably.
        let bytes = unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr() as *mut u8, data.len() * 8) };
        let mut stage = Stage::default();
        stage.resize(PANEL, n_in.div_ceil(CHUNK));
        let row_len = stage.n_chunks * CHUNK;
        for p in 0..panels {
            for slot in 0..PANEL {
                let row = p * PANEL + slot;
                if row < n_out {
                    portable::unpack_row(ty, w, n_in, row, &mut stage, slot);
                } else {
                    stage.u[slot * row_len..(slot + 1) * row_len].fill(0);
                    stage.a[slot * row_len / GROUP..(slot + 1) * row_len / GROUP].fill(0.0);
                    stage.b[slot * row_len / GROUP..(slot + 1) * row_len / GROUP].fill(0.0);
                }
            }
            for j in 0..n_blocks {
                let dst = &mut bytes[p * panel_bytes + j * layout.block_bytes()..][..layout.block_bytes()];
                let (quants, scales) = dst.split_at_mut(layout.quant_bytes());
                let runs = layout.block_len / GROUP;
                for r in 0..PANEL {
                    let u = &stage.u[r * row_len + j * layout.block_len..];
                    match layout.packing {
                        Packing::Nibbles => {
                            for run in 0..runs / 2 {
                                for k in 0..GROUP {
                                    let lo = u[run * GROUP + k];
                                    let hi = u[(run + runs / 2) * GROUP + k];
                                    quants[run * 64 + r * GROUP + k] = lo | (hi << 4);
                                }
                            }
                        }
                        Packing::Bytes => {
                            for run in 0..runs {
                                for k in 0..GROUP {
                                    quants[run * 64 + r * GROUP + k] = u[run * GROUP + k];
                                }
                            }
                        }
                    }
                    let group = (r * row_len + j * layout.block_len) / GROUP;
                    let (a, b) = (stage.a[group], stage.b[group]);
                    let w = layout.scale_bytes();
                    let (a_at, b_at) = (w * r, w * (PANEL + r));
                    if layout.f32_scales {
                        scales[a_at..a_at + 4].copy_from_slice(&a.to_le_bytes());
                        scales[b_at..b_at + 4].copy_from_slice(&b.to_le_bytes());
                    } else {
                        scales[a_at..a_at + 2].copy_from_slice(&f16::from_f32(a).to_le_bytes());
                        scales[b_at..b_at + 2].copy_from_slice(&f16::from_f32(b).to_le_bytes());
                    }
                }
            }
        }
        Repacked {
            layout,
            n_in,
            n_out,
            n_blocks,
            data,
        }
    }
}
