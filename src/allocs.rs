//! Counting heap allocations, to show that a decode step makes none. A program opts in by
//! installing [`Counting`] as its global allocator (the `gridlm` binary does); the count is
//! one relaxed atomic add per allocation, on top of the system allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static COUNT: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting every allocation and reallocation of the process.
pub struct Counting;

// SAFETY: every call is passed on unchanged to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        COUNT.fetch_add(1, Relaxed);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        COUNT.fetch_add(1, Relaxed);
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        COUNT.fetch_add(1, Relaxed);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

/// Allocations so far by every thread of the process, or `None` when [`Counting`] is not the
/// global allocator (nothing was ever counted: any program allocates before it asks).
pub fn count() -> Option<u64> {
    Some(COUNT.load(Relaxed)).filter(|&n| n > 0)
}
