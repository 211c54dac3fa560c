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

/// BERT's `gelu`: the exact form `x·Φ(x)`, with erf (not the tanh approximation).
pub fn gelu(x: &mut [f32]) {
    for v in x {
        let t = f64::from(*v);
        *v = (0.5 * t * (1.0 + libm::erf(t / std::f64::consts::SQRT_2))) as f32;
    }
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
