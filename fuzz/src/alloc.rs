//! A global allocator that refuses single allocations above [`ALLOC_LIMIT`], as a machine with
//! that much free memory would. attnkit must then report [`attnkit::AttnError::Alloc`] (or an
//! overflow) for sizes that come from its caller instead of aborting, and the fuzzer never asks
//! the system for absurd amounts of memory.

use std::alloc::{GlobalAlloc, Layout, System};

/// The largest single allocation served (256 MiB).
pub const ALLOC_LIMIT: usize = 256 << 20;

/// [`System`], refusing requests above [`ALLOC_LIMIT`] by returning null.
pub struct CappedAlloc;

// SAFETY: every request is either refused (null, which `GlobalAlloc` permits) or forwarded
// unchanged to `System`, whose guarantees then hold; `dealloc` only sees `System`'s pointers.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract; `ptr` came from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded contract; `ptr` came from `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CappedAlloc = CappedAlloc;
