//! Large fixed buffers backed by huge pages: memory a role takes once at configure and touches
//! in an order no cache can follow (a request-mode readout unit's pages, read for an answer
//! long after they were filled, one fragment of 1.6 KB per 4 KiB page). With 4 KiB pages every
//! such access is also a TLB miss and a page walk; with 2 MiB pages the whole buffer fits the
//! TLB (docs/PERFORMANCE.md, request mode, session 21).

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The huge page size of x86-64 and of arm64 with 4 KiB base pages.
pub const HUGE_PAGE: usize = 2 << 20;

/// A zeroed, fixed-size byte buffer. From [`HUGE_PAGE`] up it is its own mapping, starting on
/// a huge page boundary, advised for huge pages (`MADV_HUGEPAGE`; where transparent huge pages
/// are off it gets ordinary pages and nothing else changes) and faulted in at once
/// (`MADV_POPULATE_WRITE`, Linux 5.14 on; older kernels fault it in as it is used): what it
/// costs is paid at configure, not in page faults during the run.
pub struct HugeBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

enum Backing {
    Heap(Layout),
    /// Mapped: this many bytes from `ptr` (`len` rounded up to a base page).
    Mapped(usize),
}

// SAFETY: the buffer owns its memory as a `Box<[u8]>` would; shared access is `&[u8]`.
unsafe impl Send for HugeBuffer {}
unsafe impl Sync for HugeBuffer {}

impl HugeBuffer {
    pub fn zeroed(len: usize) -> HugeBuffer {
        if len >= HUGE_PAGE {
            if let Some(b) = Self::mapped(len) {
                return b;
            }
        }
        let layout = Layout::from_size_align(len.max(1), 64).expect("buffer size overflows");
        // SAFETY: the layout's size is non-zero.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        HugeBuffer {
            ptr,
            len,
            backing: Backing::Heap(layout),
        }
    }

    /// An anonymous mapping (zeroed by the kernel) cut to start on a huge page boundary.
    fn mapped(len: usize) -> Option<HugeBuffer> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let keep = len.checked_next_multiple_of(page)?;
        let span = keep.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let base = raw as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        // SAFETY: [base, start) and [start + keep, base + span) lie inside the mapping just
        // made, page-aligned, and nothing refers to them; [start, start + keep) stays mapped.
        unsafe {
            if start > base {
                libc::munmap(base as *mut libc::c_void, start - base);
            }
            let end = start + keep;
            if base + span > end {
                libc::munmap(end as *mut libc::c_void, base + span - end);
            }
            // Advice only: failures leave ordinary pages, faulted in on first use.
            libc::madvise(start as *mut libc::c_void, keep, libc::MADV_HUGEPAGE);
            libc::madvise(start as *mut libc::c_void, keep, libc::MADV_POPULATE_WRITE);
        }
        Some(HugeBuffer {
            ptr: NonNull::new(start as *mut u8)?,
            len,
            backing: Backing::Mapped(keep),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, for owners that hand out parts of the buffer to other threads and write
    /// other parts meanwhile (without a `&mut` over the whole, which would alias the parts
    /// lent). Reads and writes through it are the caller's to keep apart.
    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for HugeBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the memory holds `len` initialised (zeroed) bytes for the buffer's life.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for HugeBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HugeBuffer {
    fn drop(&mut self) {
        // SAFETY: the memory was made in `zeroed` with this backing and is released once.
        unsafe {
            match self.backing {
                Backing::Heap(layout) => alloc::dealloc(self.ptr.as_ptr(), layout),
                Backing::Mapped(keep) => {
                    libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, keep);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_buffer_starts_on_a_huge_page_and_is_zeroed_and_writable() {
        for _ in 0..3 {
            let mut b = HugeBuffer::zeroed(3 * HUGE_PAGE + 5);
            assert_eq!(b.len(), 3 * HUGE_PAGE + 5);
            assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
            assert!(b.iter().all(|&x| x == 0));
            let n = b.len();
            b[n - 1] = 7;
            b[HUGE_PAGE] = 9;
            assert_eq!((b[n - 1], b[HUGE_PAGE], b[0]), (7, 9, 0));
        }
    }

    #[test]
    fn a_small_buffer_is_an_ordinary_zeroed_one() {
        let mut b = HugeBuffer::zeroed(100);
        assert_eq!(b.len(), 100);
        assert!(b.iter().all(|&x| x == 0));
        b[99] = 1;
        assert_eq!(b[99], 1);
        let none = HugeBuffer::zeroed(0);
        assert!(none.is_empty() && none.iter().next().is_none());
    }
}
