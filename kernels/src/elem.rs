//! Operand element types: how the kernels read Q, K and V.
//!
//! [`Stored`] is every type K and V can be read as: the floating-point [`Elem`]s and `i8`, the
//! symmetric int8 of quantised caches, which carries a scale per key row beside the data (the
//! kernels multiply it in; see `DecodeArgs::k_scale`). [`Elem`] is the floating-point subset,
//! the types of queries, outputs and ordinary tensors.
//!
//! The kernels read their operands as any of these types and compute in f32: a widening load is
//! the only place a type appears, so adding one adds its load here (and, where an ISA converts
//! faster than the portable default, an override in that ISA's `Simd` impl; see
//! `Simd::load_as`), not a kernel copy. The decode kernel is generic over them (it widens in
//! registers as it streams K and V); the flash kernel widens blocks into scratch and is compiled
//! once for all of them. Scratch, scores, the softmax state and the output stay f32.

use half::{bf16, f16};

/// The element types the kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// bfloat16: the top half of an f32.
    Bf16,
    /// IEEE binary16.
    F16,
    /// Symmetric int8 with an f32 scale per row (keys and values of a quantised cache only).
    I8,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I8 => 1,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for i8 {}
}

/// A type K and V can be stored in: the [`Elem`]s and `i8`. Sealed: every type has its loads in
/// each ISA, so only this crate adds one. In each, all-zero bits are zero, so zeroed memory is a
/// buffer of zeros of any of them (callers allocating zeroed buffers rely on it; a type added
/// here must keep it).
pub trait Stored: Copy + Send + Sync + core::fmt::Debug + 'static + sealed::Sealed {
    /// Which type this is; kernels branch on it at compile time (each instance sees a constant).
    const DTYPE: Dtype;
    /// The value widened to f32 (exact for every type here; for `i8` before its row's scale).
    fn to_f32(self) -> f32;
    /// Writes the row `src` as this type and returns its scale: the floats round each value to
    /// nearest even (scale 1); `i8` quantises symmetrically, `scale = max|x| / 127` and
    /// `q = round(x / scale)` (ties to even, in [−127, 127]; an all-zero row has scale 0).
    /// `src` must be finite for `i8` (the caller checks; otherwise the row is unspecified
    /// but initialised). `dst.len() == src.len()`.
    fn encode<A: Elem>(src: &[A], dst: &mut [Self]) -> f32;
}

/// A floating-point operand element type (`f32`, [`half::bf16`], [`half::f16`]): queries,
/// outputs and tensors. All-zero bits are +0.0 (see [`Stored`]).
pub trait Elem: Stored {
    /// The nearest value of this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
}

impl Stored for f32 {
    const DTYPE: Dtype = Dtype::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn encode<A: Elem>(src: &[A], dst: &mut [Self]) -> f32 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(s.to_f32());
        }
        1.0
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Stored for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline]
    fn encode<A: Elem>(src: &[A], dst: &mut [Self]) -> f32 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(s.to_f32());
        }
        1.0
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Stored for f16 {
    const DTYPE: Dtype = Dtype::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn encode<A: Elem>(src: &[A], dst: &mut [Self]) -> f32 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(s.to_f32());
        }
        1.0
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Stored for i8 {
    const DTYPE: Dtype = Dtype::I8;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    fn encode<A: Elem>(src: &[A], dst: &mut [Self]) -> f32 {
        let amax = src.iter().fold(0.0f32, |m, x| m.max(x.to_f32().abs()));
        if amax == 0.0 {
            dst.fill(0);
            return 0.0;
        }
        // `x · (127 / amax)` rather than `x / scale`: one multiply per value, and the largest
        // value maps to exactly ±127 either way (clamped, in case the product rounds up).
        let inv = 127.0 / amax;
        for (d, s) in dst.iter_mut().zip(src) {
            *d = round_small(s.to_f32() * inv).clamp(-127.0, 127.0) as i8;
        }
        amax / 127.0
    }
}

/// `x` rounded to the nearest integer, ties to even, for `|x| < 2²²` (±inf and NaN pass
/// through as they are); `f32::round_ties_even` without SSE4.1 is a libm call per value, this
/// is two additions. Adding 1.5·2²³ moves `x` to where the f32 spacing is 1, so the
/// addition itself rounds (to nearest even, the default mode); subtracting it back is exact.
#[inline(always)]
fn round_small(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (x + SHIFT) - SHIFT
}

/// The value at `p`, widened to f32 (for `i8`, before its row's scale).
///
/// # Safety
/// `p` is readable.
#[inline(always)]
pub(crate) unsafe fn get<E: Stored>(p: *const E) -> f32 {
    // SAFETY: forwarded contract.
    unsafe { (*p).to_f32() }
}

#[cfg(test)]
mod tests {
    use super::round_small;

    /// Every quarter step over the range the int8 encoding uses (ties included), a few large
    /// values, and the non-finite ones: the same as `round_ties_even`.
    #[test]
    fn round_small_is_round_ties_even() {
        let mut xs: Vec<f32> = (-1200..=1200).map(|i| i as f32 * 0.25).collect();
        xs.extend([
            0.49999997,
            -0.49999997,
            1.5000001,
            1e-30,
            -0.0,
            4_194_303.5,
            -4_194_302.5,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        for x in xs {
            let (got, want) = (round_small(x), x.round_ties_even());
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{x}: {got} vs {want}"
            );
        }
        assert!(round_small(f32::NAN).is_nan());
    }
}
