//! The glue around attention: norms, activations, rotary embeddings, embeddings lookup and
//! weight loading. Plain loops on purpose: these are a few percent of a forward pass (the
//! share is measured in BENCHMARKS.md), and the projections go through attnkit's [`Linear`].

use attnkit::{AttnError, Linear, Par, StateDict, Tokens};
use std::time::{Duration, Instant};

pub type Result<T> = std::result::Result<T, Error>;

/// A model that cannot be loaded or run.
#[derive(Debug)]
pub enum Error {
    Attn(AttnError),
    Io(String, std::io::Error),
    Config(String),
    Tokenizer(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Attn(e) => write!(f, "{e}"),
            Error::Io(path, e) => write!(f, "{path}: {e}"),
            Error::Config(m) => write!(f, "config: {m}"),
            Error::Tokenizer(m) => write!(f, "tokenizer: {m}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<AttnError> for Error {
    fn from(e: AttnError) -> Self {
        Error::Attn(e)
    }
}

/// Where a forward pass spent its time: the attention calls against everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct Profile {
    pub attention: Duration,
    pub total: Duration,
}

impl Profile {
    /// Runs `f`, adding its duration to `attention`.
    pub fn attention<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.attention += t.elapsed();
        r
    }
}

/// Reads `name` with the given shape.
pub fn weight(sd: &StateDict, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let (got, data) = sd.tensor(name)?;
    if got != shape {
        return Err(AttnError::WeightShape {
            name: name.into(),
            expected: shape.to_vec(),
            got,
        }
        .into());
    }
    Ok(data)
}

/// `nn.Linear` at `prefix`, checked against the expected sizes.
pub fn linear(sd: &StateDict, prefix: &str, out_f: usize, in_f: usize) -> Result<Linear> {
    let lin = Linear::from_state_dict(sd, prefix)?;
    if (lin.out_features(), lin.in_features()) != (out_f, in_f) {
        return Err(AttnError::WeightShape {
            name: format!("{prefix}.weight"),
            expected: vec![out_f, in_f],
            got: vec![lin.out_features(), lin.in_features()],
        }
        .into());
    }
    Ok(lin)
}

/// `lin(x)` for `rows` tokens of `x` (dense `(rows, in)`), as a dense `(rows, out)` buffer.
pub fn apply(lin: &Linear, x: &[f32], rows: usize, par: Par) -> Result<Vec<f32>> {
    Ok(lin.forward(&Tokens::le(x, [rows, lin.in_features()]), par)?)
}

/// `nn.LayerNorm` over the last dimension, in place, row by row (f32, two passes, as PyTorch).
pub fn layer_norm(x: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) {
    let w = gamma.len();
    for row in x.chunks_exact_mut(w) {
        let mean = row.iter().sum::<f32>() / w as f32;
        let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / w as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, g), b) in row.iter_mut().zip(gamma).zip(beta) {
            *v = (*v - mean) * inv * g + b;
        }
    }
}

/// Llama's RMSNorm: `w · x / √(mean(x²) + eps)`, row by row, into a new buffer.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    for row in y.chunks_exact_mut(w.len()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = g * (*v * inv);
        }
    }
    y
}

/// BERT's `gelu`: the exact form `x·Φ(x)` (Φ the normal CDF, through erfc), not the tanh
/// approximation. Branch-free so that it vectorises; split across the rayon pool for large
/// inputs. (`libm::erf` in f64 was a quarter of a MiniLM forward pass.)
pub fn gelu(x: &mut [f32], par: Par) {
    #[inline(always)]
    fn plain(c: &mut [f32]) {
        for v in c {
            *v *= phi(*v);
        }
    }
    // The same loop compiled for wider vectors (the crate's baseline is SSE2's four lanes).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512(c: &mut [f32]) {
        plain(c)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(c: &mut [f32]) {
        plain(c)
    }
    let run = |c: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F, checked just above.
                return unsafe { avx512(c) };
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA, checked just above.
                return unsafe { avx2(c) };
            }
        }
        plain(c)
    };
    match par {
        Par::Rayon if x.len() >= 1 << 16 => {
            use rayon::prelude::*;
            x.par_chunks_mut(1 << 14).for_each(run);
        }
        _ => run(x),
    }
}

