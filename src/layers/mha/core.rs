//! The projections and attention shared by the layers: Q/K/V projections into `(B, L, ·)`
//! buffers, the fused kernel (or the unfused baseline) on per-head strided views of them, and the
//! output projection.

use super::masks::sdpa_masks;
use super::options::{Fusion, LayerOutput, MhaOptions, Weights};
use crate::alloc::zeros_for;
use crate::error::{AttnError, Result};
use crate::layers::linear::{project, Exec, Linear};
use crate::layers::{check_qkv, product, Tokens};
use crate::options::{Extras, SdpaOptions};
use crate::view::{Tensor, TensorMut};

/// The projections and attention shared by [`crate::MultiheadAttention`] and
/// [`crate::SelfAttention`]: `H` query heads of width `d`, `Hkv` KV heads (key width `d`, value width `dv`), the three
/// projection matrices stored back to back, `[W_q (H·d × e_q); W_k (Hkv·d × e_k);
/// W_v (Hkv·dv × e_v)]` (PyTorch's packed `in_proj_weight` when the widths agree), and an
/// optional output projection.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Core {
    pub(crate) e_in: [usize; 3],
    pub(crate) h: usize,
    pub(crate) hkv: usize,
    pub(crate) d: usize,
    pub(crate) dv: usize,
    pub(crate) w: Vec<f32>,
    pub(crate) bias: Option<Vec<f32>>,
    pub(crate) out: Option<Linear>,
}

/// Projected activations of one or more of q/k/v, rows in their input's memory order.
struct Proj {
    buf: Vec<f32>,
    /// Row width (the parts side by side).
    width: usize,
    /// Row strides `(b, l)`.
    strides: [usize; 2],
}

impl Core {
    /// Rows of projection part `p` (0 = q, 1 = k, 2 = v).
    pub(super) fn rows(&self, p: usize) -> usize {
        [self.h * self.d, self.hkv * self.d, self.hkv * self.dv][p]
    }
    /// Offset of part `p` in `w`.
    pub(super) fn w_off(&self, p: usize) -> usize {
        (0..p).map(|i| self.rows(i) * self.e_in[i]).sum()
    }
    /// Offset of part `p` in `bias`.
    pub(super) fn b_off(&self, p: usize) -> usize {
        (0..p).map(|i| self.rows(i)).sum()
    }
    /// Width of the layer output.
    pub(crate) fn out_width(&self) -> usize {
        self.out
            .as_ref()
            .map_or(self.h * self.dv, |o| o.out_features)
    }

    /// Projects `x` with parts `p0..p1` (consecutive, same input width) in one GEMM.
    fn project_parts(&self, exec: Exec, x: &Tokens, p0: usize, p1: usize) -> Result<Proj> {
        let [b, l, k] = x.shape;
        let width: usize = (p0..p1).map(|p| self.rows(p)).sum();
        let mut buf = zeros_for("projection", &[b, l, width])?;
        let strides = x.dense_strides(width);
        let bias = self
            .bias
            .as_deref()
            .map(|bias| &bias[self.b_off(p0)..self.b_off(p0) + width]);
        // SAFETY: `x` was validated with width `k = e_in[p0]`; parts `p0..p1` are consecutive
        // rows of `w` with `k` columns; `buf` is dense `(B, L, width)` in `x`'s order.
        unsafe {
            project(
                exec,
                x,
                &self.w[self.w_off(p0)..],
                k,
                width,
                bias,
                buf.as_mut_ptr(),
                strides,
            )
        };
        Ok(Proj {
            buf,
            width,
            strides,
        })
    }

    fn check_inputs(&self, query: &Tokens, key: &Tokens, value: &Tokens) -> Result<()> {
        let [q, k, v] = self.e_in.map(Some);
        check_qkv(["query", "key", "value"], [query, key, value], [q, k, v])
    }

    /// The forward pass into `out` (dense, query order) and optionally `weights`.
    pub(crate) fn forward_into(
        &self,
        query: &Tokens,
        key: &Tokens,
        value: &Tokens,
        out: &mut [f32],
        weights: Option<&mut [f32]>,
        opts: &MhaOptions,
    ) -> Result<()> {
        let isa = crate::exec::resolve_isa(opts.isa)?;
        self.check_inputs(query, key, value)?;
        let [b, lq, _] = query.shape;
        let lk = key.shape[1];
        let ew = self.out_width();
        let needed = product("out", &[b, lq, ew])?;
        if out.len() != needed {
            return Err(AttnError::BufferLength {
                arg: "out",
                needed,
                got: out.len(),
            });
        }
        let (h, hkv, d, dv) = (self.h, self.hkv, self.d, self.dv);
        let average = opts.weights != Weights::PerHead;
        if let Some(w) = weights.as_deref() {
            let needed = if average {
                product("attn_weights", &[b, lq, lk])?
            } else {
                product("attn_weights", &[b, h, lq, lk])?
            };
            if w.len() != needed {
                return Err(AttnError::BufferLength {
                    arg: "attn_weights",
                    needed,
                    got: w.len(),
                });
            }
            if opts.fusion == Fusion::Unfused {
                return Err(AttnError::BadParam {
                    arg: "weights",
                    reason: "the unfused path returns no weights",
                });
            }
        }
        let masks = sdpa_masks(opts, b, h, lq, lk)?;
        let exec = Exec {
            par: opts.par,
            backend: opts.backend,
        };

        // Projections: one GEMM per distinct input, over as many consecutive parts as share it.
        let same_kv = key.same_as(value) && self.e_in[1] == self.e_in[2];
        let (qp, kp, vp, offs) = if same_kv && query.same_as(key) && self.e_in[0] == self.e_in[1] {
            let all = self.project_parts(exec, query, 0, 3)?;
            (
                Some(all),
                None,
                None,
                [0, self.rows(0), self.rows(0) + self.rows(1)],
            )
        } else if same_kv {
            let q = self.project_parts(exec, query, 0, 1)?;
            let kv = self.project_parts(exec, key, 1, 3)?;
            (Some(q), Some(kv), None, [0, 0, self.rows(1)])
        } else {
            let q = self.project_parts(exec, query, 0, 1)?;
            let k = self.project_parts(exec, key, 1, 2)?;
            let v = self.project_parts(exec, value, 2, 3)?;
            (Some(q), Some(k), Some(v), [0, 0, 0])
        };
        let qp = qp.expect("query projection");
        let kp = kp.as_ref().unwrap_or(&qp);
        let vp = vp.as_ref().unwrap_or(kp);
        // Per-head views: head `h` is columns `[h·d, (h+1)·d)` of its part; a stride, no copy.
        fn view(p: &Proj, off: usize, shape: [usize; 4]) -> Tensor<'_> {
            Tensor::strided(
                &p.buf[off.min(p.buf.len())..],
                shape,
                [p.strides[0], shape[3], p.strides[1]],
            )
        }
        let (qv, kv, vv) = (
            view(&qp, offs[0], [b, h, lq, d]),
            view(kp, offs[1], [b, hkv, lk, d]),
            view(vp, offs[2], [b, hkv, lk, dv]),
        );
        debug_assert!(qp.width >= offs[0] + h * d);

