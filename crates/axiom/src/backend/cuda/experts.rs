//! Mixture-of-experts ops (kernels/experts.cu): `route` on the device, the experts' products on
//! the matrix-vector kernels' row dot products, per (token, expert) pair for small steps and per
//! expert over its grouped pairs for larger ones (on the tensor cores instead where the paths
//! allow: expert_gemm.rs), then their weighted sum into the residual (for small steps in the down
//! products' own launch); and the shared expert's gated add. The routes stay on the device
//! throughout.

use super::launch::blocks_for;
use super::matmul::{q8_scale_bytes, Quantized, GEMV_MAX_TOKENS, Q4K_ROWS};
use super::params::{
    AddGatedParams, ExpertDownSumParams, ExpertProductParams, ExpertWeights, ExpertsSumParams, GatherPairsParams,
    GroupPairsParams, RouteParams, RouterRouteParams,
};
use super::weights::CudaWeight;
use super::{kernels, CudaBackend};
use crate::backend::{
    add_shared_expert, mixture_in_steps, Activation, Backend, BlockHandle, ExpertScratch, ExpertSet, Input, Mixture,
    MixtureScratch, Routes, Routing,
};
use crate::format::quant::GgmlType;
use crate::{Error, Result};

/// Steps of up to this many tokens run each (token, expert) pair on its own, reading only the
/// chosen experts' rows; longer ones group the pairs by expert first, so that each chosen
/// expert's rows are read once for all of its tokens.
const PAIRWISE_MAX_TOKENS: usize = GEMV_MAX_TOKENS;

/// Experts the routing kernel takes at most: 16 a lane (route_token in kernels/experts.cu).
const ROUTE_MAX_EXPERTS: usize = 512;

/// Router rows a router_route block takes (ROUTER_ROWS in kernels/experts.cu).
const ROUTER_ROWS: usize = 2;

/// Warps of a `group_pairs_count` and `group_pairs_place` block (GROUP_WARPS in
/// kernels/experts.cu), each with its counters per expert in shared memory.
const GROUP_WARPS: usize = 4;

/// Threads of `group_pairs_scan`'s one block: one an expert at a time.
const SCAN_THREADS: u32 = 1024;

/// How the expert products of a step find their inputs and experts.
#[derive(Clone, Copy)]
enum Pairs {
    /// Each pair on its own: its expert from the routes' ids, its input row from the token's.
    Each { ids: BlockHandle },
    /// Grouped by expert: expert e's slots from `offsets[e]`, their rows gathered.
    Grouped { offsets: BlockHandle },
}

/// The input rows of expert products: f32, quantized for the integer kernels, or in the 16 bits
/// (f16 or bf16) that grouped products take on the tensor cores.
#[derive(Clone, Copy)]
enum Rows {
    F32(BlockHandle),
    Int8(Quantized),
    Sixteen(BlockHandle, GgmlType),
}

/// `buffer` as int8 staging for `n` activations of experts of `ty` (`quantize_activations`):
/// the values, then their scales at a 16-byte boundary.
fn int8_staging(buffer: BlockHandle, n: usize, ty: GgmlType) -> Result<(BlockHandle, BlockHandle)> {
    let (at, scales) = (n.next_multiple_of(16), q8_scale_bytes(ty, n));
    if buffer.len < at + scales {
        return Err(Error::Backend(format!(
            "experts: {} bytes of scratch for {n} int8 activations",
            buffer.len
        )));
    }
    Ok((buffer.slice(0, n), buffer.slice(at, scales)))
}

impl CudaBackend {
    /// `Kernels::route`.
    pub(super) fn launch_route(
        &self,
        logits: BlockHandle,
        routes: Routes,
        n_tokens: usize,
        routing: Routing,
    ) -> Result<()> {
        let params = self.route_params(logits, routes, n_tokens, routing)?;
        if n_tokens == 0 {
            return Ok(()); // a grid is never empty
        }
        self.launch("route", (n_tokens.div_ceil(8) as u32, 1, 1), 256, &params)
    }

