//! Token embedding (kernels/embed.cu): table rows gathered by id, dequantized to f32.

use super::params::EmbedParams;
use super::weights::CudaWeight;
use super::CudaBackend;
use crate::backend::BlockHandle;
use crate::Result;

impl CudaBackend {
    /// `Kernels::embed`.
    pub(super) fn launch_embed(
        &self,
        table: &CudaWeight,
        ids: BlockHandle,
        out: BlockHandle,
        n_tokens: usize,
    ) -> Result<()> {
        let name = format!("embed_{}", Self::type_suffix(table.ty)?);
        let (q, s, m) = self.weight_ptrs(table);
        self.launch(
            &name,
            (n_tokens as u32, 1, 1),
            128,
            &EmbedParams {
                q,
                s,
                m,
                n_in: table.n_in as i32,
                ids: self.ptr(ids),
                out: self.ptr(out),
            },
        )
    }
}
