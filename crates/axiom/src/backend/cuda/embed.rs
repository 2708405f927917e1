//! Token embedding (kernels/embed.cu): table rows gathered by id, dequantized to f32.

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
        let dim = table.n_in as i32;
        self.launch(
            &name,
            (n_tokens as u32, 1, 1),
            128,
            &[&q, &s, &m, &dim, &self.ptr(ids), &self.ptr(out)],
        )
    }
}