        let mut sdpa_opts = SdpaOptions {
            isa: Some(isa),
            par: opts.par,
            alibi: opts.alibi,
            softcap: opts.softcap,
            sinks: opts.sinks,
            ..SdpaOptions::default()
        };
        sdpa_opts.causal = opts.causal;
        masks.apply(&mut sdpa_opts);

        let mut per_head = None;
        let mut weights = weights;
        let extras_weights: Option<&mut [f32]> = match weights.as_deref_mut() {
            Some(w) if !average || h == 1 => Some(w),
            Some(_) => {
                per_head = Some(zeros_for("attn_weights", &[b, h, lq, lk])?);
                per_head.as_deref_mut()
            }
            None => None,
        };
        let qdense = query.dense_strides(h * dv);
        let mut ctx = Vec::new();
        let target: &mut [f32] = match &self.out {
            None => &mut *out,
            Some(_) => {
                ctx = zeros_for("context", &[b, lq, h, dv])?;
                &mut ctx
            }
        };
        let mut ov = TensorMut::strided(target, [b, h, lq, dv], [qdense[0], dv, qdense[1]]);
        match opts.fusion {
            Fusion::Fused => {
                let extras = Extras {
                    lse: None,
                    weights: extras_weights,
                };
                crate::sdpa_ext(&qv, &kv, &vv, &mut ov, &sdpa_opts, extras)?
            }
            Fusion::Unfused => {
                crate::unfused::sdpa_unfused_with(&qv, &kv, &vv, &mut ov, &sdpa_opts, opts.backend)?
            }
        }
        if let Some(o) = &self.out {
            let ct = Tokens::strided(&ctx, [b, lq, h * dv], qdense);
            // SAFETY: `ct` covers `ctx` exactly; the weight is `ew × H·dv` dense; `out` is dense
            // `(B, Lq, ew)` in the query's order (length checked above).
            unsafe {
                project(
                    exec,
                    &ct,
                    &o.weight,
                    h * dv,
                    ew,
                    o.bias.as_deref(),
                    out.as_mut_ptr(),
                    query.dense_strides(ew),
                )
            };
        }
        if let (Some(src), Some(dst)) = (per_head, weights) {
            average_heads(&src, dst, b, h, lq * lk);
        }
        Ok(())
    }

    pub(crate) fn forward(
        &self,
        query: &Tokens,
        key: &Tokens,
        value: &Tokens,
        opts: &MhaOptions,
    ) -> Result<LayerOutput> {
        self.check_inputs(query, key, value)?;
        let [b, lq, _] = query.shape;
        let (h, lk) = (self.h, key.shape[1]);
        let ew = self.out_width();
        let mut out = zeros_for("out", &[b, lq, ew])?;
        let shape = if query.is_seq_first() {
            [lq, b, ew]
        } else {
            [b, lq, ew]
        };
        let weights_shape = match opts.weights {
            Weights::None => vec![],
            Weights::Averaged => vec![b, lq, lk],
            Weights::PerHead => vec![b, h, lq, lk],
        };
        let mut weights = if opts.weights != Weights::None {
            Some(zeros_for("attn_weights", &weights_shape)?)
        } else {
            None
        };
        self.forward_into(query, key, value, &mut out, weights.as_deref_mut(), opts)?;
        Ok(LayerOutput {
            out,
            shape,
            weights,
            weights_shape,
        })
    }
}

/// `dst[b, x] = mean_h src[b, h, x]` over `n` elements `x` per head.
fn average_heads(src: &[f32], dst: &mut [f32], b: usize, h: usize, n: usize) {
    let inv = 1.0 / h as f32;
    for bi in 0..b {
        let d = &mut dst[bi * n..(bi + 1) * n];
        d.copy_from_slice(&src[bi * h * n..bi * h * n + n]);
        for hi in 1..h {
            let s = &src[(bi * h + hi) * n..(bi * h + hi + 1) * n];
            d.iter_mut().zip(s).for_each(|(a, &x)| *a += x);
        }
        d.iter_mut().for_each(|a| *a *= inv);
    }
}
