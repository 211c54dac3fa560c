//! Naive f64 twins of the kernels: the specification every ISA path is tested against.
//! Written for obviousness, not speed.

use crate::ScoreSpec;

/// `2^x` in f64 (the spec of [`crate::exp2_slice`]).
pub fn exp2(x: f64) -> f64 {
    x.exp2()
}

/// Stable softmax of one row in f64; a row of all `-inf` gives zeros.
pub fn softmax_row(x: &[f64]) -> Vec<f64> {
    let mx = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if mx == f64::NEG_INFINITY {
        return vec![0.0; x.len()];
    }
    let e: Vec<f64> = x.iter().map(|v| (v - mx).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// `Y[m × n] = X[m × k] · Wᵀ` in f64, `W` being `n × k` row-major (the spec of
/// [`crate::rows_dot`]).
pub fn rows_dot(
    m: usize,
    k: usize,
    n: usize,
    x: &[f32],
    ldx: usize,
    w: &[f32],
    ldw: usize,
) -> Vec<f64> {
    (0..m)
        .flat_map(|r| {
            (0..n).map(move |c| {
                (0..k)
                    .map(|p| x[r * ldx + p] as f64 * w[c * ldw + p] as f64)
                    .sum()
            })
        })
        .collect()
}

/// `C[m × n] = A[m × k] · B[k × n]` in f64 (row-major with leading dimensions).
pub fn matmul(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| a[i * lda + p] as f64 * b[p * ldb + j] as f64)
                .sum();
        }
    }
    c
}

/// One head of attention in f64. `logit(i, j)` returns the scaled and biased score of query `i`
/// and key `j`, or `None` if the pair is masked. Returns (output `lq × dv`, logsumexp per row,
/// weights `lq × lk`). Fully masked rows give zero output, zero weights and lse = −inf.
pub fn attention_head(
    lq: usize,
    lk: usize,
    dv: usize,
    logit: impl Fn(usize, usize) -> Option<f64>,
    v: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    attention_head_with_sink(lq, lk, dv, None, logit, v)
}

/// The logit of local row `r` and key `j` under `spec` for the scaled score `x`, or `None` if
/// the key is hidden: `bias` and `attend` are the row's bias and bool-mask entries for `j` (0 and
/// true where the spec has none). Visibility is spelled out here, independently of
/// [`crate::visible_range`].
pub fn logit(spec: &ScoreSpec, r: usize, j: usize, x: f64, bias: f64, attend: bool) -> Option<f64> {
    let i = (spec.row0 + r) as f64;
    let jf = j as f64;
    if j >= spec.key_len || !attend {
        return None;
    }
    if let Some(off) = spec.causal {
        if jf > i + off as f64 {
            return None;
        }
        if spec.window.is_some_and(|w| jf <= i + off as f64 - w as f64) {
            return None;
        }
    }
    let mut s = match spec.softcap {
        Some(cap) => cap as f64 * (x / cap as f64).tanh(),
        None => x,
    };
    s += bias;
    if let Some(a) = spec.alibi {
        s -= a.slope as f64 * (i + a.offset as f64 - jf).abs();
    }
    Some(s)
}

/// [`attention_head`] with an optional attention-sink logit that joins every row's softmax
/// denominator and carries no value (the lse includes it; a row with no visible key still gives
/// zeros, and its lse is the sink).
pub fn attention_head_with_sink(
    lq: usize,
    lk: usize,
    dv: usize,
    sink: Option<f64>,
    logit: impl Fn(usize, usize) -> Option<f64>,
    v: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; lq * dv];
    let mut lse = vec![f64::NEG_INFINITY; lq];
    let mut w = vec![0.0; lq * lk];
    for i in 0..lq {
        let s: Vec<f64> = (0..lk)
            .map(|j| logit(i, j).unwrap_or(f64::NEG_INFINITY))
            .collect();
        let sk = sink.unwrap_or(f64::NEG_INFINITY);
        let mx = s.iter().cloned().fold(sk, f64::max);
        if mx == f64::NEG_INFINITY {
            continue;
        }
        let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum::<f64>() + (sk - mx).exp();
        lse[i] = mx + sum.ln();
        for j in 0..lk {
            let p = (s[j] - mx).exp() / sum;
            w[i * lk + j] = p;
            for c in 0..dv {
                out[i * dv + c] += p * v(j, c);
            }
        }
    }
    (out, lse, w)
}
