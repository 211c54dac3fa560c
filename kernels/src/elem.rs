//! Operand element types: how the kernels read Q, K and V.
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
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// An operand element type (`f32`, [`half::bf16`], [`half::f16`]). Sealed: every type has its
/// loads in each ISA, so only this crate adds one. In each, all-zero bits are +0.0, so zeroed
/// memory is a buffer of zeros of any of them (callers allocating zeroed buffers rely on it; a
/// type added here must keep it).
pub trait Elem: Copy + Send + Sync + core::fmt::Debug + 'static + sealed::Sealed {
    /// Which type this is; kernels branch on it at compile time (each instance sees a constant).
    const DTYPE: Dtype;
    /// The value widened to f32 (exact for every type here).
    fn to_f32(self) -> f32;
    /// The nearest value of this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    const DTYPE: Dtype = Dtype::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Elem for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Elem for f16 {
    const DTYPE: Dtype = Dtype::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// The value at `p`, widened to f32.
///
/// # Safety
/// `p` is readable.
#[inline(always)]
pub(crate) unsafe fn get<E: Elem>(p: *const E) -> f32 {
    // SAFETY: forwarded contract.
    unsafe { (*p).to_f32() }
}
