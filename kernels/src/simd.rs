//! A tiny f32 vector trait. Kernels are written once over it and monomorphised per ISA; only the
//! per-ISA entry points carry `#[target_feature]`, everything here is `#[inline(always)]` so it is
//! compiled with the caller's features (the memchr / pulp pattern).

use crate::elem::{get, Dtype, Stored};
use half::{bf16, f16};

/// A kernel body that [`Simd::isolate`] runs out of line with `S`'s target features. Its `run`
/// is `#[inline(always)]`, so the body compiles into the isolated function (a closure might stay
/// out of line, and then its intrinsics would run without the features).
pub(crate) trait Body<S> {
    /// # Safety
    /// The ISA of `S` is enabled; the body's own contract holds.
    unsafe fn run(self);
}

/// One SIMD register of f32 lanes. All methods are `unsafe`: the caller guarantees that the CPU
/// supports the ISA of the implementing type and that pointers are valid for `W` lanes.
pub(crate) trait Simd: Copy {
    /// Lanes per register.
    const W: usize;
    /// The register type.
    type V: Copy;

    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    /// `W` values of any operand type at `p`, widened to f32: the one load generic kernels use
    /// for Q, K and V.
    #[inline(always)]
    unsafe fn load_as<E: Stored>(p: *const E) -> Self::V {
        // SAFETY: forwarded contract; `DTYPE` names the type behind `p` (the trait is sealed and
        // each impl states its own), so each cast reads the type that is there.
        unsafe {
            match E::DTYPE {
                Dtype::F32 => Self::load(p.cast()),
                Dtype::Bf16 => Self::load_bf16(p.cast()),
                Dtype::F16 => Self::load_f16(p.cast()),
                Dtype::I8 => Self::load_i8(p.cast()),
            }
        }
    }
    /// `W` bf16 values widened; the default goes through memory.
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> Self::V {
        // SAFETY: forwarded contract.
        unsafe { load_widened::<Self, bf16>(p) }
    }
    /// `W` f16 values widened; the default goes through memory.
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> Self::V {
        // SAFETY: forwarded contract.
        unsafe { load_widened::<Self, f16>(p) }
    }
    /// Whether [`Simd::load_bf16_pairs`] is a cheap in-lane split (no shuffle), so kernels that
    /// may reorder a row's elements read bf16 rows through it.
    const BF16_PAIRS: bool = false;
    /// `2W` bf16 values at `p` widened into two registers: the even-indexed values, then the
    /// odd-indexed ones (`[x0, x2, …]`, `[x1, x3, …]`). A 32-bit lane holds a pair, so x86 splits
    /// it with one shift and one mask where [`Simd::load_bf16`] needs a cross-lane widening per
    /// `W` values. The default goes through memory.
    #[inline(always)]
    unsafe fn load_bf16_pairs(p: *const bf16) -> [Self::V; 2] {
        let mut t = [0.0f32; 32];
        // SAFETY: forwarded contract (`2W ≤ 32` values readable at `p`).
        unsafe {
            for i in 0..Self::W {
                t[i] = get(p.add(2 * i));
                t[16 + i] = get(p.add(2 * i + 1));
            }
            [Self::load(t.as_ptr()), Self::load(t.as_ptr().add(16))]
        }
    }
    /// `W` i8 values widened (exactly; the row's scale is applied by the caller); the default
    /// goes through memory.
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self::V {
        // SAFETY: forwarded contract.
        unsafe { load_widened::<Self, i8>(p) }
    }
    unsafe fn store(p: *mut f32, v: Self::V);
    /// Runs `body` as a function of its own, out of line, compiled with this ISA's target
    /// features. A dispatch entry that inlines many kernel variants becomes one huge function,
    /// which LLVM optimises slowly and on one thread (decode's were 200–380 KB of code each and
    /// most of this crate's build time); isolated, each variant is a function LLVM handles apart
    /// and in parallel codegen units. Costs one call per body.
    ///
    /// # Safety
    /// The ISA of `Self` is enabled; `body`'s own contract holds.
    unsafe fn isolate<B: Body<Self>>(body: B);
    /// `a * b + c`, fused where the ISA has it.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// x86 `maxps` semantics: if either lane is NaN the *second* operand is returned.
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// x86 `minps` semantics: if either lane is NaN the *second* operand is returned.
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    /// Round to nearest (ties to even).
    unsafe fn round(a: Self::V) -> Self::V;
    /// `2^n` for lanes holding integers in [-127, 127]; -127 gives +0.0 (flush to zero).
    unsafe fn pow2i(n: Self::V) -> Self::V;
    unsafe fn hsum(a: Self::V) -> f32;
    unsafe fn hmax(a: Self::V) -> f32;
    /// Horizontal sums of `W` registers at once: lane `i` of the result is the sum of `v[i]`'s
    /// lanes (a transposed reduction: ≈ 2 shuffles and 1 add per register instead of a full
    /// [`Simd::hsum`] each). `v.len() == W`.
    #[inline(always)]
    unsafe fn hsums(v: &[Self::V]) -> Self::V {
        debug_assert_eq!(v.len(), Self::W);
        let mut t = [0.0f32; 16];
        // SAFETY: forwarded contract; `t` holds `W ≤ 16` lanes.
        unsafe {
            for (x, &r) in t.iter_mut().zip(v) {
                *x = Self::hsum(r);
            }
            Self::load(t.as_ptr())
        }
    }
    /// 8×8 block transpose with a scale per output row: `dst[c·ldd + r] = src[r·lds + c] · k[c]`
    /// for `r, c < 8`. The default is scalar; x86 overrides it with shuffles.
    #[inline(always)]
    unsafe fn transpose8(src: *const f32, lds: usize, dst: *mut f32, ldd: usize, k: &[f32; 8]) {
        // SAFETY: forwarded contract (8 readable rows of 8 at `src`, 8 writable rows at `dst`).
        unsafe {
            for (c, &kc) in k.iter().enumerate() {
                for r in 0..8 {
                    *dst.add(c * ldd + r) = *src.add(r * lds + c) * kc;
                }
            }
        }
    }
    /// [`Simd::transpose8`] of the top-left `nr × nc` corner (`nr, nc ≤ 8`), for the ragged
    /// edges of a transpose: reads only rows `< nr` of `src`, columns `< nc` unless `WIDE_SRC`
    /// (then all 8 may be read); writes only rows `< nc` of `dst`, lanes `< nr` unless
    /// `WIDE_DST` (then all 8 may be written, lanes `≥ nr` with zeros). The default is scalar;
    /// x86 overrides it with masked moves.
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
        // SAFETY: forwarded contract (the corner is readable at `src`, writable at `dst`).
        unsafe {
            for (c, &kc) in k[..nc].iter().enumerate() {
                for r in 0..nr {
                    *dst.add(c * ldd + r) = *src.add(r * lds + c) * kc;
                }
                if WIDE_DST {
                    for r in nr..8 {
                        *dst.add(c * ldd + r) = 0.0;
                    }
                }
            }
        }
    }
    /// `v` with its first `n < W` lanes replaced by `x` (a blend: applying a partial mask in
    /// registers keeps the later full-width loads of the same lanes forwarded from a full-width
    /// store). The default goes through memory; x86 overrides it with a blend.
    #[inline(always)]
    unsafe fn set_first(v: Self::V, n: usize, x: f32) -> Self::V {
        let mut t = [0.0f32; 16];
        // SAFETY: forwarded contract; `t` holds `W ≤ 16` lanes.
        unsafe {
            Self::store(t.as_mut_ptr(), v);
            t[..n].fill(x);
            Self::load(t.as_ptr())
        }
    }
    /// `2^x`; see [`exp2`]. ISAs with a cheaper exponent step override it.
    #[inline(always)]
    unsafe fn exp2(x: Self::V) -> Self::V {
        // SAFETY: forwarded contract.
        unsafe { exp2_generic::<Self>(x) }
    }
}

