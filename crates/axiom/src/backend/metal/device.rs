//! The physical GPU: the system's default Metal device and what it can hold.

use super::MetalError;
use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2_metal::{MTLCreateSystemDefaultDevice, MTLDevice};

pub struct MetalDevice {
    raw: Retained<ProtocolObject<dyn MTLDevice>>,
    pub name: String,
    /// Apple Silicon: CPU and GPU share one memory, so a shared buffer needs no copies.
    pub unified_memory: bool,
    /// How much memory the GPU can use without hurting performance, in bytes.
    pub max_working_set: u64,
    /// The largest single buffer the device allocates, in bytes.
    pub max_buffer_length: usize,
}

impl MetalDevice {
    pub fn system_default() -> Result<MetalDevice, MetalError> {
        let raw = MTLCreateSystemDefaultDevice().ok_or(MetalError::NoDevice)?;
        Ok(MetalDevice {
            name: raw.name().to_string(),
            unified_memory: raw.hasUnifiedMemory(),
            max_working_set: raw.recommendedMaxWorkingSetSize(),
            max_buffer_length: raw.maxBufferLength(),
            raw,
        })
    }

    pub fn raw(&self) -> &ProtocolObject<dyn MTLDevice> {
        &self.raw
    }
}

#[cfg(all(test, target_vendor = "apple"))]
mod tests {
    use super::*;

    #[test]
    fn test_device_acquisition() {
        let device = MetalDevice::system_default().unwrap();
        println!("Metal device: {}", device.name);
        println!("Unified memory: {}", device.unified_memory);
        println!("Max working set: {} MB", device.max_working_set >> 20);
        assert!(!device.name.is_empty());
        assert!(device.max_buffer_length > 0);
    }
}
