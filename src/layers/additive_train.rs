//! Training [`AdditiveAttention`]: a forward that keeps its inputs and attention weights, and the
//! backward through the softmax, the `vᵀ·tanh(·)` scores and the two projections.
//!
//! With `t_ij = tanh(q′_i + k′_j)` (`q′ = W_q·q + b`, `k′ = W_k·k`), `P` the weights and
//! `dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))`: `dV = Pᵀ·dO`, `dv = Σ_ij dS_ij·t_ij`,
//! `dq′_i = Σ_j dS_ij·v ∘ (1 − t_ij²)`, `dk′_j = Σ_i dS_ij·v ∘ (1 − t_ij²)`, then
//! `dW_q = dq′ᵀ·q`, `db = Σ_i dq′_i`, `dW_k = dk′ᵀ·k`, `dq = dq′·W_q`, `dk = dk′·W_k`.
//! The `(B, Lq, Lk, A)` tensor of `t` is recomputed a row at a time, never stored.

use super::additive::{AdditiveAttention, AdditiveOptions, AdditiveOutput};
use super::linear::{project, Exec};
use super::mha::{a_b, at_b, LayerGrads};
use super::tokens::swap_outer;
use super::Tokens;
use crate::alloc::zeros_for;
use crate::error::{AttnError, Result};
use crate::gemm::Backend;
use crate::options::Par;

/// What [`AdditiveAttention::forward_train`] keeps: dense batch-first copies of the inputs and
/// the output, the attention weights `(B, Lq, Lk)` (the layer's sequences are short: the
/// weights are what its backward reuses), and the inputs' memory orders.
#[derive(Clone, Debug)]
pub struct AdditiveTape {
    dims: [usize; 4], // B, Lq, Lk, Dv
    seq_first: [bool; 3],
    x: [Vec<f32>; 3],
    out: Vec<f32>,
    weights: Vec<f32>,
}

impl AdditiveAttention {
    /// [`AdditiveAttention::forward`] for training: also returns the [`AdditiveTape`] that
    /// [`AdditiveAttention::backward`] needs. `opts.need_*` are ignored (the weights are kept in
    /// the tape; `need_weights` also returns them).
    ///
    /// # Errors
    /// As `forward`.
    pub fn forward_train(
        &self,
        queries: &Tokens,
        keys: &Tokens,
        values: &Tokens,
        opts: &AdditiveOptions,
    ) -> Result<(AdditiveOutput, AdditiveTape)> {
        let mut o = *opts;
        o.need_weights = true;
        o.need_scores = false;
        let mut y = self.forward(queries, keys, values, &o)?;
        let weights = if opts.need_weights {
            y.weights.clone()
        } else {
            y.weights.take()
        }
        .expect("weights asked for");
        let [b, lq, _] = queries.shape;
        let (lk, dv) = (keys.shape[1], values.shape[2]);
        let sf = queries.is_seq_first();
        let out = if sf {
            swap_outer(&y.out, [lq, b, dv])
        } else {
            y.out.clone()
        };
        let tape = AdditiveTape {
            dims: [b, lq, lk, dv],
            seq_first: [sf, keys.is_seq_first(), values.is_seq_first()],
            x: [queries.dense_ble()?, keys.dense_ble()?, values.dense_ble()?],
            out,
            weights,
        };
        Ok((y, tape))
    }

