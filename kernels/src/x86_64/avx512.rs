//! AVX-512F: 16 f32 lanes in a `__m512`.

use crate::simd::{Body, Simd, SimdDiv};
use core::arch::x86_64::*;

/// Token for the AVX-512F path. Only use inside a `#[target_feature(enable = "avx512f")]` fn.
#[derive(Clone, Copy)]
pub(crate) struct Avx512;

// SAFETY: (whole impl) every method is only reached from functions compiled with
// `target_feature(enable = "avx512f")`, entered after `Isa::Avx512.is_supported()`; the pointer
// methods' callers guarantee 16 valid lanes.
impl Simd for Avx512 {
    const W: usize = 16;
    type V = __m512;

    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const half::bf16) -> __m512 {
        // SAFETY: see the impl comment (16 values of 2 bytes at `p`). bf16 is the top half of an
        // f32: zero-extend each to 32 bits and shift it into place.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    const BF16_PAIRS: bool = true;
    #[inline(always)]
    unsafe fn load_bf16_pairs(p: *const half::bf16) -> [__m512; 2] {
        // SAFETY: see the impl comment (32 values of 2 bytes at `p`); as the AVX2 version.
        unsafe {
            let x = _mm512_loadu_si512(p.cast());
            let hi = _mm512_set1_epi32(0xffff_0000u32 as i32);
            [
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x)),
                _mm512_castsi512_ps(_mm512_and_si512(x, hi)),
            ]
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const half::f16) -> __m512 {
        // SAFETY: see the impl comment (16 values of 2 bytes at `p`); `vcvtph2ps` on zmm is
        // AVX-512F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> __m512 {
        // SAFETY: see the impl comment (16 values of 1 byte at `p`): sign-extend to 32 bits,
        // convert (exact).
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: see the impl comment.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn isolate<B: Body<Self>>(body: B) {
        #[target_feature(enable = "avx512f")]
        #[inline(never)]
        unsafe fn isolated<B: Body<Avx512>>(body: B) {
            // SAFETY: forwarded contract.
            unsafe { body.run() }
        }
        // SAFETY: the ISA is enabled (the impl comment); forwarded contract.
        unsafe { isolated(body) }
    }
    #[inline(always)]
    unsafe fn set_first(v: __m512, n: usize, x: f32) -> __m512 {
        // SAFETY: see the impl comment (register-only); `n < 16`.
        unsafe { _mm512_mask_blend_ps(((1u32 << n) - 1) as u16, v, _mm512_set1_ps(x)) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m512, b: __m512) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn round(a: __m512) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    unsafe fn pow2i(n: __m512) -> __m512 {
        // SAFETY: see the impl comment.
        unsafe {
            let e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
        }
    }
    #[inline(always)]
    unsafe fn exp2(x: __m512) -> __m512 {
        // `scalef` applies 2^n in one instruction and handles the range itself, so no clamps:
        // lanes below -126 (and -inf) are zeroed by the mask (no denormals reach P·V); the
        // NLT_UQ predicate is true for NaN, which therefore propagates.
        // SAFETY: see the impl comment.
        unsafe {
            let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(-126.0));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            let p = crate::simd::exp2_poly::<Self>(_mm512_sub_ps(x, n));
            _mm512_maskz_scalef_ps(keep, p, n)
        }
    }
    #[inline(always)]
    unsafe fn hsum(a: __m512) -> f32 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_reduce_add_ps(a) }
    }
    avx_transposes!();
    #[inline(always)]
    unsafe fn hsums(v: &[__m512]) -> __m512 {
        // Four levels, each halving the register count: pairs of floats inside 128-bit blocks
        // (unpack ps), pairs of pairs (unpack pd), then 128-bit blocks across registers. Plain
        // loops, no closures: a closure would not inherit the target features and is not
        // inlined.
        // SAFETY: see the impl comment; `v` has 16 registers (indexing checks it).
        unsafe {
            let mut u = [_mm512_setzero_ps(); 8];
            for (i, x) in u.iter_mut().enumerate() {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                *x = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
            }
            let mut w = [_mm512_setzero_ps(); 4];
            for (i, x) in w.iter_mut().enumerate() {
                let (a, b) = (_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
                // 64-bit shuffles of float pairs; the sum itself is in f32.
                *x = _mm512_add_ps(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
                );
            }
            // w[k]'s four blocks each hold partial sums of v[4k..4k+4].
            let x0 = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(w[0], w[1]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(w[0], w[1]),
            );
            let x1 = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(w[2], w[3]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(w[2], w[3]),
            );
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x0, x1),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x0, x1),
            )
        }
    }
    #[inline(always)]
    unsafe fn hmax(a: __m512) -> f32 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_reduce_max_ps(a) }
    }
}

impl SimdDiv for Avx512 {
    #[inline(always)]
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V {
        // SAFETY: only reached from `target_feature(enable = "avx512f")` code entered after
        // `Isa::Avx512.is_supported()` (see the `Simd` impl of `Avx512`).
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn recip(a: Self::V) -> Self::V {
        use core::arch::x86_64::*;
        // SAFETY: as `div`. 14-bit estimate, then r·(2 − a·r).
        unsafe {
            let r = _mm512_rcp14_ps(a);
            _mm512_mul_ps(r, _mm512_fnmadd_ps(a, r, _mm512_set1_ps(2.0)))
        }
    }
}
