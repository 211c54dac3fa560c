//! How the kernels address key and value rows: one run of rows, or the pages of a paged cache.

/// Where key rows live: one run of rows (a contiguous cache), or fixed-size pages of a pool (a
/// paged cache, vLLM's block table). Both kernels read through it: decode row by row
/// ([`crate::DecodeArgs::pages`]), prefill a key block at a time ([`crate::FlashArgs::pages`]).
///
/// Key `j` lies in page `table[j >> shift]`, at row `j & (2^shift − 1)` of it; the page's rows of
/// one KV head start `page · k_stride` elements after the kernel's `k` pointer (`v_stride` after
/// `v`, `scale_stride` after the scale pointers), rows `ldk` / `ldv` apart. The contiguous form
/// is one page of `2^63` rows: the same arithmetic, so both forms run the same code and give
/// bitwise the same result for the same rows (a paged cache is tested equal to a contiguous
/// one). Only the keys a kernel reads are looked up (decode: the key range's rows and, for
/// prefetches, rows below `j_end`; prefill: keys `< n`), so `table` needs an entry for every
/// page such a key falls in.
#[derive(Clone, Copy, Debug)]
pub struct KvPages {
    /// Page index of each run of `2^shift` keys.
    pub table: *const u32,
    /// log2 of the keys per page.
    pub shift: u32,
    /// Elements from one page to the next in K, in V, and in the int8 scales.
    pub k_stride: usize,
    /// See `k_stride`.
    pub v_stride: usize,
    /// See `k_stride`.
    pub scale_stride: usize,
}

/// The page table of the contiguous form: every key in page 0.
static ONE_PAGE: [u32; 1] = [0];

impl KvPages {
    /// Rows `j` at `k + j·ldk` (and likewise V and the scales): no pages.
    pub fn contiguous() -> Self {
        KvPages {
            table: ONE_PAGE.as_ptr(),
            shift: usize::BITS - 1,
            k_stride: 0,
            v_stride: 0,
            scale_stride: 0,
        }
    }

    /// Whether this is the contiguous form (one page holds every key).
    #[inline(always)]
    pub fn is_contiguous(&self) -> bool {
        self.shift >= usize::BITS - 1
    }

    /// Element offset of row `j` (rows `ld` apart, pages `stride` apart).
    ///
    /// # Safety
    /// `table` has an entry for page `j >> shift`.
    #[inline(always)]
    pub(crate) unsafe fn at(&self, j: usize, stride: usize, ld: usize) -> usize {
        let mask = (1usize << self.shift) - 1;
        // SAFETY: the caller's contract.
        let page = unsafe { *self.table.add(j >> self.shift) } as usize;
        page * stride + (j & mask) * ld
    }

    /// The first key past the page of key `j`.
    #[inline(always)]
    pub(crate) fn page_end(&self, j: usize) -> usize {
        (j | ((1usize << self.shift) - 1)).saturating_add(1)
    }
}

impl Default for KvPages {
    fn default() -> Self {
        KvPages::contiguous()
    }
}