    /// The routing kernels' view of a step's routing, checked.
    fn route_params(
        &self,
        logits: BlockHandle,
        routes: Routes,
        n_tokens: usize,
        routing: Routing,
    ) -> Result<RouteParams> {
        routing.check(&routes)?;
        // A warp's lanes hold its token's experts and picks (route_token in kernels/experts.cu).
        if routing.n_experts > ROUTE_MAX_EXPERTS || routing.k > 32 {
            return Err(Error::Backend(format!(
                "route: {} experts, {} a token: the CUDA kernel takes at most {ROUTE_MAX_EXPERTS} and 32",
                routing.n_experts, routing.k
            )));
        }
        Ok(RouteParams {
            logits: self.ptr(logits),
            ids: self.ptr(routes.ids),
            weights: self.ptr(routes.weights),
            n_tokens: n_tokens as i32,
            n_experts: routing.n_experts as i32,
            k: routing.k as i32,
            renormalize: i32::from(routing.renormalize),
        })
    }

    /// `Backend::mixture`. Steps of up to `PAIRWISE_MAX_TOKENS` tokens with a float router, where
    /// the paths allow (`Paths::fuses_routing`): the block's input normalized once, into f32 rows
    /// for the router and, for int8 expert products, quantized in the same pass; the router's
    /// product and the routing in one launch (router_route). Other steps as `mixture_in_steps`.
    pub(super) fn run_mixture(
        &self,
        x: Input,
        m: Mixture<'_, CudaWeight>,
        s: MixtureScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        let router_kernel = match m.router.ty {
            GgmlType::F32 => "router_route_f32",
            GgmlType::F16 => "router_route_f16",
            GgmlType::BF16 => "router_route_bf16",
            _ => return mixture_in_steps(self, x, m, s, residual, n_tokens),
        };
        if n_tokens == 0 || n_tokens > PAIRWISE_MAX_TOKENS || !self.paths.fuses_routing() {
            return mixture_in_steps(self, x, m, s, residual, n_tokens);
        }
        let (dim, router) = (m.router.n_in, m.router);
        if router.n_out != m.routing.n_experts {
            return Err(Error::Backend(format!(
                "mixture: a router of {} rows for {} experts",
                router.n_out, m.routing.n_experts
            )));
        }
        let (gate, up) = (self.expert_stack(m.experts.gate)?.0, self.expert_stack(m.experts.up)?.0);
        let (rows, quantized) = if gate.ty == up.ty && self.paths.int8_experts(gate.ty) {
            let staging = int8_staging(s.experts.rows, n_tokens * dim, gate.ty)?;
            let (rows, quantized) = self.quantize_keeping_rows(x, staging, n_tokens, gate)?;
            (rows, Some(quantized))
        } else {
            (self.input_rows(x, n_tokens, dim)?, None)
        };
        let params = RouterRouteParams {
            w: self.ptr(router.q),
            x: self.ptr(rows),
            done: self.router_done,
            n_in: dim as i32,
            route: self.route_params(s.logits, s.routes, n_tokens, m.routing)?,
        };
        let blocks = m.routing.n_experts.div_ceil(ROUTER_ROWS) as u32;
        self.launch(router_kernel, (blocks, 1, 1), 256, &params)?;
        self.run_experts(rows, quantized, m.experts, s.routes, s.experts, residual, n_tokens)?;
        match m.shared {
            Some(shared) => add_shared_expert(self, rows, shared, s, residual, n_tokens),
            None => Ok(()),
        }
    }

