//! AVX2 + FMA: 8 f32 lanes in a `__m256`.

use crate::simd::{Body, Simd, SimdDiv};
use core::arch::x86_64::*;

/// Token for the AVX2+FMA path (with F16C, which every AVX2 CPU has). Only use inside a
/// `#[target_feature(enable = "avx2,fma,f16c")]` fn.
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

// SAFETY: (whole impl) every method is only reached from functions compiled with
// `target_feature(enable = "avx2,fma,f16c")`, entered after `Isa::Avx2.is_supported()`; the pointer
// methods' callers guarantee 8 valid lanes.
impl Simd for Avx2 {
    const W: usize = 8;
    type V = __m256;

    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const half::bf16) -> __m256 {
        // SAFETY: see the impl comment (8 values of 2 bytes at `p`). bf16 is the top half of an
        // f32: zero-extend each to 32 bits and shift it into place.
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
    const BF16_PAIRS: bool = true;
    #[inline(always)]
    unsafe fn load_bf16_pairs(p: *const half::bf16) -> [__m256; 2] {
        // SAFETY: see the impl comment (16 values of 2 bytes at `p`). Lane i holds values 2i (low
        // half) and 2i + 1 (high half): shifted up, the low one is an f32; masked, the high one.
        unsafe {
            let x = _mm256_loadu_si256(p.cast());
            let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
            [
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x)),
                _mm256_castsi256_ps(_mm256_and_si256(x, hi)),
            ]
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const half::f16) -> __m256 {
        // SAFETY: see the impl comment (8 values of 2 bytes at `p`; F16C is part of this level).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> __m256 {
        // SAFETY: see the impl comment (8 values of 1 byte at `p`): sign-extend to 32 bits,
        // convert (exact).
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: see the impl comment.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn isolate<B: Body<Self>>(body: B) {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline(never)]
        unsafe fn isolated<B: Body<Avx2>>(body: B) {
            // SAFETY: forwarded contract.
            unsafe { body.run() }
        }
        // SAFETY: the ISA is enabled (the impl comment); forwarded contract.
        unsafe { isolated(body) }
    }
    #[inline(always)]
    unsafe fn set_first(v: __m256, n: usize, x: f32) -> __m256 {
        // SAFETY: see the impl comment (register-only); `n < 8`.
        unsafe {
            let m = _mm256_castsi256_ps(super::first_lanes(n));
            _mm256_blendv_ps(v, _mm256_set1_ps(x), m)
        }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m256, b: __m256) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn round(a: __m256) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    unsafe fn pow2i(n: __m256) -> __m256 {
        // SAFETY: see the impl comment.
        unsafe {
            let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
        }
    }
    #[inline(always)]
    unsafe fn hsum(a: __m256) -> f32 {
        // SAFETY: see the impl comment.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s)
        }
    }
    avx_transposes!();
    #[inline(always)]
    unsafe fn hsums(v: &[__m256]) -> __m256 {
        // As the AVX-512 version, one level shorter (8 registers, two 128-bit blocks each).
        // SAFETY: see the impl comment; `v` has 8 registers (indexing checks it).
        unsafe {
            let mut u = [_mm256_setzero_ps(); 4];
            for (i, x) in u.iter_mut().enumerate() {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                *x = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
            }
            let mut w = [_mm256_setzero_ps(); 2];
            for (i, x) in w.iter_mut().enumerate() {
                let (a, b) = (_mm256_castps_pd(u[2 * i]), _mm256_castps_pd(u[2 * i + 1]));
                // 64-bit shuffles of float pairs; the sum itself is in f32.
                *x = _mm256_add_ps(
                    _mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                    _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)),
                );
            }
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(w[0], w[1]),
                _mm256_permute2f128_ps::<0x31>(w[0], w[1]),
            )
        }
    }
    #[inline(always)]
    unsafe fn hmax(a: __m256) -> f32 {
        // SAFETY: see the impl comment.
        unsafe {
            let s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_max_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s)
        }
    }
}

impl SimdDiv for Avx2 {
    #[inline(always)]
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V {
        // SAFETY: only reached from `target_feature(enable = "avx2,fma,f16c")` code entered after
        // `Isa::Avx2.is_supported()` (see the `Simd` impl of `Avx2`).
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn recip(a: Self::V) -> Self::V {
        use core::arch::x86_64::*;
        // SAFETY: as `div`. 12-bit estimate, then r·(2 − a·r).
        unsafe {
            let r = _mm256_rcp_ps(a);
            _mm256_mul_ps(r, _mm256_fnmadd_ps(a, r, _mm256_set1_ps(2.0)))
        }
    }
}
