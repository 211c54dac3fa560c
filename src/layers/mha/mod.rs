//! `torch.nn.MultiheadAttention`: packed or separate Q/K/V projections, the fused SDPA kernel on
//! strided per-head views of the projection outputs, and the output projection.

mod config;
mod core;
mod masks;
mod options;
mod train;

pub(crate) use self::core::Core;
pub use config::MhaConfig;
pub use options::{Fusion, KeyPadding, LayerOutput, MhaMask, MhaOptions, Weights};
pub(crate) use train::{a_b, at_b};
pub use train::{LayerGrads, Tape};

use super::init::{linear_bound, xavier_bound, InitRng};
use super::linear::Linear;
use super::state_dict::{join, StateDict};
use super::Tokens;
use crate::error::{AttnError, Result};
#[cfg(feature = "safetensors")]
use std::path::Path;

/// `torch.nn.MultiheadAttention` (inference):
/// `out = concat_h(softmax(Q_h·K_hᵀ/√d + masks)·V_h)·W_oᵀ + b_o`, with `Q = query·W_qᵀ + b_q`,
/// `K = key·W_kᵀ + b_k` and `V = value·W_vᵀ + b_v`.
///
/// Weights are PyTorch's `state_dict` (names relative to a prefix): `in_proj_weight` `(3E, E)` and
/// `in_proj_bias` `(3E,)` when `kdim = vdim = E`; otherwise `q_proj_weight` `(E, E)`,
/// `k_proj_weight` `(E, kdim)`, `v_proj_weight` `(E, vdim)` and the same packed `in_proj_bias`;
/// then `out_proj.weight` `(E, E)` and `out_proj.bias` `(E,)`. With GQA (`kv_heads`) the K and V
/// rows are `Hkv·head_dim` instead of `E`.
///
/// The Q/K/V projections write `(B, L, ·)` buffers (one GEMM for self-attention, where query, key
/// and value are the same [`Tokens`]; one for K and V together when they are) and each head is a
/// strided view of them; the attention writes the heads side by side, which the output
/// projection reads as is. Sequence-first inputs are read and written through strides.
///
/// **Cross-attention** is the same call with decoder queries and encoder keys/values: `Lq ≠ Lk`,
/// and widths `kdim`/`vdim` different from `E` if the encoder's are (see
/// `examples/cross_attention.rs`).
///
/// **Differences from PyTorch**: a query whose keys are all masked (e.g. a batch element whose
/// keys are all padded) gives a zero output row before the output projection (so `out = b_o`)
/// and zero weights; PyTorch's MHA gives NaN there. `dropout`, `add_bias_kv` and
/// `add_zero_attn` are not supported (inference only); a state dict holding `bias_k`/`bias_v` is
/// refused.
///
/// ```
/// use attnkit::{MhaConfig, MhaOptions, MultiheadAttention, StateDict, Tokens, Weights};
/// let (e, h) = (8, 2);
/// let mut sd = StateDict::new();
/// let w: Vec<f32> = (0..3 * e * e).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.05).collect();
/// sd.insert("in_proj_weight", &[3 * e, e], &w)?;
/// sd.insert("in_proj_bias", &[3 * e], &vec![0.0; 3 * e])?;
/// sd.insert("out_proj.weight", &[e, e], &w[..e * e])?;
/// sd.insert("out_proj.bias", &[e], &vec![0.0; e])?;
/// let mha = MultiheadAttention::from_state_dict(MhaConfig::new(e, h), &sd, "")?;
/// let x = vec![0.5f32; 2 * 3 * e];
/// let x = Tokens::ble(&x, [2, 3, e]);
/// let y = mha.forward(&x, &x, &x, &MhaOptions::new().weights(Weights::Averaged))?;
/// assert_eq!(y.shape, [2, 3, e]);
/// assert_eq!(y.weights_shape, [2, 3, 3]);
/// # Ok::<(), attnkit::AttnError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct MultiheadAttention {
    cfg: MhaConfig,
    core: Core,
}

