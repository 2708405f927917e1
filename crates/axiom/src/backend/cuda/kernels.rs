//! Every kernel source, compiled exactly once at startup by NVRTC for the device's own
//! architecture. The compiled module is cached on disk, keyed by the sources, the architecture
//! and the NVRTC and driver versions, so a warm start does not compile.

use super::params::{self, KernelParams};
use crate::backend::GPU_WEIGHT_TYPES;
use crate::format::quant::GgmlType;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::Arc;

/// The sources: a header shared by all, then one file per op.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("dequant.cuh", include_str!("kernels/dequant.cuh")),
    ("params.cuh", include_str!("kernels/params.cuh")),
    ("embed.cu", include_str!("kernels/embed.cu")),
    ("rms_norm.cu", include_str!("kernels/rms_norm.cu")),
    ("rope.cu", include_str!("kernels/rope.cu")),
    ("matmul.cu", include_str!("kernels/matmul.cu")),
    ("kv_write.cu", include_str!("kernels/kv_write.cu")),
    ("rope_kv_write.cu", include_str!("kernels/rope_kv_write.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("flash_attention.cu", include_str!("kernels/flash_attention.cu")),
    ("flash_attention_wg.cu", include_str!("kernels/flash_attention_wg.cu")),
    ("flash_decode.cu", include_str!("kernels/flash_decode.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("argmax.cu", include_str!("kernels/argmax.cu")),
    ("experts.cu", include_str!("kernels/experts.cu")),
    ("expert_gemm.cu", include_str!("kernels/expert_gemm.cu")),
    ("fp8_gemm.cu", include_str!("kernels/fp8_gemm.cu")),
];

/// All sources as one translation unit (NVRTC compiles them together, once).
pub fn program_source() -> String {
    SOURCES
        .iter()
        .map(|(name, src)| format!("// ---- {name}\n{src}\n"))
        .collect()
}

/// Compiles the kernels for `arch` (e.g. "sm_90a") to a cubin. Needs only NVRTC, not a GPU.
pub fn compile(arch: &str) -> Result<Vec<u8>> {
    // SAFETY: only probes for the shared library.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(Error::Backend("NVRTC (libnvrtc.so) is not installed".into()));
    }
    let err = |what: &str, e: &dyn std::fmt::Debug| Error::Backend(format!("NVRTC {what}: {e:?}"));
    let src = CString::new(program_source()).map_err(|e| err("source", &e))?;
    let name = c"axiom_kernels.cu".to_owned();
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| err("create", &e))?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-default-device".into(),
        // Optimise on every core: a cold start compiles over a hundred kernels.
        "--split-compile=0".into(),
    ];
    // SAFETY: `prog` is a live program; the log and cubin buffers are sized by NVRTC's answers.
    unsafe {
        let mut compiled = nvrtc::compile_program(prog, &options);
        if matches!(&compiled, Err(e) if e.0 == nvrtc_sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION) {
            // An older NVRTC has no split compilation.
            options.pop();
            compiled = nvrtc::compile_program(prog, &options);
        }
        if let Err(e) = compiled {
            let log = nvrtc::get_program_log(prog).unwrap_or_default();
            let log = std::ffi::CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            let _ = nvrtc::destroy_program(prog);
            return Err(Error::Backend(format!("NVRTC compilation failed ({e:?}):\n{log}")));
        }
        let mut size = 0usize;
        nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| err("cubin size", &e))?;
        let mut cubin = vec![0u8; size];
        nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _)
            .result()
            .map_err(|e| err("cubin", &e))?;
        let _ = nvrtc::destroy_program(prog);
        Ok(cubin)
    }
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain query into locals.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// The compiled module and its functions, looked up by name once.
pub struct Kernels {
    _module: Arc<CudaModule>,
    /// Each kernel, and the name of the parameter struct it takes.
    functions: HashMap<String, (CudaFunction, &'static str)>,
}

/// The matrix-vector kernel for `tokens` tokens of weights with kernel suffix `ty`: on int8
/// activations or f32 ones, computing products or (`glu`) silu(gate) * up (kernels/matmul.cu).
pub fn gemv_kernel(int8: bool, glu: bool, ty: &str, tokens: usize) -> String {
    let kind = if int8 { "gemv_int" } else { "gemv" };
    let glu = if glu { "_glu" } else { "" };
    format!("{kind}{glu}_{ty}_{tokens}")
}

/// The expert-product kernel for weights with kernel suffix `ty` (kernels/experts.cu): per (token,
/// expert) pair or (`grouped`) per expert over its grouped pairs, computing products or (`glu`)
/// act(gate) * up.
pub fn expert_kernel(grouped: bool, glu: bool, ty: &str) -> String {
    let kind = if grouped { "expert_groups" } else { "expert_rows" };
    let glu = if glu { "_glu" } else { "" };
    format!("{kind}{glu}_{ty}")
}

/// The grouped expert-product kernel on the tensor cores for weights with kernel suffix `ty`
/// (kernels/expert_gemm.cu), computing products or (`glu`) act(gate) * up.
pub fn expert_gemm_kernel(glu: bool, ty: &str) -> String {
    let glu = if glu { "_glu" } else { "" };
    format!("expert_gemm{glu}_{ty}")
}

/// The gate-and-up expert kernel per (token, expert) pair on int8 activations, for quantized
/// weights with kernel suffix `ty` (expert_rows_int_glu in kernels/experts.cu).
pub fn expert_int_glu_kernel(ty: &str) -> String {
    format!("expert_rows_int_glu_{ty}")
}

/// The kernel of a few tokens' down products fused with their weighted sum, for weights with
/// kernel suffix `ty`: on int8 activations (quantized weights only) or f32 ones
/// (expert_down_sum in kernels/experts.cu).
pub fn expert_down_sum_kernel(int8: bool, ty: &str) -> String {
    let int8 = if int8 { "_int" } else { "" };
    format!("expert_down_sum{int8}_{ty}")
}

/// Whether weights of type `ty` have grouped expert kernels on the tensor cores
/// (kernels/expert_gemm.cu): every type but f32, which the tensor cores do not take, and FP8,
/// whose codes are not `int_chunk`'s.
pub fn has_expert_gemm(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::Fp8)
}