    /// The gradients of the three inputs (dense, each in its memory order) and of every
    /// parameter (named as [`AdditiveAttention::state_dict`] names them: `W_q.weight`,
    /// `W_k.weight`, `w_v.weight`, and `W_q.bias` / `W_k.bias` where the layer has them), given
    /// `dy`, the gradient of the output of the `forward_train` that made `tape` (dense, in the
    /// output's memory order).
    ///
    /// # Errors
    /// [`AttnError::BufferLength`] for a `dy` of the wrong length.
    pub fn backward(&self, tape: &AdditiveTape, dy: &[f32]) -> Result<LayerGrads> {
        let [b, lq, lk, dv] = tape.dims;
        let (a, dq, dk) = self.dims();
        let needed = crate::alloc::checked_len("dy", &[b, lq, dv])?;
        if dy.len() != needed {
            return Err(AttnError::BufferLength {
                arg: "dy",
                needed,
                got: dy.len(),
            });
        }
        let dy = if tape.seq_first[0] {
            swap_outer(dy, [lq, b, dv])
        } else {
            dy.to_vec()
        };
        let [xq, xk, xv] = &tape.x;
        let p = &tape.weights;
        // The projections, as the forward computed them (its bias is b_q + b_k, on q′).
        // The projections, as the forward computed them (its bias is b_q + b_k, on q′).
        let proj = |x: &[f32], w: &[f32], bias: Option<&[f32]>, rows: usize, e: usize| {
            let mut y = zeros_for("projection", &[rows, a])?;
            let xt = Tokens::ble(x, [1, rows, e]);
            let exec = Exec {
                par: Par::Seq,
                backend: Backend::default(),
            };
            // SAFETY: `xt` is dense `rows × e`; `w` holds `a` rows of `e`; `y` is dense
            // `rows × a` and overlaps neither.
            unsafe { project(exec, &xt, w, e, a, bias, y.as_mut_ptr(), [rows * a, a]) };
            Ok::<_, AttnError>(y)
        };
        let qp = proj(xq, &self.w_q, self.bias.as_deref(), b * lq, dq)?;
        let kp = proj(xk, &self.w_k, None, b * lk, dk)?;
        let mut dqp = zeros_for("dq'", &[b, lq, a])?;
        let mut dkp = zeros_for("dk'", &[b, lk, a])?;
        let mut dvec = vec![0.0f32; a];
        let mut dvals = zeros_for("dvalues", &[b, lk, dv])?;
        let mut t = vec![0.0f32; a];
        for bi in 0..b {
            for i in 0..lq {
                let row = bi * lq + i;
                let go = &dy[row * dv..(row + 1) * dv];
                let o = &tape.out[row * dv..(row + 1) * dv];
                let delta: f32 = go.iter().zip(o).map(|(x, y)| x * y).sum();
                for j in 0..lk {
                    let pij = p[row * lk + j];
                    if pij == 0.0 {
                        continue;
                    }
                    let vr = (bi * lk + j) * dv;
                    let mut dp = 0.0f32;
                    for c in 0..dv {
                        dvals[vr + c] += pij * go[c];
                        dp += go[c] * xv[vr + c];
                    }
                    let ds = pij * (dp - delta);
                    let (qr, kr) = (&qp[row * a..(row + 1) * a], &kp[(bi * lk + j) * a..][..a]);
                    for c in 0..a {
                        t[c] = (qr[c] + kr[c]).tanh();
                    }
                    for c in 0..a {
                        dvec[c] += ds * t[c];
                        let g = ds * self.v[c] * (1.0 - t[c] * t[c]);
                        dqp[row * a + c] += g;
                        dkp[(bi * lk + j) * a + c] += g;
                    }
                }
            }
        }
        let db: Vec<f32> = (0..a)
            .map(|c| (0..b * lq).map(|r| dqp[r * a + c]).sum())
            .collect();
        let grads = AdditiveAttention::from_grads(
            self,
            at_b(&dqp, xq, b * lq, a, dq)?,
            at_b(&dkp, xk, b * lk, a, dk)?,
            db,
            dvec,
        );
        let order = |x: Vec<f32>, p: usize, l: usize, e: usize| {
            if tape.seq_first[p] {
                swap_outer(&x, [b, l, e])
            } else {
                x
            }
        };
        Ok(LayerGrads {
            dquery: order(a_b(&dqp, &self.w_q, dq, b * lq, a, dq)?, 0, lq, dq),
            dkey: order(a_b(&dkp, &self.w_k, dk, b * lk, a, dk)?, 1, lk, dk),
            dvalue: order(dvals, 2, lk, dv),
            params: grads.state_dict(""),
        })
    }
}
