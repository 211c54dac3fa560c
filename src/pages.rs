//! Transparent huge pages for large, long-lived buffers (KV caches, big K/V tensors).
//!
//! Decode streams the whole KV cache once per token. With 4 KiB pages every 4 KiB of a stream is
//! a new TLB entry — in a VM a two-level page walk — and the hardware prefetchers stop at each
//! page boundary. Measured on the 2-vCPU Zen 4 VM, one thread: the plain read loop of
//! `examples/read_bandwidth.rs` gains ≈ 10 % (25–28 → 29.5 GB/s), a probe reading K and V in
//! alternating 16 KiB blocks as decode does ≈ 20 → 29 GB/s. Decode itself gained 0–30 % when
//! this was added; in later runs +5–26 % at Lk = 8192 but the same or less at Lk = 32768
//! (`docs/tuning-log.md`). Linux backs memory with
//! huge pages only where `madvise(MADV_HUGEPAGE)` asked for them when THP is in `madvise` mode
//! (the common default), so the library asks for its own buffers and offers the call to callers.

use crate::alloc::try_zeros_elem;
use crate::error::{AttnError, Result};
use attnkit_kernels::Stored;

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
pub fn advise_huge_pages<E: Stored>(buf: &mut [E]) -> bool {
    // Miri cannot call `madvise`; the advice never changes what the program computes.
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        const HUGE: usize = 2 << 20;
        let start = buf.as_mut_ptr() as usize;
        let end = start + core::mem::size_of_val(buf);
        let (lo, hi) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if hi <= lo {
            return false;
        }
        // Derived from the buffer's pointer, not cast from the address, to keep its provenance.
        let p = buf.as_mut_ptr().cast::<u8>().wrapping_add(lo - start);
        // SAFETY: [lo, hi) lies inside `buf`, which we borrow mutably, and is page-aligned.
        // MADV_HUGEPAGE only changes how the range is backed, never its contents.
        unsafe { libc::madvise(p.cast(), hi - lo, libc::MADV_HUGEPAGE) == 0 }
    }
    #[cfg(any(not(target_os = "linux"), miri))]
    {
        let _ = buf;
        false
    }
}

/// A zero-filled buffer of `E` (`f32`, `bf16`, `f16`) whose first element sits on a 64-byte
/// boundary (a cache line), optionally advised for huge pages. It dereferences to `[E]`.
///
/// The kernels load whole cache lines of K and V rows; a row that starts off a line makes every
/// vector load touch two lines, which Intel cores pay for. Measured on the Xeon with K and V in
/// L2, two rounds: a four-row decode group took 31 ns per key on aligned rows and 37–43 ns on
/// rows 16 bytes off a line (what `malloc` returns for large blocks). Rows stay on line
/// boundaries when the buffer does and the row stride is a multiple of 64 bytes.
/// [`crate::KvCache`] keeps its keys and values in these.
///
/// ```
/// let mut k = attnkit::AlignedBuf::zeroed(1 << 20, true);
/// assert_eq!(k.as_ptr() as usize % 64, 0);
/// k[0] = 1.0;
/// assert_eq!(k.iter().sum::<f32>(), 1.0);
/// ```
pub struct AlignedBuf<E = f32> {
    buf: Vec<E>,
    off: usize,
    len: usize,
}

impl AlignedBuf {
    /// `len` f32 zeros on a 64-byte boundary; `huge_pages`: ask for transparent huge pages first
    /// ([`advise_huge_pages`]), before the memory is touched. ([`AlignedBuf::zeroed_of`] for
    /// the other element types.)
    ///
    /// # Panics
    /// If the allocation fails or its size overflows (as `vec!` would); [`AlignedBuf::try_zeroed`]
    /// returns an error instead.
    pub fn zeroed(len: usize, huge_pages: bool) -> Self {
        Self::zeroed_of(len, huge_pages)
    }

    /// [`AlignedBuf::zeroed`] that reports a size the allocator refuses.
    ///
    /// # Errors
    /// [`AttnError::Overflow`] or [`AttnError::Alloc`] (argument `"AlignedBuf"`).
    pub fn try_zeroed(len: usize, huge_pages: bool) -> Result<Self> {
        Self::try_zeroed_of(len, huge_pages)
    }
}

impl<E: Stored> AlignedBuf<E> {
    /// [`AlignedBuf::zeroed`] of any element type: `AlignedBuf::<bf16>::zeroed_of(n, true)`.
    ///
    /// # Panics
    /// As [`AlignedBuf::zeroed`].
    pub fn zeroed_of(len: usize, huge_pages: bool) -> Self {
        match Self::try_zeroed_of(len, huge_pages) {
            Ok(b) => b,
            Err(e) => panic!("AlignedBuf::zeroed({len}): {e}"),
        }
    }

    /// [`AlignedBuf::try_zeroed`] of any element type.
    ///
    /// # Errors
    /// As [`AlignedBuf::try_zeroed`].
    pub fn try_zeroed_of(len: usize, huge_pages: bool) -> Result<Self> {
        let slack = 64 / core::mem::size_of::<E>() - 1;
        let arg = "AlignedBuf";
        let total = len.checked_add(slack).ok_or(AttnError::Overflow { arg })?;
        let mut buf = try_zeros_elem::<E>(arg, total)?;
        if huge_pages {
            advise_huge_pages(&mut buf);
        }
        let off = buf.as_ptr().align_offset(64).min(slack);
        Ok(AlignedBuf { buf, off, len })
    }
}

impl<E> core::ops::Deref for AlignedBuf<E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl<E> core::ops::DerefMut for AlignedBuf<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

impl<E: Stored> Clone for AlignedBuf<E> {
    /// A copy on a cache line of its own (ordinary pages).
    fn clone(&self) -> Self {
        let mut c = AlignedBuf::zeroed_of(self.len, false);
        c.copy_from_slice(self);
        c
    }
}

impl<E> core::fmt::Debug for AlignedBuf<E> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}
