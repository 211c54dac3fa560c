//! x86-64 register types. The kernels themselves are generic (see `flash.rs`); these modules
//! only say how each ISA spells the vector operations.

/// The transposes of [`crate::simd::Simd`] for an x86 register type. Both ISAs use the same
/// 256-bit code, so the AVX2 and AVX-512 impls expand this rather than spell it twice. Only for
/// impls whose ISA implies AVX.
macro_rules! avx_transposes {
    () => {
        /// 8×8 in AVX: unpack, shuffle, 128-bit permute (24 shuffles for 64 floats).
        #[inline(always)]
        unsafe fn transpose8(src: *const f32, lds: usize, dst: *mut f32, ldd: usize, k: &[f32; 8]) {
            use core::arch::x86_64::*;
            // SAFETY: the impl's ISA implies AVX; 8 rows of 8 are readable at `src` and
            // writable at `dst` per the trait's contract.
            unsafe {
                let mut r = [_mm256_setzero_ps(); 8];
                for (i, x) in r.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(src.add(i * lds));
                }
                for (c, col) in $crate::x86_64::transpose8_regs(&r).iter().enumerate() {
                    _mm256_storeu_ps(dst.add(c * ldd), _mm256_mul_ps(*col, _mm256_set1_ps(k[c])));
                }
            }
        }
        /// The `nr` rows loaded (masked to `nc` lanes unless `WIDE_SRC`; the other rows are
        /// zero), the same shuffles, the `nc` output rows stored (masked to `nr` lanes unless
        /// `WIDE_DST`). Masked lanes are neither read nor written. Plain moves where the buffers
        /// allow them: a masked load cannot take its data from a store still in flight (Oᵀ was
        /// just written), so it waits for the store to retire.
        #[inline(always)]
        unsafe fn transpose8_part<const WIDE_SRC: bool, const WIDE_DST: bool>(
            src: *const f32,
            lds: usize,
            nr: usize,
            nc: usize,
            dst: *mut f32,
            ldd: usize,
            k: &[f32; 8],
        ) {
            use core::arch::x86_64::*;
            use $crate::x86_64::{first_lanes, transpose8_regs};
            // SAFETY: the impl's ISA implies AVX; `nr, nc ≤ 8` and the corner's extents per the
            // trait's contract; the masks cover exactly the readable/writable lanes.
            unsafe {
                let (cm, rm) = (first_lanes(nc), first_lanes(nr));
                let mut r = [_mm256_setzero_ps(); 8];
                for (i, x) in r.iter_mut().enumerate().take(nr) {
                    *x = if WIDE_SRC {
                        _mm256_loadu_ps(src.add(i * lds))
                    } else {
                        _mm256_maskload_ps(src.add(i * lds), cm)
                    };
                }
                for (c, col) in transpose8_regs(&r).iter().enumerate().take(nc) {
                    let v = _mm256_mul_ps(*col, _mm256_set1_ps(k[c]));
                    if WIDE_DST {
                        _mm256_storeu_ps(dst.add(c * ldd), v);
                    } else {
                        _mm256_maskstore_ps(dst.add(c * ldd), rm, v);
                    }
                }
            }
        }
    };
}

pub(crate) mod amx;
pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod bf16;

use core::arch::x86_64::*;

/// Lane masks for `_mm256_mask{load,store}_ps`: the 8 ints from index `8 − n` have their sign
/// bit set in the first `n` lanes.
static EDGE_MASK: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

/// Mask selecting the first `n ≤ 8` lanes.
///
/// # Safety
/// AVX enabled in the caller; `n ≤ 8`.
#[inline(always)]
pub(crate) unsafe fn first_lanes(n: usize) -> __m256i {
    debug_assert!(n <= 8);
    // SAFETY: `8 − n + 8 ≤ 16` ints are read from the 16-int table.
    unsafe { _mm256_loadu_si256(EDGE_MASK.as_ptr().add(8 - n).cast()) }
}

/// Columns of the 8×8 block whose rows are `r`: unpack pairs of rows, then quads, then swap the
/// 128-bit halves into place (24 shuffles for 64 floats).
///
/// # Safety
/// AVX enabled in the caller.
#[inline(always)]
pub(crate) unsafe fn transpose8_regs(r: &[__m256; 8]) -> [__m256; 8] {
    // SAFETY: register-only shuffles; AVX per the contract above.
    unsafe {
        let mut t = [_mm256_setzero_ps(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm256_setzero_ps(); 8];
        for h in 0..2 {
            let (a0, a1, b0, b1) = (t[4 * h], t[4 * h + 1], t[4 * h + 2], t[4 * h + 3]);
            u[4 * h] = _mm256_shuffle_ps::<0x44>(a0, b0);
            u[4 * h + 1] = _mm256_shuffle_ps::<0xEE>(a0, b0);
            u[4 * h + 2] = _mm256_shuffle_ps::<0x44>(a1, b1);
            u[4 * h + 3] = _mm256_shuffle_ps::<0xEE>(a1, b1);
        }
        // u[c] (c < 4) holds column c of rows 0–3 in its low half and column c + 4 in its high
        // half; u[c + 4] the same for rows 4–7.
        let mut cols = [_mm256_setzero_ps(); 8];
        for c in 0..4 {
            cols[c] = _mm256_permute2f128_ps::<0x20>(u[c], u[c + 4]);
            cols[c + 4] = _mm256_permute2f128_ps::<0x31>(u[c], u[c + 4]);
        }
        cols
    }
}

#[cfg(test)]
mod tests {
    use crate::simd::tests::check_all;

    #[test]
    fn vector_primitives_every_x86_isa() {
        if crate::Isa::Avx2.is_supported() {
            // SAFETY: AVX2+FMA detected.
            unsafe { avx2() }
        }
        if crate::Isa::Avx512.is_supported() {
            // SAFETY: AVX-512F detected.
            unsafe { avx512() }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2() {
        // SAFETY: AVX2+FMA+F16C enabled here and checked by the caller.
        unsafe { check_all::<super::avx2::Avx2>("avx2") }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn avx512() {
        // SAFETY: AVX-512F enabled here and checked by the caller.
        unsafe { check_all::<super::avx512::Avx512>("avx512") }
    }
}
