//! The textbook single-head attention layer: `nn.Linear` query/key/value projections, no output
//! projection. Self-attention and cross-attention are the same layer fed differently.

use super::linear::Linear;
use super::mha::{Core, LayerGrads, LayerOutput, MhaOptions, Tape};
use super::state_dict::{join, StateDict};
use super::Tokens;
use crate::alloc::try_zeros;
use crate::error::{AttnError, Result};

/// Single-head attention with three `nn.Linear` projections (`query`, `key`, `value`, biases
/// optional) and no output projection:
/// `Q = x_q·W_qᵀ + b_q`, `K = x_k·W_kᵀ + b_k`, `V = x_v·W_vᵀ + b_v`,
/// `weights = softmax(Q·Kᵀ/√d)`, `out = weights·V`, with `d` = the query projection's width.
///
/// This is the self-attention module of attention tutorials, e.g. in PyTorch
/// ```text
/// class SelfAttention(nn.Module):
///     def __init__(self, d):
///         super().__init__()
///         self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
///     def forward(self, x):
///         q, k, v = self.query(x), self.key(x), self.value(x)
///         w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1)
///         return w @ v
/// ```
/// whose `state_dict()` (`query.weight`, `query.bias`, `key.weight`, …) loads with
/// [`SelfAttention::from_state_dict`]. The three projections run as one GEMM when query, key
/// and value are the same input.
///
/// **Cross-attention** is [`SelfAttention::forward_cross`]: queries from one sequence (say a
/// decoder's, `(B, Lq, Eq)`), keys and values from another (an encoder's memory, `(B, Lk, Ekv)`),
/// with `query.weight` `(d, Eq)` and `key.weight`/`value.weight` `(d, Ekv)` / `(dv, Ekv)`. The
/// multi-head version is [`crate::MultiheadAttention`] with `kdim`/`vdim`.
///
/// Masks, causal masking and weights come through the same [`MhaOptions`] as the multi-head
/// layer (PyTorch MHA polarity, one head).
///
/// ```
/// use attnkit::{Linear, MhaOptions, SelfAttention, Tokens};
/// let d = 4;
/// let eye: Vec<f32> = (0..d * d).map(|i| if i % (d + 1) == 0 { 1.0 } else { 0.0 }).collect();
/// let lin = || Linear::new(eye.clone(), None, d, d);
/// let layer = SelfAttention::new(lin()?, lin()?, lin()?)?;
/// let x = vec![1.0f32; 2 * 3 * d];
/// let y = layer.forward(&Tokens::ble(&x, [2, 3, d]), &MhaOptions::new())?;
/// assert_eq!(y.shape, [2, 3, d]);
/// assert!(y.out.iter().all(|&v| (v - 1.0).abs() < 1e-6));
/// # Ok::<(), attnkit::AttnError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct SelfAttention {
    core: Core,
    has_bias: [bool; 3],
}

impl SelfAttention {
    /// From the three projections. `query` and `key` must have the same `out_features` (`d`);
    /// the output width is `value.out_features`.
    ///
    /// # Errors
    /// [`AttnError::WeightShape`] for `key.weight` whose output width differs from
    /// `query.weight`'s, [`AttnError::Config`] for a zero width.
    pub fn new(query: Linear, key: Linear, value: Linear) -> Result<Self> {
        let d = query.out_features;
        if d == 0 {
            return Err(AttnError::Config {
                arg: "query.out_features",
                value: 0,
                reason: "must be positive".into(),
            });
        }
        if key.out_features != d {
            return Err(AttnError::WeightShape {
                name: "key.weight".into(),
                expected: vec![d, key.in_features],
                got: vec![key.out_features, key.in_features],
            });
        }
        // The packed bias holds 2·d + dv values; a weight with a zero dimension can declare
        // any width at no cost, so the width is checked and the bias allocated fallibly.
        let rows = d
            .checked_mul(2)
            .and_then(|r| r.checked_add(value.out_features))
            .filter(|&r| r <= isize::MAX as usize)
            .ok_or(AttnError::Overflow {
                arg: "value.out_features",
            })?;
        let has_bias = [
            query.bias.is_some(),
            key.bias.is_some(),
            value.bias.is_some(),
        ];
        let bias = if has_bias.contains(&true) {
            let mut packed = try_zeros::<f32>("bias", rows)?;
            let mut off = 0;
            for l in [&query, &key, &value] {
                if let Some(b) = &l.bias {
                    packed[off..off + b.len()].copy_from_slice(b);
                }
                off += l.out_features;
            }
            Some(packed)
        } else {
            None
        };
        let e_in = [query.in_features, key.in_features, value.in_features];
        let dv = value.out_features;
        let mut w = query.weight;
        w.extend(key.weight);
        w.extend(value.weight);
        let core = Core {
            e_in,
            h: 1,
            hkv: 1,
            d,
            dv,
            w,
            bias,
            out: None,
        };
        Ok(SelfAttention { core, has_bias })
    }

