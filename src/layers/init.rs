//! Initial weights for layers built without a checkpoint: PyTorch's default schemes
//! (`nn.Linear`'s uniform `±1/√fan_in`, `nn.MultiheadAttention`'s Xavier-uniform input
//! projection and zero biases) drawn from a small seeded generator, so an experiment or a
//! training run starts from one line and is reproducible from its seed.

use crate::alloc::zeros_for;
use crate::error::Result;

/// A seeded generator for initial weights (xoshiro256**, seeded through SplitMix64). The same
/// seed gives the same weights on every machine; it is not PyTorch's generator, so the values
/// differ from `torch.manual_seed`'s, while their distribution is PyTorch's.
///
/// ```
/// use attnkit::{InitRng, MhaConfig, MultiheadAttention};
/// let mut rng = InitRng::seed(7);
/// let mha = MultiheadAttention::new(MhaConfig::new(64, 8), &mut rng)?;
/// # let _ = mha;
/// # Ok::<(), attnkit::AttnError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitRng {
    s: [u64; 4],
}

impl InitRng {
    /// A generator whose whole state follows from `seed`.
    pub fn seed(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            // SplitMix64: spreads any seed, 0 included, over the state.
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        InitRng {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in `[−bound, bound)`: 24 random bits, so every value is an exact f32 step.
    pub fn uniform(&mut self, bound: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32);
        bound * (2.0 * u - 1.0)
    }

    /// A tensor of `dims` elements uniform in `±bound`, allocated fallibly.
    pub(crate) fn uniform_vec(
        &mut self,
        arg: &'static str,
        dims: &[usize],
        bound: f32,
    ) -> Result<Vec<f32>> {
        let mut x = zeros_for(arg, dims)?;
        x.iter_mut().for_each(|v| *v = self.uniform(bound));
        Ok(x)
    }
}

/// `nn.Linear`'s bound for weight and bias: `kaiming_uniform_(a = √5)` is `1/√fan_in`.
pub(crate) fn linear_bound(fan_in: usize) -> f32 {
    (1.0 / (fan_in.max(1) as f64).sqrt()) as f32
}

/// `xavier_uniform_`'s bound, `√(6 / (fan_in + fan_out))`.
pub(crate) fn xavier_bound(fan_in: usize, fan_out: usize) -> f32 {
    (6.0 / (fan_in as f64 + fan_out as f64).max(1.0)).sqrt() as f32
}
