//! The block allocator every backend shares: one large region reserved up front (a host
//! allocation, a CUDA device allocation or a Metal shared buffer), sub-regions handed out as
//! [`BlockHandle`]s. It only does offset arithmetic; the backend owns the memory itself.
//!
//! Allocation is first-fit over a sorted free list, then a bump cursor. Freed blocks are merged
//! with their neighbours, and a free block that ends at the cursor gives its space back to it.

/// A sub-region of a backend's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHandle {
    /// Byte offset from the start of the arena.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl BlockHandle {
    pub fn end(&self) -> usize {
        self.offset + self.len
    }

    /// A view of `len` bytes starting `start` bytes into this block.
    pub fn slice(&self, start: usize, len: usize) -> BlockHandle {
        assert!(
            start + len <= self.len,
            "slice [{start}, {}) outside a block of {} bytes",
            start + len,
            self.len
        );
        BlockHandle {
            offset: self.offset + start,
            len,
        }
    }

    pub fn overlaps(&self, other: &BlockHandle) -> bool {
        self.offset < other.end() && other.offset < self.end() && self.len > 0 && other.len > 0
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArenaError {
    #[error("arena exhausted: {requested} bytes requested, {available} of {capacity} free at the cursor")]
    Exhausted {
        requested: usize,
        available: usize,
        capacity: usize,
    },
    #[error("alignment {0} is not a power of two")]
    BadAlignment(usize),
    #[error("block at offset {offset} ({len} bytes) was not allocated from this arena")]
    UnknownBlock { offset: usize, len: usize },
}

#[derive(Debug)]
pub struct Arena {
    capacity: usize,
    cursor: usize,
    /// Free ranges below the cursor, sorted by offset, never adjacent (they are merged).
    free: Vec<BlockHandle>,
    /// Bytes handed out and not yet freed (including alignment padding kept with each block).
    in_use: usize,
}

impl Arena {
    pub fn new(capacity: usize) -> Arena {
        Arena {
            capacity,
            cursor: 0,
            free: Vec::new(),
            in_use: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn in_use(&self) -> usize {
        self.in_use
    }

    /// The high-water mark: everything at or above it has never been handed out.
    pub fn cursor(&self) -> usize {
        self.cursor
    }

    pub fn alloc(&mut self, len: usize, align: usize) -> Result<BlockHandle, ArenaError> {
        if !align.is_power_of_two() {
            return Err(ArenaError::BadAlignment(align));
        }
        let len = len.max(1);
        for i in 0..self.free.len() {
            let f = self.free[i];
            let start = f.offset.next_multiple_of(align);
            if start + len <= f.end() {
                self.free.remove(i);
                // Padding before the block and the tail after it go back on the free list.
                self.insert_free(BlockHandle {
                    offset: f.offset,
                    len: start - f.offset,
                });
                self.insert_free(BlockHandle {
                    offset: start + len,
                    len: f.end() - start - len,
                });
                self.in_use += len;
                return Ok(BlockHandle { offset: start, len });
            }
        }
        let start = self.cursor.next_multiple_of(align);
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.capacity)
            .ok_or(ArenaError::Exhausted {
                requested: len,
                available: self.capacity.saturating_sub(start),
                capacity: self.capacity,
            })?;
        self.insert_free(BlockHandle {
            offset: self.cursor,
            len: start - self.cursor,
        });
        self.cursor = end;
        self.in_use += len;
        Ok(BlockHandle { offset: start, len })
    }

    pub fn free(&mut self, block: BlockHandle) -> Result<(), ArenaError> {
        let unknown = ArenaError::UnknownBlock {
            offset: block.offset,
            len: block.len,
        };
        if block.end() > self.cursor || self.free.iter().any(|f| f.overlaps(&block)) {
            return Err(unknown);
        }
        self.in_use -= block.len;
        self.insert_free(block);
        // Cursor reclaim: a free range touching the cursor is not needed on the list.
        if let Some(last) = self.free.last().copied() {
            if last.end() == self.cursor {
                self.cursor = last.offset;
                self.free.pop();
            }
        }
        Ok(())
    }

    fn insert_free(&mut self, block: BlockHandle) {
        if block.len == 0 {
            return;
        }
        let i = self.free.partition_point(|f| f.offset < block.offset);
        self.free.insert(i, block);
        // Merge with the next, then with the previous range.
        if i + 1 < self.free.len() && self.free[i].end() == self.free[i + 1].offset {
            self.free[i].len += self.free[i + 1].len;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].end() == self.free[i].offset {
            self.free[i - 1].len += self.free[i].len;
            self.free.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_alloc() {
        let mut a = Arena::new(1024);
        let x = a.alloc(100, 16).unwrap();
        let y = a.alloc(100, 16).unwrap();
        assert_eq!(x.offset, 0);
        assert_eq!(y.offset, 112);
        assert!(!x.overlaps(&y));
        assert_eq!(a.in_use(), 200);
    }

    #[test]
    fn exhaustion() {
        let mut a = Arena::new(256);
        a.alloc(200, 1).unwrap();
        let err = a.alloc(100, 1).unwrap_err();
        assert_eq!(
            err,
            ArenaError::Exhausted {
                requested: 100,
                available: 56,
                capacity: 256
            }
        );
        // A request that fits what is left still succeeds after the failure.
        assert!(a.alloc(56, 1).is_ok());
    }

    #[test]
    fn alignment_padding() {
        let mut a = Arena::new(4096);
        a.alloc(3, 1).unwrap();
        let b = a.alloc(8, 256).unwrap();
        assert_eq!(b.offset % 256, 0);
        assert_eq!(b.offset, 256);
        // The padding is reusable.
        let c = a.alloc(200, 8).unwrap();
        assert_eq!(c.offset, 8);
        assert_eq!(a.alloc(1, 3).unwrap_err(), ArenaError::BadAlignment(3));
    }

    #[test]
    fn cursor_reclaim() {
        let mut a = Arena::new(1024);
        let x = a.alloc(100, 1).unwrap();
        let y = a.alloc(100, 1).unwrap();
        a.free(y).unwrap();
        assert_eq!(a.cursor(), 100);
        a.free(x).unwrap();
        assert_eq!(a.cursor(), 0);
        assert_eq!(a.in_use(), 0);
        // The whole capacity is available again.
        assert!(a.alloc(1024, 1).is_ok());
    }

    #[test]
    fn free_reuse_and_merge() {
        let mut a = Arena::new(1024);
        let x = a.alloc(64, 64).unwrap();
        let y = a.alloc(64, 64).unwrap();
        let _z = a.alloc(64, 64).unwrap();
        a.free(x).unwrap();
        a.free(y).unwrap();
        // x and y merged: a 128-byte block fits where they were.
        let w = a.alloc(128, 64).unwrap();
        assert_eq!(w.offset, 0);
    }

    #[test]
    fn double_free_is_an_error() {
        let mut a = Arena::new(1024);
        let x = a.alloc(64, 64).unwrap();
        let _y = a.alloc(64, 64).unwrap();
        a.free(x).unwrap();
        assert!(matches!(a.free(x), Err(ArenaError::UnknownBlock { .. })));
        assert!(matches!(
            a.free(BlockHandle { offset: 4096, len: 8 }),
            Err(ArenaError::UnknownBlock { .. })
        ));
    }
}
