//! x86-64 register types. The kernels themselves are generic (see `flash.rs`); these modules
//! only say how each ISA spells the vector operations.

pub(crate) mod avx2;
pub(crate) mod avx512;

use core::arch::x86_64::*;

/// The 8×8 transpose of [`crate::simd::Simd::transpose8`] in AVX (unpack, shuffle, 128-bit
/// permute: 24 shuffles for 64 floats), shared by the AVX2 and AVX-512 paths.
///
/// # Safety
/// AVX enabled in the caller; 8 readable rows of 8 floats at `src` (stride `lds`) and 8
/// writable rows at `dst` (stride `ldd`).
#[inline(always)]
pub(crate) unsafe fn transpose8_avx(
    src: *const f32,
    lds: usize,
    dst: *mut f32,
    ldd: usize,
    k: &[f32; 8],
) {
    // SAFETY: per the contract above.
    unsafe {
        let mut r = [_mm256_setzero_ps(); 8];
        for (i, x) in r.iter_mut().enumerate() {
            *x = _mm256_loadu_ps(src.add(i * lds));
        }
        // Pairs of rows interleaved, then quads, then 128-bit halves swapped into place.
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
        for c in 0..4 {
            let lo = _mm256_permute2f128_ps::<0x20>(u[c], u[c + 4]);
            let hi = _mm256_permute2f128_ps::<0x31>(u[c], u[c + 4]);
            _mm256_storeu_ps(dst.add(c * ldd), _mm256_mul_ps(lo, _mm256_set1_ps(k[c])));
            _mm256_storeu_ps(
                dst.add((c + 4) * ldd),
                _mm256_mul_ps(hi, _mm256_set1_ps(k[c + 4])),
            );
        }
    }
}
