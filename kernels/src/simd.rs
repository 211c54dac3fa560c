//! A tiny f32 vector trait. Kernels are written once over it and monomorphised per ISA; only the
//! per-ISA entry points carry `#[target_feature]`, everything here is `#[inline(always)]` so it is
//! compiled with the caller's features (the memchr / pulp pattern).

/// One SIMD register of f32 lanes. All methods are `unsafe`: the caller guarantees that the CPU
/// supports the ISA of the implementing type and that pointers are valid for `W` lanes.
pub(crate) trait Simd: Copy {
    /// Lanes per register.
    const W: usize;
    /// The register type.
    type V: Copy;

    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
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
}

/// Coefficients of a degree-6 fit of 2^f on f ∈ [-0.5, 0.5] (relative error 1.6e-8 before
/// f32 rounding); c0 = 1 so exp2(0) is exact.
const EXP2_C: [f32; 7] = [
    1.0,
    0.693_147_2,
    0.240_226_46,
    0.055_503_29,
    0.009_618_52,
    0.001_339_986_6,
    0.000_153_375_8,
];

/// Vectorised 2^x.
///
/// Accuracy: ≤ 3 ulp relative to the exact value for x ∈ [-126, 127] (tested against f64 over
/// the whole range). Below -126.5 the result flushes to +0.0 (the true value is < 1.2e-38), so
/// `exp2(-inf) == 0`. Above 127 the result saturates near 2^127.5. NaN propagates.
#[inline(always)]
pub(crate) unsafe fn exp2<S: Simd>(x: S::V) -> S::V {
    // SAFETY: register-only arithmetic; the ISA is enabled per the trait's contract.
    unsafe {
        // Operand order matters: NaN in `x` must win the clamp so it reaches the polynomial.
        let x = S::max(S::splat(-127.0), x);
        let x = S::min(S::splat(127.0), x);
        let n = S::round(x);
        let f = S::sub(x, n);
        let mut p = S::splat(EXP2_C[6]);
        p = S::fma(p, f, S::splat(EXP2_C[5]));
        p = S::fma(p, f, S::splat(EXP2_C[4]));
        p = S::fma(p, f, S::splat(EXP2_C[3]));
        p = S::fma(p, f, S::splat(EXP2_C[2]));
        p = S::fma(p, f, S::splat(EXP2_C[1]));
        p = S::fma(p, f, S::splat(EXP2_C[0]));
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
        m(m(m(a[0], a[4]), m(a[2], a[6])), m(m(a[1], a[5]), m(a[3], a[7])))
    }
}
