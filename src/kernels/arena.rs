//! Memory for packed weights: 2 MiB-aligned chunks that ask for transparent huge pages, with
//! matrices placed back to back inside them.
//!
//! Every decode step reads all weights once. In 4 KiB pages that is a TLB miss every 4 KiB
//! of every matrix, and under a hypervisor (nested paging) each miss is a long walk: measured
//! on the 2-core test machine, matrices of a few MiB each in their own allocation streamed at
//! ~0.8 of the rate of one 56 MB matrix that the kernel had backed with huge pages. A chunk is
//! mapped fresh (so its pages are zero and untouched until written) and advised huge as a whole,
//! so small matrices share huge pages instead of each falling short of one.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Alignment and size of a huge page.
const HUGE: usize = 2 << 20;
/// Size of a shared chunk; larger requests get a chunk of their own.
const CHUNK: usize = 64 << 20;
/// Each buffer starts on its own cache line.
const LINE: usize = 64;

/// One mapping. Unmapped when the last buffer in it is dropped.
struct Chunk {
    ptr: NonNull<u8>,
    size: usize,
}

// SAFETY: a chunk is plain memory; the buffers carved from it are disjoint and each is owned by
// one `HugeBuf`, whose own Send/Sync follow its element type.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    /// `size` bytes (a multiple of [`HUGE`]) of zeroed memory aligned to [`HUGE`].
    fn new(size: usize) -> Chunk {
        #[cfg(unix)]
        {
            // Over-map by one huge page, keep the aligned part, unmap the rest.
            let len = size + HUGE;
            // SAFETY: an anonymous private mapping with no address hint; checked below.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(size, HUGE).unwrap());
            }
            let start = (base as usize).next_multiple_of(HUGE);
            let (head, tail) = (start - base as usize, base as usize + len - (start + size));
            // SAFETY: both ranges lie inside the mapping just made and outside
            // [start, start + size); MADV_HUGEPAGE changes no contents (and is only advice:
            // without THP it does nothing).
            unsafe {
                if head > 0 {
                    libc::munmap(base, head);
                }
                if tail > 0 {
                    libc::munmap((start + size) as *mut libc::c_void, tail);
                }
                #[cfg(target_os = "linux")]
                libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
            }
            Chunk { ptr: NonNull::new(start as *mut u8).expect("mmap returned null"), size }
        }
        #[cfg(not(unix))]
        {
            let layout = std::alloc::Layout::from_size_align(size, HUGE).unwrap();
            // SAFETY: the layout has a non-zero size.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            Chunk { ptr: NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout)), size }
        }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        #[cfg(unix)]
        // SAFETY: exactly the range `new` kept mapped; no buffer refers to it any more.
        unsafe {
            libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.size);
        }
        #[cfg(not(unix))]
        // SAFETY: allocated in `new` with this layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                std::alloc::Layout::from_size_align(self.size, HUGE).unwrap(),
            )
        }
    }
}

/// The shared chunk being filled and how many bytes of it are taken.
static CURRENT: Mutex<Option<(Arc<Chunk>, usize)>> = Mutex::new(None);

/// Ends the shared chunk being filled: buffers made from now on go into new chunks. A set of
/// buffers made between two calls (a shard's weights, [`crate::model::Shard::from_source`])
/// then shares no chunk with any other, so dropping it returns all its memory (`gridlm bench
/// --compare-unquantized` drops one shard and reports the resident memory of the other).
pub fn close_chunk() {
    *CURRENT.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// A fixed-length buffer of `T` inside a chunk, zeroed when made.
pub struct HugeBuf<T> {
    /// Keeps the mapping alive.
    _chunk: Arc<Chunk>,
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the buffer owns its elements exclusively (no other buffer overlaps them).
unsafe impl<T: Send> Send for HugeBuf<T> {}
unsafe impl<T: Sync> Sync for HugeBuf<T> {}

impl<T: bytemuck::Zeroable + Copy> HugeBuf<T> {
    /// `len` zeroed elements.
    pub fn zeroed(len: usize) -> HugeBuf<T> {
        let bytes = (len * std::mem::size_of::<T>()).next_multiple_of(LINE).max(LINE);
        if bytes > CHUNK / 2 {
            return Self::alone(len);
        }
        let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        let (chunk, offset) = match cur.as_mut() {
            Some((c, used)) if *used + bytes <= c.size => {
                let at = *used;
                *used += bytes;
                (c.clone(), at)
            }
            _ => {
                let c = Arc::new(Chunk::new(CHUNK));
                *cur = Some((c.clone(), bytes));
                (c, 0)
            }
        };
        drop(cur);
        // SAFETY: offset + bytes lies inside the chunk; LINE keeps it aligned for T (align ≤ 64).
        let ptr = unsafe { NonNull::new_unchecked(chunk.ptr.as_ptr().add(offset) as *mut T) };
        HugeBuf { _chunk: chunk, ptr, len }
    }

    /// `len` zeroed elements in a mapping of their own, returned to the system when the buffer
    /// is dropped (as [`HugeBuf::zeroed`] gives a large one). `zeroed` carves small buffers out
    /// of shared chunks and never reuses their space, which suits weights (made once); a buffer
    /// made again and again (a KV pool, made anew for each run) must not leave its space behind
    /// in a chunk that other buffers keep mapped.
    pub fn alone(len: usize) -> HugeBuf<T> {
        let bytes = (len * std::mem::size_of::<T>()).next_multiple_of(HUGE).max(HUGE);
        let chunk = Arc::new(Chunk::new(bytes));
        let ptr = chunk.ptr.cast::<T>();
        HugeBuf { _chunk: chunk, ptr, len }
    }

    /// A copy of `v`.
    pub fn from_slice(v: &[T]) -> HugeBuf<T> {
        let mut b = Self::zeroed(v.len());
        b.copy_from_slice(v);
        b
    }
}

impl<T> Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialized (zeroed, and `T: Zeroable`) elements owned by this buffer,
        // kept alive by `_chunk`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: bytemuck::Zeroable + Copy> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuf({} elements)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_disjoint_and_aligned() {
        let mut a = HugeBuf::<f32>::zeroed(1000);
        let mut b = HugeBuf::<i8>::zeroed(3);
        let big = HugeBuf::<u16>::zeroed(CHUNK); // a chunk of its own
        assert!(a.iter().all(|&v| v == 0.0) && b.iter().all(|&v| v == 0) && big.iter().all(|&v| v == 0));
        a.fill(1.5);
        b.fill(7);
        assert!(a.iter().all(|&v| v == 1.5) && b.iter().all(|&v| v == 7));
        for p in [a.as_ptr() as usize, b.as_ptr() as usize] {
            assert_eq!(p % LINE, 0);
        }
        assert_eq!(big.as_ptr() as usize % HUGE, 0);
        let c = a.clone();
        drop(a);
        assert!(c.iter().all(|&v| v == 1.5));
    }

    #[test]
    fn a_buffer_alone_has_its_own_mapping() {
        let mut a = HugeBuf::<u16>::alone(3000);
        let b = HugeBuf::<u16>::alone(0);
        assert!(a.len() == 3000 && a.iter().all(|&v| v == 0) && b.is_empty());
        a.fill(9);
        assert_eq!(a.as_ptr() as usize % HUGE, 0);
        assert_eq!(b.as_ptr() as usize % HUGE, 0);
        assert!(a.iter().all(|&v| v == 9));
    }
}