    /// `Kernels::experts`: the gate and up products with the gated activation (one launch where
    /// gate and up are of one type), the down products, then their weighted sum into the
    /// residual. Up to `PAIRWISE_MAX_TOKENS` tokens, per pair, the down products and the sum in
    /// one launch (`down_sum`); beyond, the pairs are grouped by expert on the device first and
    /// their input rows gathered into `scratch.rows`.
    pub(super) fn run_experts(
        &self,
        x: BlockHandle,
        quantized: Option<Quantized>,
        set: ExpertSet<'_, CudaWeight>,
        routes: Routes,
        scratch: ExpertScratch,
        residual: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        let (dim, width) = set.shape()?;
        let (n_experts, k) = (set.n_experts(), routes.k);
        let n_pairs = n_tokens * k;
        if n_pairs == 0 {
            return Ok(()); // as in `route`
        }
        let (gate, up, down) = (
            self.expert_stack(set.gate)?,
            self.expert_stack(set.up)?,
            self.expert_stack(set.down)?,
        );
        let (pairs, inputs, per_token, sum_slots) = if n_tokens <= PAIRWISE_MAX_TOKENS {
            (Pairs::Each { ids: routes.ids }, Rows::F32(x), k, None)
        } else {
            let groups = ExpertScratch::groups_len(n_experts, n_pairs);
            if scratch.groups.len < groups * 4 {
                return Err(Error::Backend(format!(
                    "experts: {} bytes of scratch for grouping {n_pairs} pairs over {n_experts} experts",
                    scratch.groups.len
                )));
            }
            let offsets = scratch.groups.slice(0, (n_experts + 1) * 4);
            let slots = scratch.groups.slice((n_experts + 1) * 4, n_pairs * 4);
            let slot_pairs = scratch.groups.slice((n_experts + 1 + n_pairs) * 4, n_pairs * 4);
            let chunks = n_pairs.div_ceil(ExpertScratch::GROUP_CHUNK);
            let counts = scratch
                .groups
                .slice((n_experts + 1 + 2 * n_pairs) * 4, chunks * n_experts * 4);
            let params = GroupPairsParams {
                ids: self.ptr(routes.ids),
                offsets: self.ptr(offsets),
                slots: self.ptr(slots),
                pairs: self.ptr(slot_pairs),
                counts: self.ptr(counts),
                n_pairs: n_pairs as i32,
                n_experts: n_experts as i32,
            };
            // The counters of a block's warps, or the scan's group sizes, in shared memory.
            let counters = GROUP_WARPS * n_experts * 4;
            if counters > 48 << 10 {
                return Err(Error::Backend(format!(
                    "experts: grouping pairs over {n_experts} experts takes {counters} bytes of shared memory, over 48 KiB"
                )));
            }
            let (blocks, threads) = (chunks.div_ceil(GROUP_WARPS) as u32, (GROUP_WARPS * 32) as u32);
            self.launch_shared("group_pairs_count", (blocks, 1, 1), threads, counters as u32, &params)?;
            self.launch_shared(
                "group_pairs_scan",
                (1, 1, 1),
                SCAN_THREADS,
                (n_experts * 4) as u32,
                &params,
            )?;
            self.launch_shared("group_pairs_place", (blocks, 1, 1), threads, counters as u32, &params)?;
            // In 16 bits where gate and up both take them so on the tensor cores.
            let sixteen = self
                .gemm_rows(gate.0.ty)
                .filter(|&ty| Some(ty) == self.gemm_rows(up.0.ty));
            self.launch(
                "gather_pairs",
                (blocks_for(n_pairs * dim / 4, 256).min(4096), 1, 1),
                256,
                &GatherPairsParams {
                    x: self.ptr(x),
                    rows: self.ptr(scratch.rows),
                    pairs: self.ptr(slot_pairs),
                    offsets: self.ptr(offsets),
                    n_experts: n_experts as i32,
                    k: k as i32,
                    dim: dim as i32,
                    row_type: sixteen.unwrap_or(GgmlType::F32).id() as i32,
                },
            )?;
            let rows = match sixteen {
                Some(ty) => Rows::Sixteen(scratch.rows, ty),
                None => Rows::F32(scratch.rows),
            };
            (Pairs::Grouped { offsets }, rows, 1, Some(slots))
        };
        let product = |w: (&CudaWeight, ExpertWeights), up: Option<ExpertWeights>, x, per_token, out| {
            self.expert_products(pairs, w, up, set.activation, (x, per_token), out, n_pairs, n_experts)
        };
        // The hidden rows: in 16 bits where the gate and up products and the down products all
        // run on the tensor cores, so that the down products read half the bytes.
        let hidden = match (inputs, self.gemm_rows(down.0.ty)) {
            (Rows::Sixteen(..), Some(ty)) if gate.0.ty == up.0.ty => Rows::Sixteen(scratch.hidden, ty),
            _ => Rows::F32(scratch.hidden),
        };
        if gate.0.ty == up.0.ty {
            // Pairwise, on int8 activations where the experts' type allows: the tokens' rows
            // quantized once into `scratch.rows`, which only grouped steps use (unless the
            // caller has: `quantized`).
            let rows = match pairs {
                Pairs::Each { .. } if self.paths.int8_experts(gate.0.ty) => Rows::Int8(match quantized {
                    Some(quantized) => quantized,
                    None => {
                        let staging = int8_staging(scratch.rows, n_tokens * dim, gate.0.ty)?;
                        self.quantize_activations(Input::Rows(x), staging, n_tokens, gate.0)?
                    }
                }),
                _ => inputs,
            };
            product(gate, Some(up.1), rows, per_token, hidden)?;
        } else {
            product(gate, None, inputs, per_token, Rows::F32(scratch.gate))?;
            product(up, None, inputs, per_token, Rows::F32(scratch.up))?;
            self.launch_glu(
                scratch.gate,
                scratch.up,
                scratch.hidden,
                n_pairs * width,
                set.activation,
            )?;
        }
        if let Pairs::Each { ids } = pairs {
            // The hidden rows quantized into `scratch.gate`, free once the gated activation has
            // read it, where the down products may run on int8 activations.
            let hidden = if self.paths.int8_experts(down.0.ty) {
                let staging = int8_staging(scratch.gate, n_pairs * width, down.0.ty)?;
                Rows::Int8(self.quantize_activations(Input::Rows(scratch.hidden), staging, n_pairs, down.0)?)
            } else {
                Rows::F32(scratch.hidden)
            };
            return self.down_sum(down, ids, routes.weights, hidden, residual, n_tokens, k, n_experts);
        }
        product(down, None, hidden, 1, Rows::F32(scratch.out))?;
        let n = n_tokens * dim;
        self.launch(
            "experts_sum",
            (blocks_for(n, 256).min(4096), 1, 1),
            256,
            &ExpertsSumParams {
                residual: self.ptr(residual),
                out: self.ptr(scratch.out),
                ids: self.ptr(routes.ids),
                weights: self.ptr(routes.weights),
                slots: sum_slots.map_or(0, |s| self.ptr(s)),
                n: n as u64,
                dim: dim as i32,
                k: k as i32,
                n_experts: n_experts as i32,
            },
        )
    }

