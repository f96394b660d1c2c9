//! A read chunk: one allocation that a link reads into, whose filled part is handed out as
//! shared, immutable slices (fragments, super-fragments) without copying. The chunk's bytes are
//! charged to a [`Budget`] for as long as any slice of it lives, so the budget bounds the real
//! memory, not an estimate of it.

use crate::budget::Budget;
use std::ops::Deref;
use std::sync::Arc;

/// One budgeted allocation. Only the [`crate::ChunkReader`] that made it writes to it, and only
/// past `filled`; everything before `filled` is immutable from then on.
pub struct Chunk {
    /// From `Box::into_raw`; freed in `Drop`. A raw pointer rather than a `Box` because the one
    /// writer and many readers touch disjoint parts of it at once.
    ptr: *mut u8,
    cap: usize,
    budget: Option<Arc<Budget>>,
}

// SAFETY: the bytes handed out through `ChunkSlice` are never written again (the writer only
// writes the region past every slice ever handed out, see `ChunkReader`), so shared access from
// many threads is read-only.
unsafe impl Sync for Chunk {}
unsafe impl Send for Chunk {}

impl Chunk {
    /// A chunk over a buffer taken from `budget`, to which it returns when the last slice goes.
    pub(crate) fn new(buf: Box<[u8]>, budget: Arc<Budget>) -> Arc<Chunk> {
        Self::from_box(buf, Some(budget))
    }

    /// A chunk holding a copy of `bytes`, charged to nothing: for tests and small messages.
    pub fn from_vec(bytes: Vec<u8>) -> Arc<Chunk> {
        Self::from_box(bytes.into_boxed_slice(), None)
    }

    fn from_box(b: Box<[u8]>, budget: Option<Arc<Budget>>) -> Arc<Chunk> {
        let cap = b.len();
        let ptr = Box::into_raw(b) as *mut u8;
        Arc::new(Chunk { ptr, cap, budget })
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    fn base(&self) -> *mut u8 {
        self.ptr
    }

    /// The unfilled region `[from, capacity)`, for the one writer.
    ///
    /// # Safety
    /// No slice covering any byte at or past `from` may exist or be created while the returned
    /// borrow lives, and only one such borrow may exist at a time.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn tail_mut(&self, from: usize) -> &mut [u8] {
        // Checked in release builds too: one compare against a read syscall's cost.
        assert!(from <= self.cap, "tail past the chunk");
        std::slice::from_raw_parts_mut(self.base().add(from), self.capacity() - from)
    }

    /// Bytes `[start, start+len)`, which must lie in the filled region.
    ///
    /// # Safety
    /// The region must be filled and never written again.
    pub(crate) unsafe fn bytes(&self, start: usize, len: usize) -> &[u8] {
        assert!(
            start <= self.cap && len <= self.cap - start,
            "bytes outside the chunk"
        );
        std::slice::from_raw_parts(self.base().add(start), len)
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`cap` came from `Box::into_raw` of a boxed slice of exactly `cap` bytes,
        // and no slice outlives the last `Arc<Chunk>`.
        let buf = unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.cap)) };
        if let Some(b) = &self.budget {
            b.give_buffer(buf);
        }
    }
}

/// A shared, immutable view of bytes inside a chunk. Cloning it is a reference-count increment.
///
/// It keeps the address of its first byte, so reading it never touches the chunk's shared
/// header: that cache line holds the reference count, which the reading thread writes for every
/// fragment it slices and the sending thread for every one it drops, so a read of it from the
/// sending thread waited for the line to come from the other core. Before, `deref` was 4 % of
/// all CPU time at 1 KiB x 8 (`perf`), nearly all of it in the sending threads.
#[derive(Clone)]
pub struct ChunkSlice {
    chunk: Arc<Chunk>,
    /// `chunk`'s first byte plus the slice's offset into it.
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes a slice points at are filled and never written again (see `Chunk`), and the
// `Arc` the slice holds keeps them allocated: sharing and sending the pointer is sharing and
// sending read-only access to memory that outlives the slice, as `Arc<Chunk>` itself is.
unsafe impl Send for ChunkSlice {}
unsafe impl Sync for ChunkSlice {}

impl ChunkSlice {
    /// # Safety
    /// `[start, start+len)` must be filled and frozen (see [`Chunk`]).
    pub(crate) unsafe fn new(chunk: Arc<Chunk>, start: usize, len: usize) -> ChunkSlice {
        let ptr = chunk.bytes(start, len).as_ptr();
        ChunkSlice { chunk, ptr, len }
    }

    /// A slice owning a copy of `bytes`, outside any budget.
    pub fn copy_from(bytes: &[u8]) -> ChunkSlice {
        Self::from_vec(bytes.to_vec())
    }

    /// A slice owning `bytes` (no copy), outside any budget.
    pub fn from_vec(bytes: Vec<u8>) -> ChunkSlice {
        let len = bytes.len();
        let chunk = Chunk::from_vec(bytes);
        // SAFETY: the whole of a chunk made from a vector is filled and never written.
        let ptr = unsafe { chunk.bytes(0, len) }.as_ptr();
        ChunkSlice { chunk, ptr, len }
    }

    /// How many holders this slice's chunk has (slices, and its reader while it fills it): a
    /// test's proof that slices were moved, not copied or leaked.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.chunk)
    }

    /// A sub-slice `[off, off+len)` of this slice. Panics when the range is not inside it (the
    /// callers check lengths from peers before slicing; the check here keeps the unsafe read in
    /// `Deref` sound whatever a caller passes, including `off + len` that would overflow).
    pub fn slice(&self, off: usize, len: usize) -> ChunkSlice {
        assert!(
            off <= self.len && len <= self.len - off,
            "sub-slice out of range"
        );
        ChunkSlice {
            chunk: self.chunk.clone(),
            // SAFETY: `off <= self.len`, so the address stays within (or one past) this slice.
            ptr: unsafe { self.ptr.add(off) },
            len,
        }
    }
}

impl Deref for ChunkSlice {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` was checked to lie in the chunk's filled, frozen bytes when the
        // slice was made, and `self.chunk` keeps them allocated.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::fmt::Debug for ChunkSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChunkSlice({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_bounds_hold_even_when_the_sum_overflows() {
        let s = ChunkSlice::copy_from(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&s.slice(2, 3)[..], &[3, 4, 5]);
        assert_eq!(s.slice(8, 0).len(), 0);
        for (off, len) in [(1, usize::MAX), (usize::MAX, 2), (9, 0), (4, 5)] {
            let r =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.slice(off, len).len()));
            assert!(r.is_err(), "slice({off}, {len}) must be refused");
        }
    }
}