/// `S::W` values at `p` widened one by one into a buffer, then loaded.
///
/// # Safety
/// `S::W` values readable at `p`; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn load_widened<S: Simd, E: Stored>(p: *const E) -> S::V {
    let mut t = [0.0f32; 16];
    // SAFETY: forwarded contract; `t` holds `W ≤ 16` lanes.
    unsafe {
        for (i, x) in t.iter_mut().enumerate().take(S::W) {
            *x = get(p.add(i));
        }
        S::load(t.as_ptr())
    }
}

/// Coefficients of a degree-6 fit of 2^f on f ∈ [-0.5, 0.5] (relative error 1.6e-8 before
/// f32 rounding); c0 = 1 so exp2(0) is exact.
const EXP2_C: [f32; 7] = [
    1.0,
    core::f32::consts::LN_2,
    0.240_226_46,
    0.055_503_29,
    0.009_618_52,
    0.001_339_986_6,
    0.000_153_375_8,
];

/// Vectorised 2^x.
///
/// Accuracy: ≤ 3 ulp relative to the exact value for x ∈ [-126, 127] (tested against f64 over
/// the whole range). Below -126.5 (AVX-512: -126) the result is +0.0 (the true value is
/// < 1.2e-38), so `exp2(-inf) == 0`. NaN propagates. Above 127 the portable and AVX2 paths
/// saturate near 2^127.5; AVX-512 gives +inf above 127.5 (and NaN for +inf). Softmax only ever
/// evaluates it at x ≤ 0.
#[inline(always)]
pub(crate) unsafe fn exp2<S: Simd>(x: S::V) -> S::V {
    // SAFETY: forwarded contract.
    unsafe { S::exp2(x) }
}

