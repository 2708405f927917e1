//! The shapes a mixture-of-experts layer hands its ops: how tokens choose experts ([`Routing`]),
//! where the choice lives on the device ([`Routes`]), the experts' matrices ([`ExpertSet`]) and
//! the rows the expert op may use ([`ExpertScratch`]). The choice never travels to the host: the
//! expert op reads it where `route` left it.

use super::{Activation, BlockHandle, Matrix};

/// How a token chooses its experts from the router's logits: a softmax over all `n_experts`, the
/// `k` most probable (the lowest index first among equals), their probabilities divided by their
/// sum when `renormalize` (Mixtral always, Qwen under `norm_topk_prob`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routing {
    pub n_experts: usize,
    pub k: usize,
    pub renormalize: bool,
}

impl Routing {
    /// Refuses a routing that cannot fill `routes`: `k` of 0, more than the experts, or not
    /// `routes.k`.
    pub fn check(&self, routes: &Routes) -> crate::Result<()> {
        if self.k == 0 || self.k > self.n_experts || routes.k != self.k {
            return Err(crate::Error::Backend(format!(
                "routing to {} of {} experts into routes of {}",
                self.k, self.n_experts, routes.k
            )));
        }
        Ok(())
    }
}

/// Each token's `k` chosen experts: `ids` (u32 `[n_tokens, k]`) and their weights (f32
/// `[n_tokens, k]`), most probable first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routes {
    pub ids: BlockHandle,
    pub weights: BlockHandle,
    pub k: usize,
}

/// The experts of one layer: per expert, the matrices of a gated feed-forward block of one width.
pub struct ExpertSet<'a, W> {
    pub gate: &'a [W],
    pub up: &'a [W],
    pub down: &'a [W],
    pub activation: Activation,
}

// By hand: derived, they would ask for `W: Clone` of weights only ever borrowed.
impl<W> Clone for ExpertSet<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<W> Copy for ExpertSet<'_, W> {}

impl<W: Matrix> ExpertSet<'_, W> {
    pub fn n_experts(&self) -> usize {
        self.gate.len()
    }

    /// `(model width, expert width)`, checked to be one shape for every expert.
    pub fn shape(&self) -> crate::Result<(usize, usize)> {
        let bad = |what: String| crate::Error::Backend(format!("experts: {what}"));
        let (Some(g), n) = (self.gate.first(), self.gate.len()) else {
            return Err(bad("a mixture of no experts".into()));
        };
        let (dim, width) = (g.n_in(), g.n_out());
        if self.up.len() != n || self.down.len() != n {
            return Err(bad(format!(
                "{n} gate, {} up and {} down matrices",
                self.up.len(),
                self.down.len()
            )));
        }
        let fits = |w: &W, n_in: usize, n_out: usize| w.n_in() == n_in && w.n_out() == n_out;
        if !(self.gate.iter().all(|w| fits(w, dim, width))
            && self.up.iter().all(|w| fits(w, dim, width))
            && self.down.iter().all(|w| fits(w, width, dim)))
        {
            return Err(bad(format!("not every expert is {dim} -> {width} -> {dim}")));
        }
        Ok((dim, width))
    }
}

/// Scratch for the expert op over `n_tokens` tokens of `k` experts each: `rows` and `out` hold
/// `n_tokens * k` rows of the model's width, `gate`, `up` and `hidden` as many of the experts'.
/// `groups` holds `groups_len` u32, for a backend that groups the (token, expert) pairs by expert
/// on the device (CUDA): each expert's first slot, then each pair's slot and each slot's pair, then
/// the experts' counts in each chunk of `GROUP_CHUNK` pairs.
#[derive(Debug, Clone, Copy)]
pub struct ExpertScratch {
    pub rows: BlockHandle,
    pub gate: BlockHandle,
    pub up: BlockHandle,
    pub hidden: BlockHandle,
    pub out: BlockHandle,
    pub groups: BlockHandle,
}

impl ExpertScratch {
    /// The pairs a warp of CUDA's `group_pairs_*` kernels counts and places (GROUP_CHUNK in
    /// cuda/kernels/experts.cu).
    pub const GROUP_CHUNK: usize = 512;

    /// The u32 values `groups` must hold for `n_pairs` pairs over `n_experts` experts.
    pub fn groups_len(n_experts: usize, n_pairs: usize) -> usize {
        n_experts + 1 + 2 * n_pairs + n_pairs.div_ceil(Self::GROUP_CHUNK) * n_experts
    }
}
