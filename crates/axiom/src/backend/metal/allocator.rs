//! One large shared MTLBuffer reserved up front, handed out in blocks by the arena every backend
//! shares ([`Arena`]). Shared storage on unified memory: the CPU reads and writes a block through
//! the same memory the GPU uses, so there are no copies, only synchronisation.

use super::context::MetalContext;
use super::MetalError;
use crate::backend::{Arena, ArenaError, BlockHandle};
use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2_metal::{MTLBuffer, MTLDevice, MTLResourceOptions};
use std::ptr::NonNull;

pub struct MetalAllocator {
    buffer: Retained<ProtocolObject<dyn MTLBuffer>>,
    base: NonNull<u8>,
    arena: Arena,
}

impl MetalAllocator {
    pub fn new(ctx: &MetalContext, bytes: usize) -> Result<MetalAllocator, MetalError> {
        let max = ctx.device.max_buffer_length;
        if bytes > max {
            return Err(MetalError::BufferTooLarge { bytes, max });
        }
        let buffer = ctx
            .device
            .raw()
            .newBufferWithLength_options(bytes.max(1), MTLResourceOptions::StorageModeShared)
            .ok_or(MetalError::BufferTooLarge { bytes, max })?;
        let base = buffer.contents().cast::<u8>();
        Ok(MetalAllocator {
            buffer,
            base,
            arena: Arena::new(bytes),
        })
    }

    /// A block of `bytes` aligned to `align` (a power of two).
    pub fn alloc(&mut self, bytes: usize, align: usize) -> Result<BlockHandle, ArenaError> {
        self.arena.alloc(bytes, align)
    }

    pub fn free(&mut self, block: BlockHandle) -> Result<(), ArenaError> {
        self.arena.free(block)
    }

    /// Where `block` is in the CPU's view of the buffer.
    pub fn ptr(&self, block: BlockHandle) -> *mut u8 {
        assert!(
            block.end() <= self.arena.capacity(),
            "block {block:?} outside the buffer"
        );
        // SAFETY: in bounds of the buffer, checked above.
        unsafe { self.base.as_ptr().add(block.offset) }
    }

    pub fn buffer(&self) -> &ProtocolObject<dyn MTLBuffer> {
        &self.buffer
    }
}

#[cfg(all(test, target_vendor = "apple"))]
mod tests {
    use super::*;
    use crate::backend::metal::device::MetalDevice;

    fn setup(bytes: usize) -> (MetalContext, MetalAllocator) {
        let ctx = MetalContext::new(MetalDevice::system_default().unwrap()).unwrap();
        let alloc = MetalAllocator::new(&ctx, bytes).unwrap();
        (ctx, alloc)
    }

    #[test]
    fn test_basic_alloc() {
        let (_ctx, mut a) = setup(16 << 20);
        let x = a.alloc(1000, 16).unwrap();
        let y = a.alloc(1000, 16).unwrap();
        assert!(!x.overlaps(&y));
    }

    #[test]
    fn test_exhaustion() {
        let (_ctx, mut a) = setup(4096);
        a.alloc(4000, 16).unwrap();
        assert!(matches!(a.alloc(200, 16), Err(ArenaError::Exhausted { .. })));
    }

    #[test]
    fn test_alignment_padding() {
        let (_ctx, mut a) = setup(4096);
        a.alloc(3, 1).unwrap();
        let b = a.alloc(8, 256).unwrap();
        assert_eq!(b.offset % 256, 0);
        assert_eq!(
            a.ptr(b) as usize % 256,
            a.ptr(BlockHandle { offset: 0, len: 0 }) as usize % 256
        );
    }

    #[test]
    fn test_cpu_write_read() {
        let (_ctx, mut a) = setup(4096);
        let b = a.alloc(64 * 4, 16).unwrap();
        let p = a.ptr(b).cast::<f32>();
        // SAFETY: the block holds 64 f32s of the shared buffer.
        unsafe {
            for i in 0..64 {
                p.add(i).write(i as f32 * 0.5);
            }
            for i in 0..64 {
                assert_eq!(p.add(i).read(), i as f32 * 0.5);
            }
        }
    }

    #[test]
    fn test_cursor_reclaim() {
        let (_ctx, mut a) = setup(4096);
        let x = a.alloc(2000, 16).unwrap();
        let y = a.alloc(2000, 16).unwrap();
        a.free(y).unwrap();
        a.free(x).unwrap();
        a.alloc(4000, 16).unwrap();
    }

    #[test]
    fn test_free_reuse() {
        let (_ctx, mut a) = setup(4096);
        let x = a.alloc(1000, 64).unwrap();
        let _y = a.alloc(1000, 64).unwrap();
        a.free(x).unwrap();
        assert_eq!(a.alloc(1000, 64).unwrap().offset, x.offset);
    }
}
