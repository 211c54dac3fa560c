//! A naive f64 attention, written from attnkit's documented semantics, and the comparisons of
//! a call's results against it.

use crate::problem::{Dims, MaskSpec};
use attnkit::Causal;

/// Relative rounding of one f32 step in the kernels' score computation (4 ulp), scaled below by
/// the number of terms and the magnitude of the products, for the error allowance of a row.
const LOGIT_EPS: f64 = 4.0 * f32::EPSILON as f64;

/// What decides which keys a query sees, and how scores are formed.
#[derive(Clone, Copy, Debug)]
pub struct Spec<'a> {
    pub dims: Dims,
    pub scale: f64,
    pub causal: Option<Causal>,
    pub window: Option<usize>,
    pub key_lengths: Option<&'a [usize]>,
    pub mask: Option<&'a MaskSpec>,
    /// ALiBi slopes per query head (aligned as the causal mask, bottom-right without one).
    pub alibi: Option<&'a [f32]>,
    /// `cap·tanh(x/cap)` on the scaled score, before bias and masks.
    pub softcap: Option<f32>,
    /// Sink logits per query head: in each row's softmax denominator, with no value.
    pub sinks: Option<&'a [f32]>,
}

/// Reference results, rows `r = (b·Hq + h)·Lq + i`.
#[derive(Clone, Debug)]
pub struct Expected {
    /// `(B, Hq, Lq, Dv)`.
    pub out: Vec<f64>,
    /// `(B, Hq, Lq)`, natural log; `-inf` for a fully masked row.
    pub lse: Vec<f64>,
    /// `(B, Hq, Lq, Lk)`.
    pub weights: Vec<f64>,
    /// Per row: how far an f32 score may be off (scores in units of the logit).
    slack: Vec<f64>,
    /// Per row: the largest |v| among visible keys.
    vmax: Vec<f64>,
    dims: Dims,
}

impl Spec<'_> {
    /// Whether key `j` is visible to query `i` of batch `b` (before the mask).
    pub fn visible(&self, b: usize, i: usize, j: usize) -> bool {
        let key_len = self.key_lengths.map_or(self.dims.lk, |l| l[b]);
        if j >= key_len {
            return false;
        }
        let Some(causal) = self.causal else {
            return true;
        };
        let offset = match causal {
            Causal::TopLeft => 0,
            Causal::BottomRight => key_len as i128 - self.dims.lq as i128,
            Causal::BottomRightAtLk => self.dims.lk as i128 - self.dims.lq as i128,
        };
        let diag = i as i128 + offset;
        let (j, w) = (j as i128, self.window.map(|w| w as i128));
        j <= diag && w.is_none_or(|w| j > diag - w)
    }

    /// Softmax attention of every row. `q(b, h, i, x)`, `k(b, hk, j, x)`, `v(b, hk, j, x)`.
    ///
    /// The operands are read once into dense arrays: the accessors are the targets' closures,
    /// compiled (and traced for coverage) in each target, and called per multiply-add they took
    /// two thirds of an execution.
    pub fn attention(
        &self,
        q: impl Fn(usize, usize, usize, usize) -> f64,
        k: impl Fn(usize, usize, usize, usize) -> f64,
        v: impl Fn(usize, usize, usize, usize) -> f64,
    ) -> Expected {
        let Dims {
            b,
            hq,
            hkv,
            lq,
            lk,
            d,
            dv,
        } = self.dims;
        // With no rows nothing is read, and K and V may be huge broadcast views.
        if b * hq * lq == 0 {
            return self.attention_dense(&[], &[], &[]);
        }
        let dense = |f: &dyn Fn(usize, usize, usize, usize) -> f64, h, l, n| {
            let mut a = Vec::with_capacity(b * h * l * n);
            for bi in 0..b {
                for hi in 0..h {
                    for li in 0..l {
                        a.extend((0..n).map(|x| f(bi, hi, li, x)));
                    }
                }
            }
            a
        };
        self.attention_dense(
            &dense(&q, hq, lq, d),
            &dense(&k, hkv, lk, d),
            &dense(&v, hkv, lk, dv),
        )
    }

    /// [`Self::attention`] on dense `(B, H, L, D)` arrays.
    fn attention_dense(&self, q: &[f64], k: &[f64], v: &[f64]) -> Expected {
        let Dims {
            b: nb,
            hq,
            hkv,
            lq,
            lk,
            d,
            dv,
        } = self.dims;
        let rows = nb * hq * lq;
        let mut e = Expected {
            out: vec![0.0; rows * dv],
            lse: vec![f64::NEG_INFINITY; rows],
            weights: vec![0.0; rows * lk],
            slack: vec![0.0; rows],
            vmax: vec![0.0; rows],
            dims: self.dims,
        };
        let group = hq / hkv.max(1);
        // With no rows (B, Hq or Lq zero) nothing bounds Lk: it may be huge.
        let mut logits = vec![None; if rows == 0 { 0 } else { lk }];
        for b in 0..nb {
            for h in 0..hq {
                let hk = h / group;
                for i in 0..lq {
                    let r = (b * hq + h) * lq + i;
                    let mut mag = 0.0f64;
                    for (j, logit) in logits.iter_mut().enumerate() {
                        let bias = match self.mask {
                            Some(m) => m.bias(b, h, i, j),
                            None => Some(0.0),
                        };
                        *logit = bias.filter(|_| self.visible(b, i, j)).map(|bias| {
                            let (mut dot, mut abs) = (0.0, 0.0);
                            let qr = &q[((b * hq + h) * lq + i) * d..][..d];
                            let kr = &k[((b * hkv + hk) * lk + j) * d..][..d];
                            for (&qx, &kx) in qr.iter().zip(kr) {
                                let p = qx * kx;
                                dot += p;
                                abs += p.abs();
                            }
                            let mut x = self.scale * dot;
                            let mut m = self.scale.abs() * abs;
                            if let Some(c) = self.softcap.map(f64::from) {
                                x = c * (x / c).tanh();
                                m = m.min(c) + c;
                            }
                            let key_len = self.key_lengths.map_or(lk, |l| l[b]);
                            let alibi = self.alibi.map_or(0.0, |a| {
                                let off = match self.causal {
                                    Some(Causal::TopLeft) => 0.0,
                                    Some(Causal::BottomRightAtLk) => lk as f64 - lq as f64,
                                    _ => key_len as f64 - lq as f64,
                                };
                                -f64::from(a[h]) * (i as f64 + off - j as f64).abs()
                            });
                            mag = mag.max(m + bias.abs() + alibi.abs());
                            x + bias + alibi
                        });
                    }
                    e.slack[r] = LOGIT_EPS * (d as f64 + 2.0) * mag;
                    let sink = self.sinks.map_or(f64::NEG_INFINITY, |x| f64::from(x[h]));
                    let mx = logits.iter().flatten().copied().fold(sink, f64::max);
                    if mx == f64::NEG_INFINITY {
                        continue;
                    }
                    let sum: f64 = logits.iter().flatten().map(|s| (s - mx).exp()).sum::<f64>()
                        + (sink - mx).exp();
                    e.lse[r] = mx + sum.ln();
                    for (j, s) in logits.iter().enumerate() {
                        let Some(s) = s else { continue };
                        let p = (s - mx).exp() / sum;
                        e.weights[r * lk + j] = p;
                        let vr = &v[((b * hkv + hk) * lk + j) * dv..][..dv];
                        for (x, &vx) in vr.iter().enumerate() {
                            e.vmax[r] = e.vmax[r].max(vx.abs());
                            e.out[r * dv + x] += p * vx;
                        }
                    }
                }
            }
        }
        e
    }
}

