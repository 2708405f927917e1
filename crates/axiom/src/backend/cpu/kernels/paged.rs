//! Addressing of the paged KV cache (see [`crate::backend::PagedKv`]), on host slices.

use crate::{Error, Result};

/// The block tables of a step, checked once so that every lookup after is in bounds.
pub struct PageMap<'a> {
    tables: &'a [u32],
    width: usize,
    token_seqs: &'a [u32],
    page_size: usize,
}

impl<'a> PageMap<'a> {
    /// Checks that every token names a table row, that its position fits the row, and that
    /// every page it can read (`0..=position`) is one of the cache's `n_pages`.
    pub fn new(
        tables: &'a [u32],
        width: usize,
        token_seqs: &'a [u32],
        page_size: usize,
        positions: &[u32],
        n_pages: usize,
    ) -> Result<PageMap<'a>> {
        if width == 0 || page_size == 0 {
            return Err(Error::Backend("a paged KV cache needs pages and table columns".into()));
        }
        let n_seqs = tables.len() / width;
        for (t, (&seq, &pos)) in token_seqs.iter().zip(positions).enumerate() {
            let bad = |what: String| Err(Error::Backend(format!("token {t}: {what}")));
            if seq as usize >= n_seqs {
                return bad(format!("sequence {seq} has no block table (there are {n_seqs})"));
            }
            let used = pos as usize / page_size + 1;
            if used > width {
                return bad(format!(
                    "position {pos} is beyond a table of {width} pages of {page_size}"
                ));
            }
            let table = &tables[seq as usize * width..][..used];
            if let Some(page) = table.iter().find(|&&p| p as usize >= n_pages) {
                return bad(format!("page {page} is beyond the cache's {n_pages}"));
            }
        }
        Ok(PageMap {
            tables,
            width,
            token_seqs,
            page_size,
        })
    }

    /// The pages token `t`'s sequence owns, in position order.
    pub fn table(&self, t: usize) -> &'a [u32] {
        &self.tables[self.token_seqs[t] as usize * self.width..][..self.width]
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The cache row holding position `pos` of token `t`'s sequence.
    pub fn row(&self, t: usize, pos: usize) -> usize {
        cache_row(self.table(t), self.page_size, pos)
    }
}

/// The cache row holding position `pos` of a sequence whose pages are `table`.
#[inline(always)]
pub fn cache_row(table: &[u32], page_size: usize, pos: usize) -> usize {
    table[pos / page_size] as usize * page_size + pos % page_size
}
