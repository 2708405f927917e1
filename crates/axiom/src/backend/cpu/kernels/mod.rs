//! The CPU reference kernels: plain f32 loops over slices, one op per file, named like their
//! CUDA and Metal twins. They define what every other backend must compute.

pub mod add;
pub mod argmax;
pub mod attention;
pub mod embed;
pub mod experts;
pub mod glu;
pub mod kv_write;
pub mod matmul;
pub mod paged;
pub mod rms_norm;
pub mod rope;
pub mod route;
pub mod scale;

/// Dot product with several accumulators so the compiler can vectorise it.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 16];
    let (a16, b16) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = a16.remainder().iter().zip(b16.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a16.zip(b16) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}
