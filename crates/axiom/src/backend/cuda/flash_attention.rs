//! Flash attention on tensor cores (kernels/flash_attention.cu on mma.sync, flash_attention_wg.cu
//! on Hopper's warpgroup MMAs, flash_decode.cu for steps of one token a tile): how a step is cut
//! into blocks and query tiles, and the launcher.

use super::device::CudaDevice;
use super::kernels::{self, Kernels};
use super::launch::page_size_arg;
use super::occupancy::allow_dynamic_shared;
use super::params::FlashAttentionParams;
use super::CudaBackend;
use crate::backend::{AttentionKv, AttentionShape, BlockHandle, Kernels as _, KvType, Rope, RopeLayout, StepLayout};
use crate::format::quant::GgmlType;
use crate::{Error, Result};

/// Steps of at least this many tokens run attention on tensor cores (flash_attention.cu), where
/// the f16 cache and the head size allow; smaller ones, decode above all, use the one-pass kernel.
pub(super) const FLASH_MIN_TOKENS: usize = 32;

/// Warps of a flash-attention block on mma.sync (FA_WARPS in flash_attention.cu).
const FLASH_WARPS: usize = 4;

/// Keys per step of flash attention on mma.sync (FA_KEYS) and on the warpgroup MMAs (FW_KEYS).
const FLASH_KEYS: usize = 32;
const FLASH_WG_KEYS: usize = 64;

/// Query rows of a group of a flash-attention block: a warpgroup's, or a 16 each of four warps.
const FLASH_GROUP_ROWS: usize = 64;

/// Keys per step of flash_decode.cu (FD_KEYS: 16 for each of its FD_WARPS warps), its threads,
/// and the query heads of one KV head that a block takes (one MMA group's rows).
const DECODE_KEYS: usize = 64;
const DECODE_THREADS: u32 = 128;
const DECODE_HEADS: usize = 16;

/// A flash_decode block's dynamic shared memory: two buffers of keys and two of values, then its
/// 16 query rows, in f16, each row of `head_dim` padded by 16 bytes.
fn decode_shared(head_dim: usize) -> u32 {
    ((4 * DECODE_KEYS + DECODE_HEADS) * (head_dim + 8) * 2) as u32
}

/// The most rotated pairs of a head flash attention takes (heads of at most 128).
pub(super) const FLASH_MAX_PAIRS: usize = 64;

/// The largest second grid dimension CUDA launches.
const MAX_GRID_Y: u32 = 65535;

/// How flash attention is cut into blocks of `groups` times 64 query rows. On Hopper (sm_90a)
/// each group is a warpgroup of its own on the warpgroup MMAs (flash_attention_wg.cu);
/// elsewhere the four warps of a block each take `groups` groups of 16 rows on mma.sync
/// (flash_attention.cu), where two share every key and value fragment a warp loads (half the
/// fragment loads and about a quarter fewer instructions an MMA). Either way blocks of 128
/// queries are too few to fill the GPU in short steps, which take blocks of one group.
#[derive(Clone, Copy)]
struct FlashBlocks {
    head_dim: usize,
    groups: usize,
    warpgroups: bool,
}

impl FlashBlocks {
    /// Two groups where the step's tiles of 128 queries give each multiprocessor two blocks.
    fn for_step(shape: AttentionShape, n_tokens: usize, multiprocessors: u32, warpgroups: bool) -> FlashBlocks {
        let wide_blocks = n_tokens.div_ceil(2 * FLASH_GROUP_ROWS) * shape.n_heads;
        FlashBlocks {
            head_dim: shape.head_dim,
            groups: if wide_blocks >= 2 * multiprocessors as usize {
                2
            } else {
                1
            },
            warpgroups,
        }
    }

    fn kernel(&self) -> String {
        kernels::flash_attention_kernel(self.head_dim, self.groups, self.warpgroups)
    }

    /// Query tokens a block takes.
    fn tile(&self) -> usize {
        FLASH_GROUP_ROWS * self.groups
    }

