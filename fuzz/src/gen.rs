//! Turning fuzz bytes into sizes, choices and data, deterministically.
//!
//! Every helper reads from an [`Unstructured`]; when the input runs out, `Unstructured` yields
//! zeros, so the helpers are written such that zeros mean "the plain case" (no fault, no wild
//! size, the first choice).

use arbitrary::{Result, Unstructured};

/// Sizes that probe overflow and allocation handling: powers of two around 32-bit and 64-bit
/// boundaries, their neighbours, and `usize::MAX` fractions.
pub const WILD_SIZES: [usize; 18] = [
    0,
    1,
    2,
    3,
    17,
    1 << 16,
    1 << 20,
    (1 << 31) - 1,
    1 << 31,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    1 << 48,
    1 << 62,
    usize::MAX / 3,
    usize::MAX / 2 + 1,
    usize::MAX - 1,
    usize::MAX,
];

/// True with probability `num / den` (false when the input is exhausted).
pub fn chance(u: &mut Unstructured, num: u8, den: u8) -> Result<bool> {
    debug_assert!(num <= den && den > 0);
    Ok(u.int_in_range(0..=den - 1)? >= den - num)
}

/// A small size in `0..=max`, usually (3 in 4) at most 8.
pub fn small(u: &mut Unstructured, max: usize) -> Result<usize> {
    if chance(u, 1, 4)? {
        u.int_in_range(0..=max)
    } else {
        u.int_in_range(0..=max.min(8))
    }
}

/// A size from [`WILD_SIZES`] or, one time in four, any `usize`.
pub fn wild(u: &mut Unstructured) -> Result<usize> {
    if chance(u, 1, 4)? {
        u.arbitrary()
    } else {
        Ok(*u.choose(&WILD_SIZES)?)
    }
}

/// A size: [`small`], or with `wild_odds` (out of 8) a [`wild`] one.
pub fn size(u: &mut Unstructured, max: usize, wild_odds: u8) -> Result<usize> {
    if chance(u, wild_odds, 8)? {
        wild(u)
    } else {
        small(u, max)
    }
}

/// `∏ dims`, `None` on overflow.
pub fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |a, &x| a.checked_mul(x))
}

/// A small deterministic generator (xorshift64*) for bulk data, seeded from the input so that
/// short inputs still get varied buffers.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeds from 8 input bytes (zero bytes give a fixed non-zero seed).
    pub fn decode(u: &mut Unstructured) -> Result<Self> {
        let seed: u64 = u.arbitrary()?;
        Ok(Rng(seed | 1))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `[-4, 4)` on a grid of 1/32: products and short sums of them are exact in f32,
    /// so the reference and the kernels see the same dot products.
    pub fn value(&mut self) -> f32 {
        f32::from((self.next_u64() >> 56) as u8 as i8) / 32.0
    }

    /// True with probability `num / 256`.
    pub fn bit(&mut self, num: u32) -> bool {
        ((self.next_u64() >> 56) as u32) < num
    }

    /// `n` values of [`Rng::value`].
    pub fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
}

/// Overwrites a few elements of `data` with NaN or ±infinity (at most 4).
pub fn inject_specials(u: &mut Unstructured, data: &mut [f32]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    for _ in 0..u.int_in_range(1..=4)? {
        let i = u.choose_index(data.len())?;
        data[i] = *u.choose(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY])?;
    }
    Ok(())
}
