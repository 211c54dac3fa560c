//! Training: a forward pass that keeps what the backward needs (a [`Tape`]) and the backward
//! through the output projection, the fused attention ([`crate::sdpa_backward`]) and the Q/K/V
//! projections, giving the gradients of the inputs and of every parameter.

use super::core::Core;
use super::masks::sdpa_masks;
use super::options::{LayerOutput, MhaOptions};
use crate::alloc::zeros_for;
use crate::backward::{sdpa_backward, Saved};
use crate::error::{AttnError, Result};
use crate::exec::resolve_isa;
use crate::gemm::sgemm;
use crate::layers::linear::{project, Exec, Linear};
use crate::layers::tokens::swap_outer;
use crate::layers::{StateDict, Tokens};
use crate::options::{Extras, SdpaOptions};
use crate::view::{Tensor, TensorMut};

/// What a layer's training forward keeps for its backward: dense batch-first copies of the
/// inputs, the Q/K/V projections, the attention output before the output projection, and the
/// attention's logsumexp. Memory: `O(B·L·E)`, never `Lq × Lk`.
#[derive(Clone, Debug)]
pub struct Tape {
    b: usize,
    lq: usize,
    lk: usize,
    seq_first: [bool; 3],
    x: [Vec<f32>; 3],
    proj: [Vec<f32>; 3],
    ctx: Vec<f32>,
    lse: Vec<f32>,
}

/// The gradients of a layer's backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerGrads {
    /// Of `query`, dense in its memory order.
    pub dquery: Vec<f32>,
    /// Of `key`, dense in its memory order.
    pub dkey: Vec<f32>,
    /// Of `value`, dense in its memory order.
    pub dvalue: Vec<f32>,
    /// Of every parameter, under the names of the layer's `state_dict` (PyTorch's).
    pub params: StateDict,
}

impl LayerGrads {
    /// The gradient of the one input of self-attention (query, key and value the same tensor):
    /// the sum of the three.
    ///
    /// # Panics
    /// If the three inputs' gradients differ in length (they were not one tensor).
    pub fn input(&self) -> Vec<f32> {
        assert!(
            self.dquery.len() == self.dkey.len() && self.dkey.len() == self.dvalue.len(),
            "query, key and value were not one tensor"
        );
        self.dquery
            .iter()
            .zip(&self.dkey)
            .zip(&self.dvalue)
            .map(|((a, b), c)| a + b + c)
            .collect()
    }
}

/// Dense `(B, L, n)` rows to the memory order of a (seq-first or batch-first) tensor.
fn to_order(y: Vec<f32>, [b, l, n]: [usize; 3], seq_first: bool) -> Vec<f32> {
    if seq_first {
        swap_outer(&y, [b, l, n])
    } else {
        y
    }
}