impl MultiheadAttention {
    /// A fresh layer with PyTorch's default initialisation of `nn.MultiheadAttention`: the input
    /// projection Xavier-uniform (`in_proj_weight` as one `(E + 2·Hkv·head_dim, E)` matrix, or
    /// each of `q/k/v_proj_weight` with its own fans when `kdim`/`vdim` differ from `E`),
    /// `out_proj.weight` as `nn.Linear` (uniform `±1/√E`), every bias zero.
    ///
    /// # Errors
    /// As [`MultiheadAttention::from_state_dict`] for the configuration; [`AttnError::Alloc`]
    /// when the weights cannot be allocated.
    pub fn new(cfg: MhaConfig, rng: &mut InitRng) -> Result<Self> {
        let (e, _, hkv, hd, kdim, vdim) = cfg.resolve()?;
        let ekv = hkv * hd;
        let rows = e + 2 * ekv;
        let mut sd = StateDict::new();
        let mut put = |sd: &mut StateDict, name: &'static str, dims: [usize; 2], bound: f32| {
            let w = rng.uniform_vec(name, &dims, bound)?;
            sd.insert_unchecked(name.into(), dims.to_vec(), &w);
            Ok::<(), AttnError>(())
        };
        if kdim == e && vdim == e {
            put(&mut sd, "in_proj_weight", [rows, e], xavier_bound(e, rows))?;
        } else {
            put(&mut sd, "q_proj_weight", [e, e], xavier_bound(e, e))?;
            put(
                &mut sd,
                "k_proj_weight",
                [ekv, kdim],
                xavier_bound(kdim, ekv),
            )?;
            put(
                &mut sd,
                "v_proj_weight",
                [ekv, vdim],
                xavier_bound(vdim, ekv),
            )?;
        }
        put(&mut sd, "out_proj.weight", [e, e], linear_bound(e))?;
        if cfg.bias {
            sd.insert_unchecked("in_proj_bias".into(), vec![rows], &vec![0.0; rows]);
            sd.insert_unchecked("out_proj.bias".into(), vec![e], &vec![0.0; e]);
        }
        Self::from_state_dict(cfg, &sd, "")
    }

    /// Builds the layer from a PyTorch-style state dict; `prefix` is the module's name in it
    /// (`""` for a bare module's `state_dict()`, `"encoder.layers.0.self_attn"` inside a model).
    /// `kdim` and `vdim` left unset in `cfg` are read from `k_proj_weight` / `v_proj_weight`
    /// when the checkpoint has separate projections (no packed `in_proj_weight`), so a
    /// cross-attention checkpoint needs only `MhaConfig::new(E, H)`.
    ///
    /// # Errors
    /// [`AttnError::Config`] for an inconsistent configuration (`embed_dim` not divisible by
    /// `num_heads`, …); [`AttnError::MissingTensor`], [`AttnError::WeightShape`] (expected and
    /// found shapes) and [`AttnError::WeightDtype`] naming the tensor; [`AttnError::Config`] for a
    /// bias present with `bias = false`, or `bias_k`/`bias_v` (`add_bias_kv`).
    pub fn from_state_dict(cfg: MhaConfig, sd: &StateDict, prefix: &str) -> Result<Self> {
        let mut cfg = cfg;
        if !sd.contains(&join(prefix, "in_proj_weight")) {
            let width = |name: &str| match sd.shape(&join(prefix, name)) {
                Some(&[_, w]) => Some(w),
                _ => None,
            };
            cfg.kdim = cfg.kdim.or_else(|| width("k_proj_weight"));
            cfg.vdim = cfg.vdim.or_else(|| width("v_proj_weight"));
        }
        let (e, h, hkv, hd, kdim, vdim) = cfg.resolve()?;
        let ekv = hkv * hd;
        for name in ["bias_k", "bias_v"] {
            let full = join(prefix, name);
            if sd.contains(&full) {
                return Err(AttnError::Config {
                    arg: "add_bias_kv",
                    value: 1,
                    reason: format!("`{full}` found: add_bias_kv is not supported"),
                });
            }
        }
        let packed_name = join(prefix, "in_proj_weight");
        let w = if kdim == e
            && vdim == e
            && (sd.contains(&packed_name) || !sd.contains(&join(prefix, "q_proj_weight")))
        {
            sd.weight(&packed_name, &[e + 2 * ekv, e])?
        } else {
            let mut w = sd.weight(&join(prefix, "q_proj_weight"), &[e, e])?;
            w.extend(sd.weight(&join(prefix, "k_proj_weight"), &[ekv, kdim])?);
            w.extend(sd.weight(&join(prefix, "v_proj_weight"), &[ekv, vdim])?);
            w
        };
        let bias_name = join(prefix, "in_proj_bias");
        let out_w = sd.weight(&join(prefix, "out_proj.weight"), &[e, e])?;
        let out_bias_name = join(prefix, "out_proj.bias");
        let (bias, out_b) = if cfg.bias {
            (
                Some(sd.weight(&bias_name, &[e + 2 * ekv])?),
                Some(sd.weight(&out_bias_name, &[e])?),
            )
        } else {
            for name in [&bias_name, &out_bias_name] {
                if sd.contains(name) {
                    return Err(AttnError::Config {
                        arg: "bias",
                        value: 0,
                        reason: format!(
                            "the state dict has `{name}` but the configuration says bias = false"
                        ),
                    });
                }
            }
            (None, None)
        };
        let out = Linear {
            weight: out_w,
            bias: out_b,
            out_features: e,
            in_features: e,
        };
        let core = Core {
            e_in: [e, kdim, vdim],
            h,
            hkv,
            d: hd,
            dv: hd,
            w,
            bias,
            out: Some(out),
        };
        Ok(MultiheadAttention { cfg, core })
    }

    #[cfg(feature = "safetensors")]
    /// [`MultiheadAttention::from_state_dict`] on a `.safetensors` file.
    ///
    /// # Errors
    /// [`AttnError::Checkpoint`] if the file cannot be read, else as `from_state_dict`.
    pub fn load(cfg: MhaConfig, path: impl AsRef<Path>, prefix: &str) -> Result<Self> {
        Self::from_state_dict(cfg, &StateDict::load(path)?, prefix)
    }

    /// The weights under PyTorch's names (packed `in_proj_weight` when `kdim = vdim = E`).
    pub fn state_dict(&self, prefix: &str) -> StateDict {
        let c = &self.core;
        let e = self.cfg.embed_dim;
        let mut sd = StateDict::new();
        if c.e_in == [e, e, e] {
            sd.insert_unchecked(
                join(prefix, "in_proj_weight"),
                vec![c.rows(0) + c.rows(1) + c.rows(2), e],
                &c.w,
            );
        } else {
            for (p, name) in ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
                .into_iter()
                .enumerate()
            {
                let (off, len) = (c.w_off(p), c.rows(p) * c.e_in[p]);
                sd.insert_unchecked(
                    join(prefix, name),
                    vec![c.rows(p), c.e_in[p]],
                    &c.w[off..off + len],
                );
            }
        }
        if let Some(b) = &c.bias {
            sd.insert_unchecked(join(prefix, "in_proj_bias"), vec![b.len()], b);
        }
        if let Some(o) = &c.out {
            o.write_state_dict(&mut sd, &join(prefix, "out_proj"));
        }
        sd
    }

    /// The forward pass: `query (B, Lq, E)`, `key (B, Lk, kdim)`, `value (B, Lk, vdim)`, each
    /// batch-first or sequence-first. Returns the output in the query's memory order and, with
    /// `opts.weights`, the attention weights.
    ///
    /// # Errors
    /// [`AttnError`] naming the argument and both sizes: a width that is not `E`/`kdim`/`vdim`
    /// ([`AttnError::ShapeMismatch`], dim `"E"`), batch sizes or key/value lengths that differ, a
    /// buffer shorter than its view; a mask whose shape is not `(Lq, Lk)` / `(B·H, Lq, Lk)` /
    /// `(B, Lk)` ([`AttnError::InputShape`]); a key length `> Lk`; an unsupported ISA.
    pub fn forward(
        &self,
        query: &Tokens,
        key: &Tokens,
        value: &Tokens,
        opts: &MhaOptions,
    ) -> Result<LayerOutput> {
        self.core.forward(query, key, value, opts)
    }

    /// [`MultiheadAttention::forward`] into caller buffers: `out` dense in the query's memory
    /// order (`B·Lq·E` elements), `attn_weights` (`B·H·Lq·Lk` if `opts.weights` is
    /// [`Weights::PerHead`], else `B·Lq·Lk`, averaged) if given.
    ///
    /// # Errors
    /// As `forward`, plus wrong buffer lengths ([`AttnError::BufferLength`]).
    pub fn forward_into(
        &self,
        query: &Tokens,
        key: &Tokens,
        value: &Tokens,
        out: &mut [f32],
        attn_weights: Option<&mut [f32]>,
        opts: &MhaOptions,
    ) -> Result<()> {
        self.core
            .forward_into(query, key, value, out, attn_weights, opts)
    }

    /// [`MultiheadAttention::forward`] for training: also returns the [`Tape`] that
    /// [`MultiheadAttention::backward`] needs. Always the fused kernel; no attention weights.
    ///
    /// # Errors
    /// As `forward`.
    pub fn forward_train(
        &self,
        query: &Tokens,
        key: &Tokens,
        value: &Tokens,
        opts: &MhaOptions,
    ) -> Result<(LayerOutput, Tape)> {
        self.core.forward_train(query, key, value, opts)
    }

    /// The gradients of every input and parameter, given `dy`, the gradient of the output of the
    /// `forward_train` that made `tape` (dense, in the output's memory order); `opts` must be
    /// that call's. Parameter gradients are named as [`MultiheadAttention::state_dict`] names the
    /// parameters (`in_proj_weight`, `in_proj_bias`, `out_proj.weight`, …).
    ///
    /// # Errors
    /// [`AttnError::BufferLength`] for a `dy` of the wrong length; the mask errors of `forward`.
    pub fn backward(&self, tape: &Tape, dy: &[f32], opts: &MhaOptions) -> Result<LayerGrads> {
        let (core, [dquery, dkey, dvalue]) = self.core.backward(tape, dy, opts)?;
        let params = MultiheadAttention {
            cfg: self.cfg,
            core,
        }
        .state_dict("");
        Ok(LayerGrads {
            dquery,
            dkey,
            dvalue,
            params,
        })
    }

    /// The configuration, with `kdim` / `vdim` filled in where
    /// [`from_state_dict`](Self::from_state_dict) read them from the checkpoint.
    pub fn config(&self) -> &MhaConfig {
        &self.cfg
    }
    /// `E / H`.
    pub fn head_dim(&self) -> usize {
        self.core.d
    }
}