/// Q4_K's fused down products and sum on int8 activations for experts of narrow rows (at most
/// `Q4K_NARROW_IN` values), four rows a warp.
pub const EXPERT_DOWN_SUM_NARROW_Q4K: &str = "expert_down_sum_int_narrow_q4_k";

/// The widest expert rows `EXPERT_DOWN_SUM_NARROW_Q4K` takes (as Q4K_NARROW_IN in
/// kernels/experts.cu): one stage of its four rows.
pub const Q4K_NARROW_IN: usize = 1024;

/// Whether weights of type `ty` have matrix-vector kernels on int8 activations: the GGUF block
/// types'. FP8 codes have no integer form that keeps them exact, and a byte a weight streams at the
/// memory's limit on f32 activations.
pub fn has_int8_kernels(ty: GgmlType) -> bool {
    ty.block_len() > 1 && ty != GgmlType::Fp8
}

/// The matrix-vector kernel of FP8 weights on the tensor cores (fp8_mma_tile in
/// kernels/matmul.cu) for `tokens` tokens, or (`normed`) one token that it RMS-normalizes first.
pub fn gemv_fp8_mma_kernel(glu: bool, normed: bool, tokens: usize) -> String {
    let kind = if glu { "gemv_glu" } else { "gemv" };
    match normed {
        true => format!("{kind}_normed_mma_fp8"),
        false => format!("{kind}_mma_fp8_{tokens}"),
    }
}

/// Output rows a block of `gemv_fp8_mma_kernel`'s takes (FP8_MMA_ROWS in kernels/matmul.cu); with
/// SwiGLU, half as many rows of each of gate and up.
pub const FP8_MMA_ROWS: usize = 16;