/// `C (m × n) = Aᵀ·B` for dense row-major `A (k × m)`, `B (k × n)`: a weight gradient.
pub(crate) fn at_b(a: &[f32], b: &[f32], k: usize, m: usize, n: usize) -> Result<Vec<f32>> {
    let mut c = zeros_for("gradient", &[m, n])?;
    // SAFETY: dense row-major operands of the stated extents.
    unsafe {
        sgemm(
            crate::gemm::Backend::default(),
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            1,
            m as isize,
            b.as_ptr(),
            n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    };
    Ok(c)
}

/// `C (m × n) = A·B` for dense row-major `A (m × k)` and `B (k × n)` (row stride `ldb`).
pub(crate) fn a_b(
    a: &[f32],
    b: &[f32],
    ldb: usize,
    m: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>> {
    let mut c = zeros_for("gradient", &[m, n])?;
    // SAFETY: dense row-major operands of the stated extents (`b` rows `ldb` apart).
    unsafe {
        sgemm(
            crate::gemm::Backend::default(),
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            ldb as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    };
    Ok(c)
}

/// Column sums of dense `(rows × n)`: a bias gradient.
pub(crate) fn col_sums(x: &[f32], n: usize) -> Vec<f32> {
    let mut s = vec![0.0; n];
    for row in x.chunks_exact(n.max(1)) {
        s.iter_mut().zip(row).for_each(|(a, b)| *a += b);
    }
    s
}

impl Core {
    /// The SDPA options of a forward or backward call on `b` sequences.
    fn attn_opts<'s>(&self, opts: &MhaOptions<'s>) -> Result<SdpaOptions<'s>> {
        Ok(SdpaOptions {
            isa: Some(resolve_isa(opts.isa)?),
            par: opts.par,
            causal: opts.causal,
            alibi: opts.alibi,
            softcap: opts.softcap,
            sinks: opts.sinks,
            ..SdpaOptions::default()
        })
    }

    /// The forward pass keeping a [`Tape`]; the output as [`Core::forward`] gives it (no
    /// weights).
    pub(crate) fn forward_train(
        &self,
        query: &Tokens,
        key: &Tokens,
        value: &Tokens,
        opts: &MhaOptions,
    ) -> Result<(LayerOutput, Tape)> {
        let [q, k, v] = self.e_in.map(Some);
        crate::layers::check_qkv(["query", "key", "value"], [query, key, value], [q, k, v])?;
        let [b, lq, _] = query.shape;
        let lk = key.shape[1];
        let (h, hkv, d, dv) = (self.h, self.hkv, self.d, self.dv);
        let masks = sdpa_masks(opts, b, h, lq, lk)?;
        let mut so = self.attn_opts(opts)?;
        masks.apply(&mut so);
        let exec = Exec {
            par: opts.par,
            backend: opts.backend,
        };
        let x = [query.dense_ble()?, key.dense_ble()?, value.dense_ble()?];
        let lens = [lq, lk, lk];
        let mut proj: [Vec<f32>; 3] = Default::default();
        for p in 0..3 {
            let (e, rows) = (self.e_in[p], self.rows(p));
            let mut y = zeros_for("projection", &[b, lens[p], rows])?;
            let bias = self
                .bias
                .as_deref()
                .map(|bias| &bias[self.b_off(p)..self.b_off(p) + rows]);
            let xt = Tokens::ble(&x[p], [b, lens[p], e]);
            // SAFETY: `xt` is dense (validated by construction); part `p` of `w` has `rows`
            // rows of `e` columns; `y` is dense `(B, L, rows)`.
            unsafe {
                project(
                    exec,
                    &xt,
                    &self.w[self.w_off(p)..],
                    e,
                    rows,
                    bias,
                    y.as_mut_ptr(),
                    [lens[p] * rows, rows],
                )
            };
            proj[p] = y;
        }
        let mut ctx = zeros_for("context", &[b, lq, h, dv])?;
        let mut lse = zeros_for("lse", &[b, h, lq])?;
        crate::sdpa_ext(
            &Tensor::blhd(&proj[0], [b, lq, h, d]),
            &Tensor::blhd(&proj[1], [b, lk, hkv, d]),
            &Tensor::blhd(&proj[2], [b, lk, hkv, dv]),
            &mut TensorMut::blhd(&mut ctx, [b, lq, h, dv]),
            &so,
            Extras {
                lse: Some(&mut lse),
                weights: None,
            },
        )?;
        let ew = self.out_width();
        let y = match &self.out {
            None => ctx.clone(),
            Some(o) => {
                let mut y = zeros_for("out", &[b, lq, ew])?;
                let ct = Tokens::ble(&ctx, [b, lq, h * dv]);
                // SAFETY: `ct` is dense; the weight is `ew × H·dv`; `y` is dense `(B, Lq, ew)`.
                unsafe {
                    project(
                        exec,
                        &ct,
                        &o.weight,
                        h * dv,
                        ew,
                        o.bias.as_deref(),
                        y.as_mut_ptr(),
                        [lq * ew, ew],
                    )
                };
                y
            }
        };
        let sf = query.is_seq_first();
        let shape = if sf { [lq, b, ew] } else { [b, lq, ew] };
        let out = LayerOutput {
            out: to_order(y, [b, lq, ew], sf),
            shape,
            weights: None,
            weights_shape: vec![],
        };
        let tape = Tape {
            b,
            lq,
            lk,
            seq_first: [sf, key.is_seq_first(), value.is_seq_first()],
            x,
            proj,
            ctx,
            lse,
        };
        Ok((out, tape))
    }

    /// The backward pass: `dy` is the gradient of the output, dense in the output's memory
    /// order; `opts` must be the forward's. Returns the input gradients and a core holding the
    /// parameter gradients in the parameters' places.
    pub(crate) fn backward(
        &self,
        tape: &Tape,
        dy: &[f32],
        opts: &MhaOptions,
    ) -> Result<(Core, [Vec<f32>; 3])> {
        let Tape { b, lq, lk, .. } = *tape;
        let (h, hkv, d, dv) = (self.h, self.hkv, self.d, self.dv);
        let ew = self.out_width();
        let needed = crate::alloc::checked_len("dy", &[b, lq, ew])?;
        if dy.len() != needed {
            return Err(AttnError::BufferLength {
                arg: "dy",
                needed,
                got: dy.len(),
            });
        }
        let masks = sdpa_masks(opts, b, h, lq, lk)?;
        let mut so = self.attn_opts(opts)?;
        masks.apply(&mut so);
        // dy to batch-first rows.
        let dyb = if tape.seq_first[0] {
            swap_outer(dy, [lq, b, ew])
        } else {
            dy.to_vec()
        };
        let n = b * lq;
        let (dctx, out) = match &self.out {
            None => (dyb, None),
            Some(o) => {
                let dw = at_b(&dyb, &tape.ctx, n, ew, h * dv)?;
                let db = o.bias.as_ref().map(|_| col_sums(&dyb, ew));
                let dctx = a_b(&dyb, &o.weight, h * dv, n, ew, h * dv)?;
                let lin = Linear {
                    weight: dw,
                    bias: db,
                    out_features: ew,
                    in_features: h * dv,
                };
                (dctx, Some(lin))
            }
        };
        let lens = [lq, lk, lk];
        let mut dproj = [
            zeros_for("dq", &[b, lq, h * d])?,
            zeros_for("dk", &[b, lk, hkv * d])?,
            zeros_for("dv", &[b, lk, hkv * dv])?,
        ];
        {
            let [dq, dk, dvv] = &mut dproj;
            let saved = Saved {
                q: Tensor::blhd(&tape.proj[0], [b, lq, h, d]),
                k: Tensor::blhd(&tape.proj[1], [b, lk, hkv, d]),
                v: Tensor::blhd(&tape.proj[2], [b, lk, hkv, dv]),
                out: Tensor::blhd(&tape.ctx, [b, lq, h, dv]),
                lse: &tape.lse,
            };
            sdpa_backward(
                &saved,
                &Tensor::blhd(&dctx, [b, lq, h, dv]),
                &mut TensorMut::blhd(dq, [b, lq, h, d]),
                &mut TensorMut::blhd(dk, [b, lk, hkv, d]),
                &mut TensorMut::blhd(dvv, [b, lk, hkv, dv]),
                &so,
            )?;
        }
        let mut w = Vec::with_capacity(self.w.len());
        let mut bias = self.bias.as_ref().map(|x| Vec::with_capacity(x.len()));
        let mut dx: [Vec<f32>; 3] = Default::default();
        for p in 0..3 {
            let (e, rows, l) = (self.e_in[p], self.rows(p), lens[p]);
            w.extend(at_b(&dproj[p], &tape.x[p], b * l, rows, e)?);
            if let Some(bs) = &mut bias {
                bs.extend(col_sums(&dproj[p], rows));
            }
            let wp = &self.w[self.w_off(p)..self.w_off(p) + rows * e];
            let g = a_b(&dproj[p], wp, e, b * l, rows, e)?;
            dx[p] = to_order(g, [b, l, e], tape.seq_first[p]);
        }
        let grads = Core {
            e_in: self.e_in,
            h,
            hkv,
            d,
            dv,
            w,
            bias,
            out,
        };
        Ok((grads, dx))
    }
}