/// Degree-6 polynomial of `2^f`, f ∈ [-0.5, 0.5].
#[inline(always)]
pub(crate) unsafe fn exp2_poly<S: Simd>(f: S::V) -> S::V {
    // SAFETY: register-only arithmetic; the ISA is enabled per the trait's contract.
    unsafe {
        let mut p = S::splat(EXP2_C[6]);
        p = S::fma(p, f, S::splat(EXP2_C[5]));
        p = S::fma(p, f, S::splat(EXP2_C[4]));
        p = S::fma(p, f, S::splat(EXP2_C[3]));
        p = S::fma(p, f, S::splat(EXP2_C[2]));
        p = S::fma(p, f, S::splat(EXP2_C[1]));
        S::fma(p, f, S::splat(EXP2_C[0]))
    }
}

/// [`exp2`] from the trait's primitives: clamp, split `x = n + f`, polynomial, `2^n` by
/// building the exponent bits (`n = -127` gives the bit pattern of +0.0, hence the flush).
#[inline(always)]
pub(crate) unsafe fn exp2_generic<S: Simd>(x: S::V) -> S::V {
    // SAFETY: register-only arithmetic; the ISA is enabled per the trait's contract.
    unsafe {
        // Operand order matters: NaN in `x` must win the clamp so it reaches the polynomial.
        let x = S::max(S::splat(-127.0), x);
        let x = S::min(S::splat(127.0), x);
        let n = S::round(x);
        let p = exp2_poly::<S>(S::sub(x, n));
        S::mul(p, S::pow2i(n))
    }
}