    fn threads(&self) -> u32 {
        if self.warpgroups {
            (self.groups * 128) as u32
        } else {
            (FLASH_WARPS * 32) as u32
        }
    }

    /// A block's dynamic shared memory: two buffers of keys, two of values and the block's
    /// queries, in f16: on mma.sync each row of `head_dim` padded by 16 bytes; on the warpgroup
    /// MMAs swizzled, with 1024 bytes more to align the tiles.
    fn shared(&self) -> u32 {
        let bytes = if self.warpgroups {
            (4 * FLASH_WG_KEYS + self.tile()) * self.head_dim * 2 + 1024
        } else {
            (4 * FLASH_KEYS + self.tile()) * (self.head_dim + 8) * 2
        };
        bytes as u32
    }
}

/// Splits a step's tokens into runs of one sequence at consecutive positions, at most `tile`
/// long: `(first token, count)` pairs, flattened, those of several tokens (for
/// flash_attention.cu) before those of one (for flash_decode.cu), each in token order; and how
/// many are of one.
fn query_tiles(positions: &[u32], token_seqs: &[u32], tile: usize) -> (Vec<u32>, usize) {
    let mut tiles: Vec<u32> = Vec::new();
    for t in 0..positions.len() {
        let extends = t > 0
            && token_seqs[t] == token_seqs[t - 1]
            && positions[t] == positions[t - 1] + 1
            && tiles.last().is_some_and(|&n| (n as usize) < tile);
        match tiles.last_mut() {
            Some(n) if extends => *n += 1,
            _ => tiles.extend([t as u32, 1]),
        }
    }
    let (mut several, one): (Vec<[u32; 2]>, Vec<[u32; 2]>) =
        tiles.chunks(2).map(|t| [t[0], t[1]]).partition(|t| t[1] > 1);
    let n_single = one.len();
    several.extend(one);
    (several.concat(), n_single)
}

/// A flash-attention step's plan (`Kernels::plan_step`): its blocks, and the query tiles it
/// made, already written to the tiles block: `n_tiles` of several tokens for flash_attention.cu,
/// then `n_single` of one token (sequences decoding) for flash_decode.cu.
#[derive(Clone, Copy)]
pub struct FlashPlan {
    blocks: FlashBlocks,
    n_tokens: usize,
    n_tiles: u32,
    n_single: u32,
}

/// The head sizes flash attention takes on this device (64 and 128 where a block may have their
/// shared memory: not on compute capability 7.5), each kernel allowed its dynamic shared memory.
pub(super) fn flash_head_dims(device: &CudaDevice, kernels: &Kernels) -> Result<Vec<usize>> {
    let mut dims = Vec::new();
    for head_dim in [64, 128] {
        let mut fits = true;
        for &warpgroups in kernels::flash_attention_kinds(device.arch) {
            for groups in [1, 2] {
                let blocks = FlashBlocks {
                    head_dim,
                    groups,
                    warpgroups,
                };
                fits &= blocks.shared() <= allow_dynamic_shared(device, kernels.get(&blocks.kernel())?)?;
            }
        }
        let decode = kernels.get(&kernels::flash_decode_kernel(head_dim))?;
        fits &= decode_shared(head_dim) <= allow_dynamic_shared(device, decode)?;
        if fits {
            dims.push(head_dim);
        }
    }
    Ok(dims)
}

impl CudaBackend {
    /// Fixes flash attention's blocks: `groups` groups of 64 query rows (1 or 2), on the
    /// warpgroup MMAs or on mma.sync, instead of the backend's choice by the step's size and the
    /// device (`FlashBlocks::for_step`), so that every kernel can be tested and measured on any
    /// step.
    pub fn with_flash_kernel(mut self, groups: usize, warpgroups: bool) -> Result<CudaBackend> {
        if !matches!(groups, 1 | 2) {
            return Err(Error::Backend(format!(
                "flash attention takes 1 or 2 groups of 64 query rows a block, not {groups}"
            )));
        }
        if !self.flash_attention_kinds().contains(&warpgroups) {
            return Err(Error::Backend(format!(
                "no warpgroup MMAs on {} (they need sm_90a)",
                self.device.arch
            )));
        }
        self.flash_fixed = Some((groups, warpgroups));
        Ok(self)
    }

