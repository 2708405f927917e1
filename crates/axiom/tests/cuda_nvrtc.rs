//! Every CUDA kernel compiles with NVRTC. Needs only libnvrtc (the `nvidia-cuda-nvrtc` PyPI
//! package; `scripts/test.sh` puts it on the library path), not a GPU, so it runs in CI.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

#[test]
fn nvrtc_compiles_every_kernel_for_hopper_and_ampere() {
    for arch in ["sm_90a", "sm_80"] {
        let cubin = axiom::backend::cuda::kernels::compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        // An ELF image with our kernels in it.
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}");
        // Every kernel the backend loads at start-up is in it.
        for name in axiom::backend::cuda::kernels::kernel_names(arch) {
            assert!(
                cubin.windows(name.len()).any(|w| w == name.as_bytes()),
                "{arch}: no {name}"
            );
        }
    }
}