/// Panics unless `got` is within `1e-4·(1 + |want|) + slack` of `want` (infinities exactly).
fn assert_close(what: &str, at: &dyn std::fmt::Debug, got: f32, want: f64, slack: f64) {
    let ok = if want.is_infinite() {
        f64::from(got) == want
    } else {
        (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()) + slack
    };
    assert!(
        ok,
        "{what}{at:?}: got {got}, reference {want} (allowance {slack:e})"
    );
}

impl Expected {
    /// Compares the output; `got(b, h, i, x)` reads the call's output view.
    pub fn check_out(&self, what: &str, got: impl Fn(usize, usize, usize, usize) -> f32) {
        let Dims { b, hq, lq, dv, .. } = self.dims;
        for r in 0..b * hq * lq {
            let (bi, h, i) = (r / (hq * lq), r / lq % hq, r % lq);
            let slack = 2.0 * self.slack[r] * self.vmax[r];
            for x in 0..dv {
                let want = self.out[r * dv + x];
                assert_close(what, &(bi, h, i, x), got(bi, h, i, x), want, slack);
            }
        }
    }

    /// Compares the logsumexp of every row.
    pub fn check_lse(&self, got: &[f32]) {
        assert_eq!(got.len(), self.lse.len(), "lse length");
        for (r, (&g, &w)) in got.iter().zip(&self.lse).enumerate() {
            assert_close("lse", &r, g, w, 2.0 * self.slack[r]);
        }
    }

    /// Compares the attention weights.
    pub fn check_weights(&self, got: &[f32]) {
        assert_eq!(got.len(), self.weights.len(), "weights length");
        let lk = self.dims.lk;
        for (n, (&g, &w)) in got.iter().zip(&self.weights).enumerate() {
            let r = n / lk;
            assert_close("weights", &(r, n % lk), g, w, 2.0 * self.slack[r]);
        }
    }
}
