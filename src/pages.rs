//! Transparent huge pages for large, long-lived buffers (KV caches, big K/V tensors).
//!
//! Decode streams the whole KV cache once per token. With 4 KiB pages every 4 KiB of a stream is
//! a new TLB entry — in a VM a two-level page walk — and the hardware prefetchers stop at each
//! page boundary. Measured on the 2-vCPU Zen 4 VM, one thread: the plain read loop of
//! `examples/read_bandwidth.rs` gains ≈ 10 % (25–28 → 29.5 GB/s), a probe reading K and V in
//! alternating 16 KiB blocks as decode does ≈ 20 → 29 GB/s. Decode itself gained 0–30 % when
//! this was added; in later runs +5–26 % at Lk = 8192 but the same or less at Lk = 32768
//! (`BENCHMARKS.md`). Linux backs memory with
//! huge pages only where `madvise(MADV_HUGEPAGE)` asked for them when THP is in `madvise` mode
//! (the common default), so the library asks for its own buffers and offers the call to callers.

/// Asks the kernel to back `buf` with transparent huge pages (Linux; elsewhere a no-op).
///
/// Only the 2 MiB-aligned interior of `buf` can get huge pages. Call it on a fresh allocation
/// before the memory is first written (`vec![0.0; n]` of a large `n` maps untouched zero pages,
/// so that works); memory already touched keeps its small pages until the kernel's background
/// collapse gets to it. The contents are unchanged. Returns whether the advice was accepted
/// (false on other systems, for buffers without a whole 2 MiB-aligned interior, or when the
/// kernel refuses the advice).
///
/// ```
/// let mut keys = vec![0.0f32; 16 << 20]; // 64 MiB
/// let advised = attnkit::advise_huge_pages(&mut keys);
/// # let _ = advised;
/// ```
pub fn advise_huge_pages(buf: &mut [f32]) -> bool {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = buf.as_mut_ptr() as usize;
        let end = start + core::mem::size_of_val(buf);
        let (lo, hi) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if hi <= lo {
            return false;
        }
        // SAFETY: [lo, hi) lies inside `buf`, which we borrow mutably, and is page-aligned.
        // MADV_HUGEPAGE only changes how the range is backed, never its contents.
        unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = buf;
        false
    }
}
