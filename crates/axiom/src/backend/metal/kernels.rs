//! Every kernel, compiled exactly once at startup from source (`newLibraryWithSource`), each
//! function made into a pipeline then. A kernel's threadgroup size comes from its pipeline
//! (`threadExecutionWidth`, `maxTotalThreadsPerThreadgroup`), never a guess.

use super::device::MetalDevice;
use super::{MetalError, FLASH_HEAD_CLASSES};
use crate::backend::GPU_WEIGHT_TYPES;
use objc2::rc::{autoreleasepool, Retained};
use objc2::runtime::ProtocolObject;
use objc2_foundation::NSString;
use objc2_metal::{MTLComputePipelineState, MTLDevice, MTLLibrary};
use std::collections::HashMap;

/// The sources: helpers and weight formats shared by all, then one file per op.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.metal", include_str!("kernels/common.metal")),
    ("argmax.metal", include_str!("kernels/argmax.metal")),
    ("attention.metal", include_str!("kernels/attention.metal")),
    ("attention_pv.metal", include_str!("kernels/attention_pv.metal")),
    ("attention_qk.metal", include_str!("kernels/attention_qk.metal")),
    ("elementwise.metal", include_str!("kernels/elementwise.metal")),
    ("embed.metal", include_str!("kernels/embed.metal")),
    ("experts.metal", include_str!("kernels/experts.metal")),
    ("flash_attention.metal", include_str!("kernels/flash_attention.metal")),
    ("kv_write.metal", include_str!("kernels/kv_write.metal")),
    ("matmul.metal", include_str!("kernels/matmul.metal")),
    ("matmul_tiled.metal", include_str!("kernels/matmul_tiled.metal")),
    ("rms_norm.metal", include_str!("kernels/rms_norm.metal")),
    ("rope.metal", include_str!("kernels/rope.metal")),
    ("route.metal", include_str!("kernels/route.metal")),
    ("rope_kv_write.metal", include_str!("kernels/rope_kv_write.metal")),
];

/// Every kernel function in the sources.
fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = [
        "rms_norm",
        "rope",
        "glu",
        "scale",
        "softcap",
        "add",
        "add_bias",
        "argmax",
        "add_gated",
        "route",
        "experts_sum",
    ]
    .iter()
    .map(|n| n.to_string())
    .collect();
    for prefix in [
        "matmul",
        "matmul_glu",
        "matmul_tiled",
        "matmul_experts",
        "matmul_glu_experts",
        "embed",
    ] {
        names.extend(GPU_WEIGHT_TYPES.map(|(_, s)| format!("{prefix}_{s}")));
    }
    for kv in ["f16", "f32"] {
        for prefix in ["kv_write", "rope_kv_write", "attention", "attention_qk", "attention_pv"] {
            names.push(format!("{prefix}_{kv}"));
        }
        names.extend(FLASH_HEAD_CLASSES.iter().map(|c| format!("flash_attention_{kv}_{c}")));
    }
    names
}

/// A compiled kernel and the threadgroup limits of its pipeline.
pub struct Kernel {
    pub pipeline: Retained<ProtocolObject<dyn MTLComputePipelineState>>,
    /// Threads that run in lockstep (a simdgroup): 32 on Apple GPUs.
    pub simd_width: usize,
    pub max_threads: usize,
}

pub struct MetalKernels {
    kernels: HashMap<String, Kernel>,
}

impl MetalKernels {
    pub fn new(device: &MetalDevice) -> Result<MetalKernels, MetalError> {
        autoreleasepool(|_| {
            let source: String = SOURCES
                .iter()
                .map(|(name, src)| format!("// ---- {name}\n{src}\n"))
                .collect();
            let library = device
                .raw()
                .newLibraryWithSource_options_error(&NSString::from_str(&source), None)
                .map_err(|e| MetalError::LibraryCompilation(e.localizedDescription().to_string()))?;
            let mut kernels = HashMap::new();
            for name in kernel_names() {
                let function = library
                    .newFunctionWithName(&NSString::from_str(&name))
                    .ok_or_else(|| MetalError::MissingFunction(name.clone()))?;
                let pipeline = device
                    .raw()
                    .newComputePipelineStateWithFunction_error(&function)
                    .map_err(|e| MetalError::PipelineCreation {
                        name: name.clone(),
                        message: e.localizedDescription().to_string(),
                    })?;
                let kernel = Kernel {
                    simd_width: pipeline.threadExecutionWidth(),
                    max_threads: pipeline.maxTotalThreadsPerThreadgroup(),
                    pipeline,
                };
                kernels.insert(name, kernel);
            }
            Ok(MetalKernels { kernels })
        })
    }

    pub fn get(&self, name: &str) -> Result<&Kernel, MetalError> {
        self.kernels
            .get(name)
            .ok_or_else(|| MetalError::MissingFunction(name.to_string()))
    }
}
