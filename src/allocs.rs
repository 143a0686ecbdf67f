//! Counting heap allocations, to show that a decode step makes none. A program opts in by
//! installing [`Counting`] as its global allocator (the `gridlm` binary does); the count is
//! one relaxed atomic add per allocation, on top of the system allocator.
//!
//! Only the threads that compute steps are counted: those marked by [`count_this_thread`],
//! which every kernel team does for the thread that makes it and for its workers. Other
//! threads of the process take no part in a step, but their allocations can land inside its
//! window: with four test processes at once on the 2-core machine, one run in about twelve
//! counted an allocation in a decode step that came from a thread without a name and without
//! a backtrace (by inference a worker of rayon's pool, which packs the weights at load,
//! starting late; with the pool's threads named the case did not recur).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static COUNT: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Whether this thread's allocations are counted (no destructor, so readable at any point
    /// of a thread's life, its start and end included).
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

/// Counts the calling thread's allocations from now on.
pub fn count_this_thread() {
    COUNTED.set(true);
}

fn counted() {
    if COUNTED.get() {
        COUNT.fetch_add(1, Relaxed);
    }
}

/// The system allocator, counting every allocation and reallocation of the counted threads.
pub struct Counting;

// SAFETY: every call is passed on unchanged to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted();
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted();
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        counted();
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

/// Allocations so far by the counted threads, or `None` when [`Counting`] is not the global
/// allocator (nothing was ever counted: a team's threads allocate as it starts).
pub fn count() -> Option<u64> {
    Some(COUNT.load(Relaxed)).filter(|&n| n > 0)
}
