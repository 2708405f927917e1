/// Copies the K and V rows of each token into row `positions[t]` of the caches.
pub fn kv_write(k: &[f32], v: &[f32], k_cache: &mut [f32], v_cache: &mut [f32], positions: &[u32], kv_width: usize) {
    for (t, &pos) in positions.iter().enumerate() {
        let (src, dst) = (t * kv_width, pos as usize * kv_width);
        k_cache[dst..dst + kv_width].copy_from_slice(&k[src..src + kv_width]);
        v_cache[dst..dst + kv_width].copy_from_slice(&v[src..src + kv_width]);
    }
}