    /// Reads `{prefix}.query.weight`, `{prefix}.key.weight`, `{prefix}.value.weight` and their
    /// `.bias` if present (shapes taken from the tensors).
    ///
    /// # Errors
    /// As [`Linear::from_state_dict`] and [`SelfAttention::new`].
    pub fn from_state_dict(sd: &StateDict, prefix: &str) -> Result<Self> {
        let lin = |name: &str| Linear::from_state_dict(sd, &join(prefix, name));
        Self::new(lin("query")?, lin("key")?, lin("value")?)
    }

    /// The weights as `{prefix}.query.weight`, `….bias`, and so on.
    pub fn state_dict(&self, prefix: &str) -> StateDict {
        let c = &self.core;
        let mut sd = StateDict::new();
        let (mut w_off, mut b_off) = (0, 0);
        for (p, name) in ["query", "key", "value"].into_iter().enumerate() {
            let rows = if p == 2 { c.dv } else { c.d };
            let n = rows * c.e_in[p];
            sd.insert_unchecked(
                join(&join(prefix, name), "weight"),
                vec![rows, c.e_in[p]],
                &c.w[w_off..w_off + n],
            );
            if let (true, Some(b)) = (self.has_bias[p], &c.bias) {
                sd.insert_unchecked(
                    join(&join(prefix, name), "bias"),
                    vec![rows],
                    &b[b_off..b_off + rows],
                );
            }
            w_off += n;
            b_off += rows;
        }
        sd
    }

    /// Self-attention: query, key and value all from `x` `(B, L, E)`. Output `(B, L, dv)` in
    /// `x`'s memory order.
    ///
    /// # Errors
    /// As [`crate::MultiheadAttention::forward`].
    pub fn forward(&self, x: &Tokens, opts: &MhaOptions) -> Result<LayerOutput> {
        self.core.forward(x, x, x, opts)
    }

    /// [`SelfAttention::forward`] for training: also returns the [`Tape`] that
    /// [`SelfAttention::backward`] needs.
    ///
    /// # Errors
    /// As `forward`.
    pub fn forward_train(&self, x: &Tokens, opts: &MhaOptions) -> Result<(LayerOutput, Tape)> {
        self.core.forward_train(x, x, x, opts)
    }

    /// The gradients of the input and of every parameter, given `dy`, the gradient of the
    /// output of the `forward_train` that made `tape` (dense, in the output's memory order);
    /// `opts` must be that call's. [`LayerGrads::input`] is the gradient of `x`; the parameter
    /// gradients are named as [`SelfAttention::state_dict`] names the parameters
    /// (`query.weight`, `query.bias`, …).
    ///
    /// # Errors
    /// [`AttnError::BufferLength`] for a `dy` of the wrong length; the mask errors of `forward`.
    pub fn backward(&self, tape: &Tape, dy: &[f32], opts: &MhaOptions) -> Result<LayerGrads> {
        let (core, [dquery, dkey, dvalue]) = self.core.backward(tape, dy, opts)?;
        let params = SelfAttention {
            core,
            has_bias: self.has_bias,
        }
        .state_dict("");
        Ok(LayerGrads {
            dquery,
            dkey,
            dvalue,
            params,
        })
    }

    /// Cross-attention: queries from `queries` `(B, Lq, Eq)`, keys and values from `memory`
    /// `(B, Lk, Ekv)`. Output `(B, Lq, dv)`.
    ///
    /// # Errors
    /// As [`crate::MultiheadAttention::forward`].
    pub fn forward_cross(
        &self,
        queries: &Tokens,
        memory: &Tokens,
        opts: &MhaOptions,
    ) -> Result<LayerOutput> {
        self.core.forward(queries, memory, memory, opts)
    }

    /// The general form: separate query, key and value inputs.
    ///
    /// # Errors
    /// As [`crate::MultiheadAttention::forward`].
    pub fn forward_qkv(
        &self,
        query: &Tokens,
        key: &Tokens,
        value: &Tokens,
        opts: &MhaOptions,
    ) -> Result<LayerOutput> {
        self.core.forward(query, key, value, opts)
    }

    /// [`SelfAttention::forward_qkv`] into caller buffers (see
    /// [`crate::MultiheadAttention::forward_into`]; weights are `(B, Lq, Lk)`).
    ///
    /// # Errors
    /// As [`crate::MultiheadAttention::forward_into`].
    pub fn forward_into(
        &self,
        query: &Tokens,
        key: &Tokens,
        value: &Tokens,
        out: &mut [f32],
        weights: Option<&mut [f32]>,
        opts: &MhaOptions,
    ) -> Result<()> {
        self.core
            .forward_into(query, key, value, out, weights, opts)
    }

    /// Query/key projection width `d` (the softmax scale is `1/√d`).
    pub fn head_dim(&self) -> usize {
        self.core.d
    }
    /// Output (value projection) width.
    pub fn out_dim(&self) -> usize {
        self.core.dv
    }
}