/// The one-token f32-activation matrix-vector kernel that RMS-normalizes its input first.
pub fn gemv_normed_kernel(glu: bool, ty: &str) -> String {
    let glu = if glu { "_glu" } else { "" };
    format!("gemv{glu}_normed_{ty}")
}

/// The longest input `gemv_normed_kernel`'s kernels take (NORMED_MAX_IN in kernels/matmul.cu).
pub const GEMV_NORMED_MAX_IN: usize = 8192;

/// Flash attention for heads of `head_dim` in blocks of `groups` groups of 64 query rows: on the
/// warpgroup MMAs (kernels/flash_attention_wg.cu) or on mma.sync (kernels/flash_attention.cu).
pub fn flash_attention_kernel(head_dim: usize, groups: usize, warpgroups: bool) -> String {
    let kind = if warpgroups {
        "flash_attention_wg"
    } else {
        "flash_attention"
    };
    format!("{kind}_{head_dim}_{groups}")
}

/// The flash-attention kernel for steps of one-token query tiles, heads of `head_dim`
/// (flash_decode.cu).
pub fn flash_decode_kernel(head_dim: usize) -> String {
    format!("flash_decode_{head_dim}")
}

/// Whether the kernels compiled for `arch` include those on Hopper's warpgroup MMAs.
pub fn has_warpgroup_mma(arch: &str) -> bool {
    arch == "sm_90a"
}

/// Whether the kernels compiled for `arch` include the activations' quantization for cuBLASLt's
/// FP8 GEMM (kernels/fp8_gemm.cu): Hopper's, the architecture whose cuBLASLt takes 128-value and
/// 128 x 128 block scales.
pub fn has_fp8_gemm(arch: &str) -> bool {
    arch == "sm_90a"
}

/// The flash-attention kernels compiled for `arch`, by whether they run on the warpgroup MMAs.
pub fn flash_attention_kinds(arch: &str) -> &'static [bool] {
    if has_warpgroup_mma(arch) {
        &[false, true]
    } else {
        &[false]
    }
}

