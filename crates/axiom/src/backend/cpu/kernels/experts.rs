use super::glu::glu;
use super::matmul::matmul_rows;
use crate::backend::Activation;
use crate::format::quant::GgmlType;

/// One expert matrix `[n_out, n_in]` as stored.
#[derive(Debug, Clone, Copy)]
pub struct ExpertMatrix<'a> {
    pub ty: GgmlType,
    pub bytes: &'a [u8],
    pub n_in: usize,
    pub n_out: usize,
}

/// One expert's gated feed-forward block.
#[derive(Debug, Clone, Copy)]
pub struct Expert<'a> {
    pub gate: ExpertMatrix<'a>,
    pub up: ExpertMatrix<'a>,
    pub down: ExpertMatrix<'a>,
}

/// `residual[t] += sum_j weights[t, j] * down(act(gate x[t]) * up x[t])` of expert
/// `experts[ids[t, j]]`, token by token, expert by expert (`k` per token); `ids` are in range.
pub fn experts(
    x: &[f32],
    experts: &[Expert],
    ids: &[u32],
    weights: &[f32],
    k: usize,
    act: Activation,
    residual: &mut [f32],
) {
    let Some(first) = experts.first() else { return };
    let (dim, width) = (first.gate.n_in, first.gate.n_out);
    let (mut g, mut u, mut h, mut d) = (vec![0f32; width], vec![0f32; width], vec![0f32; width], vec![0f32; dim]);
    let product = |m: &ExpertMatrix, x: &[f32], out: &mut [f32]| matmul_rows(m.ty, m.bytes, m.n_in, 0..m.n_out, x, out);
    for (t, (xt, out)) in x.chunks_exact(dim).zip(residual.chunks_exact_mut(dim)).enumerate() {
        for j in 0..k {
            let e = &experts[ids[t * k + j] as usize];
            product(&e.gate, xt, &mut g);
            product(&e.up, xt, &mut u);
            glu(&g, &u, &mut h, act);
            product(&e.down, &h, &mut d);
            let w = weights[t * k + j];
            for (o, &v) in out.iter_mut().zip(&d) {
                *o += w * v;
            }
        }
    }
}
