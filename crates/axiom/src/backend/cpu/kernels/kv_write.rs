use super::paged::PageMap;

/// Copies the K and V rows of each token into its sequence's cache row for `positions[t]`.
pub fn kv_write(
    k: &[f32],
    v: &[f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    positions: &[u32],
    pages: &PageMap,
    kv_width: usize,
) {
    for (t, &pos) in positions.iter().enumerate() {
        let (src, dst) = (t * kv_width, pages.row(t, pos as usize) * kv_width);
        k_cache[dst..dst + kv_width].copy_from_slice(&k[src..src + kv_width]);
        v_cache[dst..dst + kv_width].copy_from_slice(&v[src..src + kv_width]);
    }
}