    /// The down products of a step's pairs by their `hidden` rows, weighed by `weights` and added
    /// to `residual` in one launch (expert_down_sum in kernels/experts.cu): a block's eight warps
    /// take one pick each, so the rows a block covers are as many as eight warps' worth over the
    /// `k` picks (all k picks in one round up to eight), a warp's rows two for Q4_K on int8
    /// activations (four for narrow experts), else one.
    #[allow(clippy::too_many_arguments)]
    fn down_sum(
        &self,
        (w, stack): (&CudaWeight, ExpertWeights),
        ids: BlockHandle,
        weights: BlockHandle,
        hidden: Rows,
        residual: BlockHandle,
        n_tokens: usize,
        k: usize,
        n_experts: usize,
    ) -> Result<()> {
        let groups = 8 / k.min(8);
        let suffix = Self::type_suffix(w.ty)?;
        let (int8, x, xq, xd) = match hidden {
            Rows::F32(x) => (false, self.ptr(x), 0, 0),
            Rows::Int8(q) => (true, 0, self.ptr(q.xq), self.ptr(q.xd)),
            Rows::Sixteen(..) => return Err(Error::Backend("experts: 16-bit rows are for grouped products".into())),
        };
        let q4k = int8 && w.ty == GgmlType::Q4K;
        let (name, rows_per_warp) = match (q4k, w.n_in <= kernels::Q4K_NARROW_IN) {
            (true, true) => (kernels::EXPERT_DOWN_SUM_NARROW_Q4K.to_string(), 4),
            (true, false) => (kernels::expert_down_sum_kernel(int8, suffix), Q4K_ROWS),
            (false, _) => (kernels::expert_down_sum_kernel(int8, suffix), 1),
        };
        let params = ExpertDownSumParams {
            w: stack,
            ids: self.ptr(ids),
            weights: self.ptr(weights),
            x,
            xq,
            xd,
            residual: self.ptr(residual),
            n_in: w.n_in as i32,
            n_out: w.n_out as i32,
            n_experts: n_experts as i32,
            k: k as i32,
            groups: groups as i32,
        };
        self.launch(
            &name,
            (w.n_out.div_ceil(groups * rows_per_warp) as u32, n_tokens as u32, 1),
            256,
            &params,
        )
    }

