//! The expert op of the fast backend: a step's (token, expert) pairs grouped by expert, so that
//! each chosen expert's matrices are read once for all its tokens, through the same integer and
//! float matmuls as the dense layers (repacked weights included).

use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::CpuWeight;
use crate::backend::{Backend, Input};
use crate::backend::{BlockHandle, ExpertScratch, ExpertSet, Kernels};
use crate::Result;

/// The pairs of `ids` (`[n_tokens, k]`, flattened) ordered by expert, stable (tokens in order
/// within an expert), and where each expert's run starts: `starts[e]..starts[e + 1]`.
pub fn group_by_expert(ids: &[u32], n_experts: usize) -> (Vec<usize>, Vec<usize>) {
    let mut starts = vec![0usize; n_experts + 1];
    for &e in ids {
        starts[e as usize + 1] += 1;
    }
    for e in 0..n_experts {
        starts[e + 1] += starts[e];
    }
    let mut next = starts.clone();
    let mut order = vec![0usize; ids.len()];
    for (pair, &e) in ids.iter().enumerate() {
        order[next[e as usize]] = pair;
        next[e as usize] += 1;
    }
    (order, starts)
}

impl CpuBackend {
    /// `Kernels::experts` by expert: the rows of each expert's tokens gathered into
    /// `scratch.rows`, its feed-forward block run over them at once into `scratch.out`, then each
    /// row added to its token's residual, weighed. `ids` are checked to be in range.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn experts_grouped(
        &self,
        x: BlockHandle,
        set: ExpertSet<'_, CpuWeight>,
        ids: &[u32],
        weights: &[f32],
        scratch: ExpertScratch,
        residual: BlockHandle,
        n_tokens: usize,
        (dim, width): (usize, usize),
    ) -> Result<()> {
        let k = ids.len() / n_tokens.max(1);
        let (order, starts) = group_by_expert(ids, set.n_experts());
        {
            let xs = self.view::<f32>(x, n_tokens * dim);
            let rows = self.view_mut::<f32>(scratch.rows, ids.len() * dim);
            for (r, &pair) in order.iter().enumerate() {
                let t = pair / k;
                rows[r * dim..(r + 1) * dim].copy_from_slice(&xs[t * dim..(t + 1) * dim]);
            }
        }
        let rows_of = |block: BlockHandle, first: usize, n: usize, w: usize| block.slice(first * w * 4, n * w * 4);
        for e in 0..set.n_experts() {
            let (first, n) = (starts[e], starts[e + 1] - starts[e]);
            if n == 0 {
                continue;
            }
            let (gate, up, hidden) = (
                rows_of(scratch.gate, first, n, width),
                rows_of(scratch.up, first, n, width),
                rows_of(scratch.hidden, first, n, width),
            );
            let input = Input::Rows(rows_of(scratch.rows, first, n, dim));
            self.matmul_many(input, &[&set.gate[e], &set.up[e]], &[gate, up], n)?;
            self.glu(gate, up, hidden, n * width, set.activation)?;
            self.matmul(hidden, &set.down[e], rows_of(scratch.out, first, n, dim), n)?;
        }
        let out = self.view::<f32>(scratch.out, ids.len() * dim);
        let res = self.view_mut::<f32>(residual, n_tokens * dim);
        for (r, &pair) in order.iter().enumerate() {
            let (t, w) = (pair / k, weights[pair]);
            for (o, &v) in res[t * dim..(t + 1) * dim].iter_mut().zip(&out[r * dim..(r + 1) * dim]) {
                *o += w * v;
            }
        }
        Ok(())
    }
}
