//! A global allocator that counts heap allocations, for tests and benches
//! that measure what a call allocates:
//!
//! ```
//! use cohort_runtime::conformance::CountingAllocator;
//!
//! #[global_allocator]
//! static ALLOCATOR: CountingAllocator = CountingAllocator;
//!
//! let before = CountingAllocator::count();
//! let v = vec![1u8; 64];
//! assert!(CountingAllocator::count() > before, "{v:?}");
//! ```
//!
//! Every thread's allocations count, so a test measuring them runs alone in
//! its binary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// The system allocator, counting allocations and reallocations (frees are
/// not counted). Install it with `#[global_allocator]`.
pub struct CountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

impl CountingAllocator {
    /// Allocations and reallocations so far, on every thread (0 unless this
    /// is the process's global allocator).
    pub fn count() -> u64 {
        ALLOCATIONS.load(Ordering::Relaxed)
    }
}

// SAFETY: forwards every call to the system allocator unchanged; the count
// is a relaxed atomic add, which allocates nothing.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