    /// One launch of expert products: matrix `w` (with `up`, act(gate) * up) of each pair's expert
    /// by its input row (row `pair / per_token` of `x` per pair, or the pair's slot grouped) into
    /// its row of `out`. Int8 rows are for pairs' gate and up products only; 16-bit rows for
    /// grouped products on the tensor cores, which alone write 16-bit rows (with `up`).
    #[allow(clippy::too_many_arguments)]
    fn expert_products(
        &self,
        pairs: Pairs,
        (w, stack): (&CudaWeight, ExpertWeights),
        up: Option<ExpertWeights>,
        act: Activation,
        (x, per_token): (Rows, usize),
        out: Rows,
        n_pairs: usize,
        n_experts: usize,
    ) -> Result<()> {
        let suffix = Self::type_suffix(w.ty)?;
        let grouped = matches!(pairs, Pairs::Grouped { .. });
        let (ids, offsets, grid_y) = match pairs {
            Pairs::Each { ids } => (self.ptr(ids), 0, n_pairs),
            Pairs::Grouped { offsets } => (0, self.ptr(offsets), n_experts),
        };
        let (out, out_type) = match out {
            Rows::F32(out) => (out, GgmlType::F32),
            Rows::Sixteen(out, ty) if up.is_some() => (out, ty),
            _ => {
                return Err(Error::Backend(
                    "experts: products write f32 rows, or 16-bit ones with GLU".into(),
                ))
            }
        };
        let on_tensor_cores = match x {
            Rows::Sixteen(_, ty) if grouped && self.gemm_rows(w.ty) == Some(ty) => true,
            Rows::Sixteen(_, ty) => {
                return Err(Error::Backend(format!(
                    "experts: {ty:?} rows for products of {:?} weights",
                    w.ty
                )))
            }
            _ => false,
        };
        if out_type != GgmlType::F32 && !on_tensor_cores {
            return Err(Error::Backend(
                "experts: 16-bit rows out only on the tensor cores".into(),
            ));
        }
        let (name, x, xq, xd) = match (pairs, x, up) {
            (Pairs::Each { .. }, Rows::Int8(q), Some(_)) => (
                kernels::expert_int_glu_kernel(suffix),
                0,
                self.ptr(q.xq),
                self.ptr(q.xd),
            ),
            (_, Rows::Int8(_), _) => {
                return Err(Error::Backend(
                    "experts: int8 rows are for pairs' gate and up products".into(),
                ))
            }
            (_, Rows::F32(x) | Rows::Sixteen(x, _), _) => {
                (kernels::expert_kernel(grouped, up.is_some(), suffix), self.ptr(x), 0, 0)
            }
        };
        let params = ExpertProductParams {
            w: stack,
            up: up.unwrap_or(stack),
            ids,
            offsets,
            x,
            xq,
            xd,
            out: self.ptr(out),
            n_in: w.n_in as i32,
            n_out: w.n_out as i32,
            n_experts: n_experts as i32,
            rows_per_token: per_token as i32,
            act: act.code() as i32,
            out_type: out_type.id() as i32,
        };
        if on_tensor_cores {
            return self.launch_expert_gemm(&params, suffix, up.is_some(), n_pairs);
        }
        let grid_y = u32::try_from(grid_y)
            .ok()
            .filter(|&y| y <= 65535)
            .ok_or_else(|| Error::Backend(format!("experts: a grid of {grid_y} pairs or experts")))?;
        self.launch(&name, (w.n_out.div_ceil(8) as u32, grid_y, 1), 256, &params)
    }

