//! One command queue for the process, and the command buffer being filled.
//!
//! Ops encode into one compute encoder of one command buffer (a serial encoder: each dispatch
//! sees the writes of the ones before it); `synchronize` ends it, commits, waits and reports a
//! failed buffer with its status and error. So a forward pass is one command buffer and one
//! wait, not one per kernel.

use super::device::MetalDevice;
use super::MetalError;
use objc2::rc::{autoreleasepool, Retained};
use objc2::runtime::ProtocolObject;
use objc2_metal::{
    MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder, MTLCommandQueue, MTLComputeCommandEncoder, MTLDevice,
};
use std::cell::RefCell;

type CommandBuffer = Retained<ProtocolObject<dyn MTLCommandBuffer>>;
type ComputeEncoder = Retained<ProtocolObject<dyn MTLComputeCommandEncoder>>;

pub struct MetalContext {
    pub device: MetalDevice,
    queue: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    /// The command buffer ops are encoded into, and its open encoder, until `synchronize`.
    pending: RefCell<Option<(CommandBuffer, ComputeEncoder)>>,
}

impl MetalContext {
    pub fn new(device: MetalDevice) -> Result<MetalContext, MetalError> {
        let queue = device
            .raw()
            .newCommandQueue()
            .ok_or(MetalError::Internal("the device made no command queue"))?;
        Ok(MetalContext {
            device,
            queue,
            pending: RefCell::new(None),
        })
    }

    /// A fresh command buffer from the queue.
    pub fn command_buffer(&self) -> Result<CommandBuffer, MetalError> {
        self.queue
            .commandBuffer()
            .ok_or(MetalError::Internal("the queue made no command buffer"))
    }

    /// Runs `encode` with the open compute encoder, opening a command buffer if none is.
    pub fn encode(&self, encode: impl FnOnce(&ProtocolObject<dyn MTLComputeCommandEncoder>)) -> Result<(), MetalError> {
        let mut pending = self.pending.borrow_mut();
        if pending.is_none() {
            let buffer = self.command_buffer()?;
            let encoder = buffer
                .computeCommandEncoder()
                .ok_or(MetalError::Internal("the command buffer made no compute encoder"))?;
            *pending = Some((buffer, encoder));
        }
        if let Some((_, encoder)) = pending.as_ref() {
            autoreleasepool(|_| encode(encoder));
        }
        Ok(())
    }

    /// Whether ops are encoded but not yet committed.
    pub fn has_pending_work(&self) -> bool {
        self.pending.borrow().is_some()
    }

    /// Commits what was encoded and waits for the GPU to finish it.
    pub fn synchronize(&self) -> Result<(), MetalError> {
        let Some((buffer, encoder)) = self.pending.borrow_mut().take() else {
            return Ok(());
        };
        autoreleasepool(|_| {
            encoder.endEncoding();
            buffer.commit();
            buffer.waitUntilCompleted();
            match buffer.status() {
                MTLCommandBufferStatus::Completed => Ok(()),
                status => Err(MetalError::CommandBuffer {
                    status: status.0 as u64,
                    error: buffer
                        .error()
                        .map_or_else(|| "no error reported".into(), |e| e.localizedDescription().to_string()),
                }),
            }
        })
    }
}

#[cfg(all(test, target_vendor = "apple"))]
mod tests {
    use super::*;

    fn context() -> MetalContext {
        MetalContext::new(MetalDevice::system_default().unwrap()).unwrap()
    }

    #[test]
    fn test_context_creation() {
        let ctx = context();
        println!("context created on: {}", ctx.device.name);
        assert!(!ctx.has_pending_work());
    }

    #[test]
    fn test_command_buffer_creation() {
        let ctx = context();
        let buffer = ctx.command_buffer().unwrap();
        println!("command buffer status: {:?}", buffer.status());
        assert_eq!(buffer.status(), MTLCommandBufferStatus::NotEnqueued);
    }

    #[test]
    fn test_synchronize_empty() {
        context().synchronize().unwrap();
    }

    #[test]
    fn test_synchronize_repeated() {
        let ctx = context();
        for _ in 0..3 {
            ctx.encode(|_| {}).unwrap();
            assert!(ctx.has_pending_work());
            ctx.synchronize().unwrap();
            assert!(!ctx.has_pending_work());
        }
    }
}