/// Portable 8-lane vector: plain arrays, vectorised by the compiler for the baseline target.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Simd for Portable {
    const W: usize = 8;
    type V = [f32; 8];

    #[inline(always)]
    unsafe fn splat(x: f32) -> [f32; 8] {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable lanes at `p`.
        unsafe { core::ptr::read_unaligned(p as *const [f32; 8]) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 8]) {
        // SAFETY: the caller guarantees 8 writable lanes at `p`.
        unsafe { core::ptr::write_unaligned(p as *mut [f32; 8], v) }
    }
    #[inline(never)]
    unsafe fn isolate<B: Body<Self>>(body: B) {
        // SAFETY: forwarded contract (the portable path needs no feature).
        unsafe { body.run() }
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        // Separate multiply and add: `f32::mul_add` is a libm call without hardware FMA.
        core::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn add(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn sub(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    unsafe fn mul(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn max(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| if a[i] > b[i] { a[i] } else { b[i] })
    }
    #[inline(always)]
    unsafe fn min(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| if a[i] < b[i] { a[i] } else { b[i] })
    }
    #[inline(always)]
    unsafe fn round(a: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| a[i].round_ties_even())
    }
    #[inline(always)]
    unsafe fn pow2i(n: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| f32::from_bits(((n[i] as i32 + 127) as u32) << 23))
    }
    #[inline(always)]
    unsafe fn hsum(a: [f32; 8]) -> f32 {
        ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    }
    #[inline(always)]
    unsafe fn hmax(a: [f32; 8]) -> f32 {
        let m = |x: f32, y: f32| if x > y { x } else { y };
        m(
            m(m(a[0], a[4]), m(a[2], a[6])),
            m(m(a[1], a[5]), m(a[3], a[7])),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Vectorised tanh (used by the additive-attention kernel). Appended: the items above are shared
// by every kernel and stay as they are.

/// Division, the one operation [`tanh`] needs beyond [`Simd`]. A separate trait so that the base
/// trait (and its per-ISA impls) stay unchanged.
pub(crate) trait SimdDiv: Simd {
    /// `a / b`, IEEE (correctly rounded).
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `1 / a` to within 2 ulp for normal, finite `a` (an estimate refined by one Newton step
    /// where the ISA has one: a division's throughput is the bottleneck of the softcap).
    #[inline(always)]
    unsafe fn recip(a: Self::V) -> Self::V {
        // SAFETY: forwarded contract.
        unsafe { Self::div(Self::splat(1.0), a) }
    }
}

impl SimdDiv for Portable {
    #[inline(always)]
    unsafe fn div(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        core::array::from_fn(|i| a[i] / b[i])
    }
}

/// Clamp of [`tanh`]: beyond ±9 the result is ±1 (the true value rounds to ±1 in f32 above
/// 9.01; the rational below returns 1 − 3.0e-8 at 9, within half an ulp).
pub(crate) const TANH_CLAMP: f32 = 9.0;

/// Numerator coefficients `α₁, α₃, …, α₁₃` of the odd rational minimax approximation of tanh on
/// [-9, 9] used by Eigen, XLA and ONNX Runtime's MLAS (degrees 13/6).
const TANH_ALPHA: [f32; 7] = [
    4.893_524_6e-3,
    6.372_619_5e-4,
    1.485_722_35e-5,
    5.122_297_3e-8,
    -8.604_672e-11,
    2.000_188e-13,
    -2.760_768_4e-16,
];

/// Denominator coefficients `β₀, β₂, β₄, β₆` (see [`TANH_ALPHA`]).
const TANH_BETA: [f32; 4] = [4.893_525e-3, 2.268_434_7e-3, 1.185_347_1e-4, 1.198_258_4e-6];

/// Vectorised tanh: `x · P(x²)/Q(x²)` on x clamped to [-9, 9], `P` degree 6 and `Q` degree 3 in
/// `x²` (the 13/6 odd rational of [`TANH_ALPHA`]).
///
/// Accuracy (exhaustive over every positive f32, the path with fused multiply-add; tanh is odd
/// and the evaluation is sign-symmetric): at most 5.4 ulp and 3.2e-7 absolute, the largest errors
/// near |x| ≈ 8.5 where the result is within 4e-7 of 1; at most 4 ulp for |x| < 2 and 3 ulp for
/// |x| < 1e-3. Tiny and subnormal inputs keep their full relative accuracy (the quotient is taken
/// before multiplying by `x`, so no intermediate underflows): ≤ 2 ulp, and `tanh(±0) = ±0`.
/// `tanh(±inf) = ±1` exactly; NaN propagates. The portable path (separate multiply and add,
/// two roundings per step) measures at most 6.7 ulp and 4.0e-7 absolute, exhaustively.
#[inline(always)]
pub(crate) unsafe fn tanh<S: SimdDiv>(x: S::V) -> S::V {
    // SAFETY: forwarded contract.
    unsafe { tanh_with::<S, false>(x) }
}

/// [`tanh`] with the quotient taken through [`SimdDiv::recip`] when `FAST` (up to 2 ulp more;
/// for the softcap, whose logits are only ever accurate to an ulp of the cap).
#[inline(always)]
pub(crate) unsafe fn tanh_with<S: SimdDiv, const FAST: bool>(x: S::V) -> S::V {
    // SAFETY: forwarded contract.
    unsafe { tanh_rational::<S, FAST>(x) }
}

/// Numerator `p₀ … p₄` of the softcap's tanh, `y·P(y²)/Q(y²)` on [-9, 9] with `P` and `Q` both
/// degree 4 in `y²` and `q₀ = 1`: a minimax fit in absolute error (1.8e-8 in exact arithmetic),
/// one multiply-add cheaper than [`TANH_ALPHA`]'s 13/6 form at the same f32 accuracy. Absolute
/// rather than relative error is what a softcap needs: the capped score `cap·tanh(s/cap)` feeds
/// a softmax, where an error in a logit costs the same whatever the logit's size.
const SOFTCAP_P: [f32; 5] = [
    0.999_999_9,
    0.133_732_21,
    3.486_610_7e-3,
    2.047_231_6e-5,
    1.318_491_2e-8,
];

/// Denominator `q₁ … q₄` of [`SOFTCAP_P`]'s rational (`q₀ = 1`).
const SOFTCAP_Q: [f32; 4] = [0.467_065_2, 2.584_209e-2, 3.271_433e-4, 7.702_942e-7];

/// `k·tanh(y)` with `k` folded into the numerator's coefficients, so the scaling costs nothing
/// (the softcap of a score already divided by the cap: `cap·tanh(x/cap)`), from the rational of
/// [`SOFTCAP_P`]. Accuracy with `k = 1`, absolute: at most 3.3e-7 with fused multiply-add
/// (every third f32 in [0, 9.5]), 3.6e-7 on the portable path; odd; beyond ±9 a constant within
/// 6e-8 of ±1; NaN propagates.
#[derive(Clone, Copy)]
pub(crate) struct ScaledTanh {
    p: [f32; 5],
}

impl ScaledTanh {
    pub(crate) fn new(k: f32) -> Self {
        ScaledTanh {
            p: SOFTCAP_P.map(|c| c * k),
        }
    }

    /// `k·tanh(y)` lane-wise.
    ///
    /// # Safety
    /// The ISA of `S` is enabled.
    #[inline(always)]
    pub(crate) unsafe fn eval<S: SimdDiv>(&self, y: S::V) -> S::V {
        // SAFETY: register-only arithmetic; the ISA is enabled per the trait's contract.
        unsafe {
            // NaN in `y` wins the clamp (operand order), as in `tanh_rational`.
            let y = S::max(S::splat(-TANH_CLAMP), y);
            let y = S::min(S::splat(TANH_CLAMP), y);
            let y2 = S::mul(y, y);
            let mut p = S::splat(self.p[4]);
            p = S::fma(p, y2, S::splat(self.p[3]));
            p = S::fma(p, y2, S::splat(self.p[2]));
            p = S::fma(p, y2, S::splat(self.p[1]));
            p = S::fma(p, y2, S::splat(self.p[0]));
            let mut q = S::splat(SOFTCAP_Q[3]);
            q = S::fma(q, y2, S::splat(SOFTCAP_Q[2]));
            q = S::fma(q, y2, S::splat(SOFTCAP_Q[1]));
            q = S::fma(q, y2, S::splat(SOFTCAP_Q[0]));
            q = S::fma(q, y2, S::splat(1.0));
            S::mul(y, S::div(p, q))
        }
    }
}

/// `x·P(x²)/Q(x²)` on x clamped to [-9, 9], `P` from [`TANH_ALPHA`], `Q` from [`TANH_BETA`].
#[inline(always)]
unsafe fn tanh_rational<S: SimdDiv, const FAST: bool>(x: S::V) -> S::V {
    let alpha = &TANH_ALPHA;
    // SAFETY: register-only arithmetic; the ISA is enabled per the trait's contract.
    unsafe {
        // Operand order matters: NaN in `x` must win the clamp so it reaches the result.
        let x = S::max(S::splat(-TANH_CLAMP), x);
        let x = S::min(S::splat(TANH_CLAMP), x);
        let x2 = S::mul(x, x);
        let mut p = S::splat(alpha[6]);
        p = S::fma(p, x2, S::splat(alpha[5]));
        p = S::fma(p, x2, S::splat(alpha[4]));
        p = S::fma(p, x2, S::splat(alpha[3]));
        p = S::fma(p, x2, S::splat(alpha[2]));
        p = S::fma(p, x2, S::splat(alpha[1]));
        p = S::fma(p, x2, S::splat(alpha[0]));
        let mut q = S::splat(TANH_BETA[3]);
        q = S::fma(q, x2, S::splat(TANH_BETA[2]));
        q = S::fma(q, x2, S::splat(TANH_BETA[1]));
        q = S::fma(q, x2, S::splat(TANH_BETA[0]));
        let quot = if FAST {
            S::mul(p, S::recip(q))
        } else {
            S::div(p, q)
        };
        S::mul(x, quot)
    }
}

/// Prefetch hint for the cache line at `p` into L2 (PREFETCHT1; a no-op off x86-64). Never
/// faults, so `p` may point anywhere. T1 rather than T0: on the Zen 4 test machine T0 requests
/// hold L1 miss buffers until they fill, which capped a streaming kernel at about half the
/// bandwidth T1 reached; the demand loads then hit L2.
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT1 is SSE (baseline on x86-64) and never faults.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T1 }>(p as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Floats of slack a kernel's scratch carries so that [`aligned`] can start it on a cache line.
pub(crate) const ALIGN_SLACK: usize = 15;

/// `buf` from its first 64-byte-aligned float on. Vector loads from scratch that straddle two
/// cache lines cost two L1 accesses on Intel cores: the flash kernel on scratch 16 bytes off a
/// line (what `malloc` returns) ran at 55 % of the FMA peak against 61 % aligned (Xeon, one
/// thread, alternating runs). Callers size `buf` with [`ALIGN_SLACK`] extra floats.
#[inline(always)]
pub(crate) fn aligned(buf: &mut [f32]) -> &mut [f32] {
    let off = buf
        .as_ptr()
        .align_offset(64)
        .min(ALIGN_SLACK)
        .min(buf.len());
    &mut buf[off..]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Whatever the start of the buffer, `aligned` starts on a 64-byte boundary and loses at
    /// most `ALIGN_SLACK` floats.
    #[test]
    fn aligned_starts_on_a_cache_line() {
        let mut buf = vec![0.0f32; 64];
        for start in 0..16 {
            let sub = &mut buf[start..];
            let n = sub.len();
            let a = aligned(sub);
            assert_eq!(a.as_ptr() as usize % 64, 0, "start {start}");
            assert!(a.len() >= n - ALIGN_SLACK);
        }
    }

    /// `hsums` on `S`: lane `i` must equal the sum of register `i` (inputs are small integers,
    /// so every summation order is exact).
    unsafe fn check_hsums<S: Simd>(name: &str) {
        let w = S::W;
        let data: Vec<f32> = (0..w * w)
            .map(|i| ((i * 37 + 11) % 101) as f32 - 50.0)
            .collect();
        // SAFETY: the caller checked the ISA; `data` holds `w` registers of `w` lanes.
        unsafe {
            let regs: Vec<S::V> = (0..w).map(|i| S::load(data.as_ptr().add(i * w))).collect();
            let mut out = [0.0f32; 16];
            S::store(out.as_mut_ptr(), S::hsums(&regs));
            for i in 0..w {
                let want: f32 = data[i * w..(i + 1) * w].iter().sum();
                assert_eq!(out[i], want, "{name}: lane {i}");
            }
        }
    }

    /// `transpose8` on `S` against the definition, strided both ways, scale per output row.
    unsafe fn check_transpose8<S: Simd>(name: &str) {
        let (lds, ldd) = (11, 13);
        let src: Vec<f32> = (0..8 * lds).map(|i| i as f32).collect();
        let k: [f32; 8] = core::array::from_fn(|c| 1.0 + c as f32);
        let mut dst = vec![f32::NAN; 8 * ldd];
        // SAFETY: the caller checked the ISA; 8 rows at both strides fit the buffers.
        unsafe { S::transpose8(src.as_ptr(), lds, dst.as_mut_ptr(), ldd, &k) };
        for c in 0..8 {
            for r in 0..8 {
                assert_eq!(
                    dst[c * ldd + r],
                    src[r * lds + c] * k[c],
                    "{name}: ({r}, {c})"
                );
            }
            assert!(
                dst[c * ldd + 8..(c + 1) * ldd].iter().all(|x| x.is_nan()),
                "{name}: pad"
            );
        }
    }

    /// `transpose8_part` on `S` for every corner and both widths: the corner transposed and
    /// scaled, zeros beside it in wide rows, nothing else in `dst` written. `src` ends right
    /// after the last element it may read.
    unsafe fn check_transpose8_part<S: Simd, const WIDE_SRC: bool, const WIDE_DST: bool>(
        name: &str,
    ) {
        let (lds, ldd) = (11, 13);
        let k: [f32; 8] = core::array::from_fn(|c| 1.0 + c as f32);
        for nr in 1..=8 {
            for nc in 1..=8 {
                let len = (nr - 1) * lds + if WIDE_SRC { 8 } else { nc };
                let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
                let mut dst = vec![f32::NAN; 8 * ldd];
                // SAFETY: the caller checked the ISA; the corner fits both buffers.
                unsafe {
                    S::transpose8_part::<WIDE_SRC, WIDE_DST>(
                        src.as_ptr(),
                        lds,
                        nr,
                        nc,
                        dst.as_mut_ptr(),
                        ldd,
                        &k,
                    )
                };
                let at = format!("{name} {nr}x{nc} wide {WIDE_SRC}/{WIDE_DST}");
                for c in 0..8 {
                    for r in 0..ldd {
                        let got = dst[c * ldd + r];
                        if c < nc && r < nr {
                            assert_eq!(got, src[r * lds + c] * k[c], "{at}: ({r}, {c})");
                        } else if c < nc && r < 8 && WIDE_DST {
                            assert_eq!(got, 0.0, "{at}: pad ({r}, {c})");
                        } else {
                            assert!(got.is_nan(), "{at}: wrote ({r}, {c})");
                        }
                    }
                }
            }
        }
    }

    /// `set_first` on `S`: exactly the first `n` lanes replaced, for every `n < W`.
    unsafe fn check_set_first<S: Simd>(name: &str) {
        let src: Vec<f32> = (0..S::W).map(|i| i as f32).collect();
        for n in 0..S::W {
            let mut dst = [0.0f32; 16];
            // SAFETY: the caller checked the ISA; both buffers hold W lanes.
            unsafe {
                S::store(
                    dst.as_mut_ptr(),
                    S::set_first(S::load(src.as_ptr()), n, -1.5),
                )
            };
            for (i, &x) in dst[..S::W].iter().enumerate() {
                let want = if i < n { -1.5 } else { src[i] };
                assert_eq!(x, want, "{name} n={n}: lane {i}");
            }
        }
    }

    /// `load_bf16` / `load_f16` on `S` against the scalar widening, over values that cover
    /// normals, subnormals, zeros, infinities and NaN; `load_i8` over every i8.
    unsafe fn check_loads<S: Simd>(name: &str) {
        let bits: Vec<u16> = (0..4096u32).map(|i| (i * 16 + i / 256) as u16).collect();
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for chunk in bits.chunks_exact(S::W) {
            let b: Vec<bf16> = chunk.iter().map(|&x| bf16::from_bits(x)).collect();
            let h: Vec<f16> = chunk.iter().map(|&x| f16::from_bits(x)).collect();
            let (mut gb, mut gh) = ([0.0f32; 16], [0.0f32; 16]);
            // SAFETY: the caller checked the ISA; each buffer holds W lanes.
            unsafe {
                S::store(gb.as_mut_ptr(), S::load_bf16(b.as_ptr()));
                S::store(gh.as_mut_ptr(), S::load_f16(h.as_ptr()));
            }
            for i in 0..S::W {
                assert!(same(gb[i], b[i].to_f32()), "{name}: bf16 {:#x}", chunk[i]);
                assert!(same(gh[i], h[i].to_f32()), "{name}: f16 {:#x}", chunk[i]);
            }
        }
        let all: Vec<i8> = (i8::MIN..=i8::MAX).collect();
        for chunk in all.chunks_exact(S::W) {
            let mut g = [0.0f32; 16];
            // SAFETY: the caller checked the ISA; `g` holds W lanes, `chunk` W values.
            unsafe { S::store(g.as_mut_ptr(), S::load_i8(chunk.as_ptr())) };
            for i in 0..S::W {
                assert_eq!(g[i], f32::from(chunk[i]), "{name}: i8 {}", chunk[i]);
            }
        }
    }

    /// Every check of this module on `S`.
    ///
    /// # Safety
    /// The ISA of `S` is enabled.
    pub(crate) unsafe fn check_all<S: SimdDiv>(name: &str) {
        // SAFETY: forwarded.
        unsafe {
            check_scaled_tanh::<S>(name);
            check_hsums::<S>(name);
            check_transpose8::<S>(name);
            check_set_first::<S>(name);
            check_transpose8_part::<S, false, false>(name);
            check_transpose8_part::<S, true, false>(name);
            check_transpose8_part::<S, false, true>(name);
            check_loads::<S>(name);
        }
    }

    /// `ScaledTanh` against f64 tanh on every 61st f32 in [0, 9.5] (both signs) and on the
    /// special values: within 4e-7·k absolute (its doc's bounds plus the rounding of `k` into
    /// the coefficients), odd, within 1e-7·k of ±k at and beyond the clamp, NaN kept.
    unsafe fn check_scaled_tanh<S: SimdDiv>(name: &str) {
        let w = S::W;
        for k in [1.0f32, 30.0 * core::f32::consts::LOG2_E] {
            let t = ScaledTanh::new(k);
            let eval = |x: &[f32]| -> Vec<f32> {
                let mut buf = [0.0f32; 16];
                buf[..x.len()].copy_from_slice(x);
                // SAFETY: the caller checked the ISA; `buf` holds one register.
                unsafe { S::store(buf.as_mut_ptr(), t.eval::<S>(S::load(buf.as_ptr()))) };
                buf[..x.len()].to_vec()
            };
            let hi = 9.5f32.to_bits();
            let mut worst = 0.0f64;
            let mut x = Vec::with_capacity(w);
            let mut bits = 0u32;
            while bits <= hi {
                x.push(f32::from_bits(bits));
                if x.len() == w || bits + 61 > hi {
                    let neg: Vec<f32> = x.iter().map(|v| -v).collect();
                    for (xi, (p, n)) in x.iter().zip(eval(&x).iter().zip(eval(&neg))) {
                        let want = k as f64 * (*xi as f64).tanh();
                        worst = worst.max((*p as f64 - want).abs());
                        assert_eq!(n, -p, "{name}: k {k} odd at {xi:e}");
                    }
                    x.clear();
                }
                bits += 61;
            }
            eprintln!("{name}: ScaledTanh k {k}: max abs err {worst:e}");
            assert!(
                worst <= 4e-7 * k as f64,
                "{name}: k {k}: max abs err {worst:e}"
            );
            let sp = eval(&[
                9.0,
                20.0,
                f32::INFINITY,
                -f32::INFINITY,
                f32::NAN,
                0.0,
                -0.0,
            ]);
            for (got, want) in sp[..4].iter().zip([k, k, k, -k]) {
                assert!(
                    (got - want).abs() <= 1e-7 * k,
                    "{name}: k {k}: saturation {got}"
                );
            }
            assert_eq!(sp[0], sp[1], "{name}: k {k}: constant beyond the clamp");
            assert!(sp[4].is_nan(), "{name}: NaN");
            assert_eq!(sp[5].to_bits(), 0.0f32.to_bits(), "{name}: +0");
            assert_eq!(sp[6].to_bits(), (-0.0f32).to_bits(), "{name}: -0");
        }
    }

    #[test]
    fn vector_primitives_portable() {
        // SAFETY: the portable path needs no CPU feature.
        unsafe { check_all::<Portable>("portable") }
    }
}