    /// The flash-attention kernels this device has, by whether they run on the warpgroup MMAs.
    pub fn flash_attention_kinds(&self) -> &'static [bool] {
        kernels::flash_attention_kinds(self.device.arch)
    }

    /// Whether attention over `n_tokens` runs on tensor cores (flash_attention.cu).
    pub(super) fn takes_flash(&self, shape: AttentionShape, n_tokens: usize) -> bool {
        self.paths.flash()
            && self.kv_type == KvType::F16
            && self.flash_head_dims.contains(&shape.head_dim)
            && n_tokens >= FLASH_MIN_TOKENS
            && self.flash_tiles.is_some()
    }

    /// The plan of a step that takes flash attention (none for one that does not): its blocks,
    /// and its tiles written to `flash_tiles` for every layer's launch to read.
    pub(super) fn plan_flash(&self, layout: StepLayout, shape: AttentionShape) -> Result<Option<FlashPlan>> {
        let n_tokens = layout.n_tokens();
        if !self.takes_flash(shape, n_tokens) {
            return Ok(None);
        }
        let tiles_block = self
            .flash_tiles
            .ok_or_else(|| Error::Backend("no flash-attention tiles reserved".into()))?;
        let blocks = match self.flash_fixed {
            Some((groups, warpgroups)) => FlashBlocks {
                head_dim: shape.head_dim,
                groups,
                warpgroups,
            },
            None => FlashBlocks::for_step(shape, n_tokens, self.device.multiprocessors, self.flash_warpgroups),
        };
        let (tiles, single) = query_tiles(layout.positions, layout.token_seqs, blocks.tile());
        let grid = |n: usize| {
            u32::try_from(n)
                .ok()
                .filter(|&n| n <= MAX_GRID_Y)
                .ok_or_else(|| Error::Backend(format!("{n_tokens} tokens make too many attention tiles")))
        };
        let (n_tiles, n_single) = (grid(tiles.len() / 2 - single)?, grid(single)?);
        self.write_u32(tiles_block, &tiles)?;
        Ok(Some(FlashPlan {
            blocks,
            n_tokens,
            n_tiles,
            n_single,
        }))
    }

    /// Attention on tensor cores (flash_attention.cu), its output written at `out` as `out_type`:
    /// f32, or f16 or bf16 for a cuBLAS GEMM to read. With `rotate` (of whole heads), the queries
    /// are rotated as they are loaded, by the angles `rotate_and_store` left in `flash_turns`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn flash_attention(
        &self,
        q: BlockHandle,
        rotate: Option<Rope>,
        AttentionKv {
            k_cache,
            v_cache,
            positions,
            pages,
            scores,
            plan,
        }: AttentionKv<'_, Option<FlashPlan>>,
        out: u64,
        out_type: GgmlType,
        n_tokens: usize,
        shape: AttentionShape,
    ) -> Result<()> {
        let tiles_block = self
            .flash_tiles
            .ok_or_else(|| Error::Backend("no flash-attention tiles reserved".into()))?;
        let plan = plan
            .filter(|p| p.n_tokens == n_tokens && p.blocks.head_dim == shape.head_dim)
            .ok_or_else(|| {
                Error::Backend(format!(
                    "flash attention of {n_tokens} tokens without their step's plan"
                ))
            })?;
        let page_size = page_size_arg(&pages)?;
        let scores = scores.kernel_args()?;
        // How the kernel pairs the dimensions it rotates (FA_ADJACENT, FA_HALVES).
        let (turns, pairing) = match rotate {
            Some(rope) if rope.dims == shape.head_dim => {
                let turns = self
                    .flash_turns
                    .ok_or_else(|| Error::Backend("no flash-attention angles reserved".into()))?;
                (self.ptr(turns), 1 + i32::from(rope.layout == RopeLayout::Halves))
            }
            Some(rope) => {
                return Err(Error::Backend(format!(
                    "flash attention rotates whole heads, not {} of {}",
                    rope.dims, shape.head_dim
                )))
            }
            None => (0, 0),
        };
        let params = FlashAttentionParams {
            q: self.ptr(q),
            k_cache: self.ptr(k_cache),
            v_cache: self.ptr(v_cache),
            positions: self.ptr(positions),
            tables: self.ptr(pages.block_tables),
            table_width: pages.table_width as i32,
            token_seqs: self.ptr(pages.token_seqs),
            page_size,
            tiles: self.ptr(tiles_block),
            turns,
            pairing,
            out,
            out_type: out_type.id() as i32,
            n_heads: shape.n_heads as i32,
            n_kv_heads: shape.n_kv_heads as i32,
            scale: scores.scale,
            softcap: scores.softcap,
            window: scores.window,
        };
        let blocks = plan.blocks;
        if plan.n_tiles > 0 {
            // Heads first, then tiles: the kernel takes the tiles from the last (see
            // flash_attention.cu).
            self.launch_shared(
                &blocks.kernel(),
                (shape.n_heads as u32, plan.n_tiles, 1),
                blocks.threads(),
                blocks.shared(),
                &params,
            )?;
        }
        if plan.n_single > 0 {
            // KV heads, then the one-token tiles after the others, then the query heads of a KV
            // head 16 at a time.
            let heads_per_kv = shape.n_heads / shape.n_kv_heads;
            self.launch_shared(
                &kernels::flash_decode_kernel(shape.head_dim),
                (
                    shape.n_kv_heads as u32,
                    plan.n_single,
                    heads_per_kv.div_ceil(DECODE_HEADS) as u32,
                ),
                DECODE_THREADS,
                decode_shared(shape.head_dim),
                &FlashAttentionParams {
                    tiles: params.tiles + 8 * plan.n_tiles as u64,
                    ..params
                },
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_tiles_are_runs_of_one_sequence_at_consecutive_positions() {
        // A 140-token prompt chunk of sequence 0 from position 5, a decode of sequence 1, then
        // sequence 2 restarting at 0 right after sequence 0's positions would continue.
        let mut positions: Vec<u32> = (5..145).collect();
        let mut seqs = vec![0u32; 140];
        positions.extend([40, 0, 1]);
        seqs.extend([1, 2, 2]);
        // The one-token tile (sequence 1's decode) goes after the others.
        assert_eq!(
            query_tiles(&positions, &seqs, 128),
            (vec![0, 128, 128, 12, 141, 2, 140, 1], 1)
        );
        assert_eq!(query_tiles(&positions, &seqs, 64).0[..6], [0, 64, 64, 64, 128, 12]);
        assert_eq!(query_tiles(&[], &[], 64), (vec![], 0));
    }

    #[test]
    fn flash_blocks_fit_two_a_hopper_multiprocessor() {
        // The 8B's heads (32 of 128) on the H200's 132 multiprocessors: 2048 tokens make two
        // blocks a multiprocessor of 128 queries, 512 tokens take blocks of 64.
        let shape = AttentionShape {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
        };
        for warpgroups in [false, true] {
            let long = FlashBlocks::for_step(shape, 2048, 132, warpgroups);
            let short = FlashBlocks::for_step(shape, 512, 132, warpgroups);
            assert_eq!((long.tile(), short.tile()), (128, 64));
            assert_eq!(long.warpgroups, warpgroups);
            // Every kernel's launch bounds ask for at least two blocks a multiprocessor: 233,472
            // bytes of shared memory, 1024 of each block reserved.
            for blocks in [long, short] {
                assert!(2 * (blocks.shared() + 1024) <= 233_472, "{}", blocks.kernel());
            }
        }
        let wide = FlashBlocks::for_step(shape, 2048, 132, true);
        assert_eq!(
            (wide.threads(), wide.kernel().as_str()),
            (256, "flash_attention_wg_128_2")
        );
        // Tiles of 128 queries, 4 buffers of 64 keys, 1024 bytes to align.
        assert_eq!(wide.shared(), (4 * 64 + 128) * 128 * 2 + 1024);
    }
}