    /// The 16-bit type in which grouped products of `ty` weights take their rows on the tensor
    /// cores (expert_gemm.cu), where the paths put them there: bf16 for bf16 weights, else f16.
    fn gemm_rows(&self, ty: GgmlType) -> Option<GgmlType> {
        self.paths.expert_gemm(ty).then_some(if ty == GgmlType::BF16 {
            GgmlType::BF16
        } else {
            GgmlType::F16
        })
    }

    /// The first of `matrices` and the kernels' view of them all: expert 0's fields and each
    /// field's stride, checked to be one stack of one type and shape (`upload_experts`).
    fn expert_stack<'w>(&self, matrices: &'w [CudaWeight]) -> Result<(&'w CudaWeight, ExpertWeights)> {
        let Some(first) = matrices.first() else {
            return Err(Error::Backend("experts: a mixture of no experts".into()));
        };
        let stride = |field: fn(&CudaWeight) -> Option<BlockHandle>| -> Result<u64> {
            let at = |w: &CudaWeight| field(w).map(|b| b.offset);
            let (Some(start), Some(next)) = (at(first), matrices.get(1).map_or(at(first), at)) else {
                return Ok(0);
            };
            let stride = next.checked_sub(start);
            let stacked = stride.is_some_and(|stride| {
                matrices.iter().enumerate().all(|(e, w)| {
                    (w.ty, w.n_in, w.n_out) == (first.ty, first.n_in, first.n_out) && at(w) == Some(start + e * stride)
                })
            });
            let (true, Some(stride)) = (stacked, stride) else {
                return Err(Error::Backend(
                    "experts: the matrices are not one stack of one type (upload them with upload_experts)".into(),
                ));
            };
            Ok(stride as u64)
        };
        let (q, s, m) = self.weight_ptrs(first);
        Ok((
            first,
            ExpertWeights {
                q,
                s,
                m,
                q_stride: stride(|w| Some(w.q))?,
                s_stride: stride(|w| w.s)?,
                m_stride: stride(|w| w.m)?,
            },
        ))
    }

    /// `Kernels::add_gated`.
    pub(super) fn launch_add_gated(
        &self,
        x: BlockHandle,
        rows: BlockHandle,
        gates: BlockHandle,
        n_tokens: usize,
        width: usize,
    ) -> Result<()> {
        let n = n_tokens * width;
        self.launch(
            "add_gated",
            (blocks_for(n, 256).min(4096), 1, 1),
            256,
            &AddGatedParams {
                x: self.ptr(x),
                rows: self.ptr(rows),
                gates: self.ptr(gates),
                n: n as u64,
                width: width as u64,
            },
        )
    }
}