/// Every kernel the backend launches on a device of `arch`.
pub fn kernel_names(arch: &str) -> Vec<String> {
    let mut names: Vec<String> = [
        "rms_norm",
        "rms_norm_pair",
        "rms_norm_q8",
        "rms_norm_q8_1",
        "rms_norm_q8_rows",
        "rms_norm_16",
        "rope",
        "kv_write_f16",
        "kv_write_f32",
        "rope_kv_write_f16",
        "rope_kv_write_f32",
        "attention_f16",
        "attention_f32",
        "glu",
        "glu_16",
        "scale",
        "softcap",
        "add",
        "add_bias",
        "convert_f32",
        "argmax",
        "quantize_q8",
        "route",
        "router_route_f32",
        "router_route_f16",
        "router_route_bf16",
        "group_pairs_count",
        "group_pairs_scan",
        "group_pairs_place",
        "gather_pairs",
        "experts_sum",
        "add_gated",
    ]
    .iter()
    .map(|n| n.to_string())
    .collect();
    let every_type = GPU_WEIGHT_TYPES.map(|(_, suffix)| suffix);
    let suffixes = |keep: fn(GgmlType) -> bool| -> Vec<&str> {
        GPU_WEIGHT_TYPES
            .iter()
            .filter(|(ty, _)| keep(*ty))
            .map(|(_, suffix)| *suffix)
            .collect()
    };
    let (quantized, integer) = (suffixes(|ty| ty.block_len() > 1), suffixes(has_int8_kernels));
    let gemm_types = suffixes(has_expert_gemm);
    names.extend(every_type.iter().map(|ty| format!("embed_{ty}")));
    for glu in [false, true] {
        names.extend(every_type.iter().map(|ty| gemv_normed_kernel(glu, ty)));
    }
    for tokens in [1, 2, 4, 8] {
        for glu in [false, true] {
            names.extend(every_type.iter().map(|ty| gemv_kernel(false, glu, ty, tokens)));
            names.extend(integer.iter().map(|ty| gemv_kernel(true, glu, ty, tokens)));
        }
    }
    for glu in [false, true] {
        names.push(gemv_fp8_mma_kernel(glu, true, 1));
        names.extend([1, 2, 4, 8].map(|tokens| gemv_fp8_mma_kernel(glu, false, tokens)));
    }
    names.extend(quantized.iter().map(|ty| format!("dequant_f16_{ty}")));
    for (grouped, glu) in [(false, false), (false, true), (true, false), (true, true)] {
        names.extend(every_type.iter().map(|ty| expert_kernel(grouped, glu, ty)));
    }
    for glu in [false, true] {
        names.extend(gemm_types.iter().map(|ty| expert_gemm_kernel(glu, ty)));
    }
    names.extend(integer.iter().map(|ty| expert_int_glu_kernel(ty)));
    names.extend(every_type.iter().map(|ty| expert_down_sum_kernel(false, ty)));
    names.extend(integer.iter().map(|ty| expert_down_sum_kernel(true, ty)));
    names.push(EXPERT_DOWN_SUM_NARROW_Q4K.to_string());
    if has_fp8_gemm(arch) {
        names.extend(["quantize_fp8", "quantize_fp8_glu", "rms_norm_16_fp8"].map(String::from));
    }
    for head_dim in [64, 128] {
        for &warpgroups in flash_attention_kinds(arch) {
            names.extend([1, 2].map(|groups| flash_attention_kernel(head_dim, groups, warpgroups)));
        }
        names.push(flash_decode_kernel(head_dim));
    }
    names
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &str, driver_version: i32) -> Result<Kernels> {
        let mut key = Sha256::new();
        key.update(program_source());
        key.update(format!("{arch} nvrtc {:?} driver {driver_version}", nvrtc_version()));
        let key: String = key.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
        let cache = crate::cache::dir()
            .ok()
            .map(|d| d.join("cuda").join(format!("kernels-{arch}-{key}.cubin")));
        let cached = cache.as_ref().and_then(|p| std::fs::read(p).ok());
        let cubin = match cached {
            Some(c) => c,
            None => {
                let cubin = compile(arch)?;
                if let Some(path) = &cache {
                    // Best effort, and atomic: a partial file is never read back.
                    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
                    let written = path.parent().is_some_and(|dir| std::fs::create_dir_all(dir).is_ok())
                        && std::fs::write(&tmp, &cubin).is_ok();
                    if written {
                        let _ = std::fs::rename(&tmp, path);
                    }
                }
                cubin
            }
        };
        let module = ctx
            .load_module(Ptx::from_binary(cubin))
            .map_err(|e| Error::Backend(format!("loading the CUDA kernels: {e}")))?;
        let mut functions = HashMap::new();
        for name in kernel_names(arch) {
            let f = module
                .load_function(&name)
                .map_err(|e| Error::Backend(format!("kernel {name}: {e}")))?;
            let (params, _) = params::kernel_params_of(&name)
                .ok_or_else(|| Error::Backend(format!("kernel {name} has no parameter struct")))?;
            functions.insert(name, (f, params));
        }
        Ok(Kernels {
            _module: module,
            functions,
        })
    }

    pub fn get(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .map(|(f, _)| f)
            .ok_or_else(|| Error::Backend(format!("no kernel named {name}")))
    }

    /// Kernel `name`, to be launched on a `P`: refused if it takes another struct, whose bytes it
    /// would misread.
    pub(super) fn launchable<P: KernelParams>(&self, name: &str) -> Result<&CudaFunction> {
        match self.functions.get(name) {
            Some((f, params)) if *params == P::NAME => Ok(f),
            Some((_, params)) => Err(Error::Backend(format!(
                "kernel {name} takes {params}, launched with {}",
                P::NAME
            ))),
            None => Err(Error::Backend(format!("no kernel named {name}"))),
        }
    }
}