/// The normal CDF `Φ(x) = erfc(−x/√2)/2`, with erfc from the Chebyshev fit of Numerical
/// Recipes (`erfcc`, relative error under 1.2e-7 in exact arithmetic; in f32 under 1e-6 for
/// |x| < 2, growing with x² as the rounding of the exponent does). Relative accuracy in the
/// lower tail, absolute in the upper, so `x·Φ(x)` stays within a few f32 roundings.
#[inline(always)]
pub fn phi(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let half_erfc = 0.5 * t * exp(poly - z * z);
    if x >= 0.0 {
        1.0 - half_erfc
    } else {
        half_erfc
    }
}

/// `e^y` for `y ≤ 88` (clamped below at −87, where it is under 1.7e-38 anyway): `2^n·e^r` with
/// `n = round(y·log2 e)`, `|r| ≤ ln2/2`, a degree-6 Taylor polynomial (relative error under
/// 3e-8) and the exponent written into the bits.
#[inline(always)]
fn exp(y: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer without a libm call.
    const ROUND: f32 = 12_582_912.0;
    let y = y.clamp(-87.0, 88.0);
    let n = (y * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (y - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `silu(gate) · up`, Llama's SwiGLU, into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Rows `ids` of an `(n, w)` embedding table, concatenated.
pub fn embed(table: &[f32], w: usize, ids: impl IntoIterator<Item = usize>) -> Vec<f32> {
    ids.into_iter()
        .flat_map(|i| &table[i * w..(i + 1) * w])
        .copied()
        .collect()
}

/// Rotary embedding in place on `x (tokens, heads, D)` with one position per token, in the
/// "rotate half" convention of Llama checkpoints (dimension `i` pairs with `i + D/2`).
pub fn rope(x: &mut [f32], heads: usize, d: usize, positions: &[usize], inv_freq: &[f32]) {
    let half = d / 2;
    let mut cs = vec![(0.0f32, 0.0f32); half];
    for (tok, &pos) in x.chunks_exact_mut(heads * d).zip(positions) {
        for (c, &f) in cs.iter_mut().zip(inv_freq) {
            // As transformers: the angle in f32, then cos and sin of it.
            let a = pos as f32 * f;
            *c = (a.cos(), a.sin());
        }
        for head in tok.chunks_exact_mut(d) {
            let (lo, hi) = head.split_at_mut(half);
            for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(&cs) {
                let (x1, x2) = (*a, *b);
                *a = x1 * c - x2 * s;
                *b = x2 * c + x1 * s;
            }
        }
    }
}

/// `a += b`.
pub fn add_into(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// Index of the largest value (the first of equals), as greedy decoding picks.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phi64(x: f64) -> f64 {
        0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
    }

    #[test]
    fn phi_is_accurate_in_both_tails() {
        for i in -1_400_000..=1_400_000 {
            let x = i as f32 * 1e-5;
            let (got, want) = (f64::from(phi(x)), phi64(f64::from(x)));
            // Relative in the lower tail (down to where the clamp in `exp` flushes it), growing
            // with z² = x²/2 as the f32 rounding of z and of the exponent do; a couple of f32
            // roundings of ½…1 in the upper tail.
            let z2 = f64::from(x) * f64::from(x) / 2.0;
            let tol = if want < 0.5 {
                (8e-7 + 3e-7 * z2) * want + 2e-38
            } else {
                2.5e-7
            };
            assert!((got - want).abs() <= tol, "Φ({x}) = {got}, want {want}");
        }
        assert!(phi(40.0) == 1.0 && (0.0..1e-37).contains(&phi(-40.0)));
    }

    #[test]
    fn gelu_matches_the_f64_formula() {
        let mut x: Vec<f32> = (-20_000..20_000).map(|i| i as f32 * 5e-4).collect();
        let want: Vec<f64> = x
            .iter()
            .map(|&v| {
                let t = f64::from(v);
                t * phi64(t)
            })
            .collect();
        gelu(&mut x, Par::Seq);
        for (g, w) in x.iter().zip(&want) {
            assert!(
                (f64::from(*g) - w).abs() <= 2e-7 * w.abs().max(1.0),
                "{g} vs {w}"
            );
        }
    }
}
