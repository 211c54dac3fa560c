//! `torch.nn.MultiheadAttention`: packed or separate Q/K/V projections, the fused SDPA kernel on
//! strided per-head views of the projection outputs, and the output projection.

use super::linear::{project, Exec, Linear};
use super::state_dict::{join, StateDict};
use super::{check_qkv, product, Tokens};
use crate::alloc::zeros_for;
use crate::error::{AttnError, Result};
use crate::gemm::Backend;
use crate::options::{Causal, Extras, MaskRef, Par, SdpaOptions};
use crate::view::{Tensor, TensorMut};
use attnkit_kernels::Isa;
use std::path::Path;

/// Configuration of a [`MultiheadAttention`], as the arguments of PyTorch's constructor.
///
/// ```
/// use attnkit::MhaConfig;
/// let cross = MhaConfig::new(32, 4).kdim(20).vdim(12);
/// let gqa = MhaConfig::new(64, 8).kv_heads(2); // extension: 2 key/value heads
/// # let _ = (cross, gqa);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MhaConfig {
    /// `E`: width of the queries and of the output.
    pub embed_dim: usize,
    /// Query heads `H`; `head_dim = E / H`.
    pub num_heads: usize,
    /// Width of the keys (PyTorch `kdim`); `None` means `E`.
    pub kdim: Option<usize>,
    /// Width of the values (PyTorch `vdim`); `None` means `E`.
    pub vdim: Option<usize>,
    /// Whether the projections have biases (`in_proj_bias`, `out_proj.bias`).
    pub bias: bool,
    /// Key/value heads for grouped-query (`1 ≤ Hkv`, `H % Hkv = 0`) or multi-query attention
    /// (`Hkv = 1`); `None` means `H` (PyTorch). Query head `h` uses KV head `h / (H/Hkv)`. Not a
    /// PyTorch `nn.MultiheadAttention` option: the K and V projections then have `Hkv·head_dim`
    /// rows.
    pub num_kv_heads: Option<usize>,
}

impl MhaConfig {
    /// `embed_dim`, `num_heads`, `kdim = vdim = embed_dim`, biases on.
    pub fn new(embed_dim: usize, num_heads: usize) -> Self {
        MhaConfig {
            embed_dim,
            num_heads,
            kdim: None,
            vdim: None,
            bias: true,
            num_kv_heads: None,
        }
    }
    /// Sets `kdim`.
    pub fn kdim(mut self, kdim: usize) -> Self {
        self.kdim = Some(kdim);
        self
    }
    /// Sets `vdim`.
    pub fn vdim(mut self, vdim: usize) -> Self {
        self.vdim = Some(vdim);
        self
    }
    /// Sets `bias`.
    pub fn bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    /// Sets the number of key/value heads (GQA/MQA extension).
    pub fn kv_heads(mut self, num_kv_heads: usize) -> Self {
        self.num_kv_heads = Some(num_kv_heads);
        self
    }

    /// Resolved `(E, H, Hkv, head_dim, kdim, vdim)`, validated.
    fn resolve(&self) -> Result<(usize, usize, usize, usize, usize, usize)> {
        let (e, h) = (self.embed_dim, self.num_heads);
        let positive = |arg: &'static str, value: usize| {
            if value == 0 {
                Err(AttnError::Config {
                    arg,
                    value,
                    reason: "must be positive".into(),
                })
            } else {
                Ok(value)
            }
        };
        positive("embed_dim", e)?;
        positive("num_heads", h)?;
        if e % h != 0 {
            return Err(AttnError::Config {
                arg: "embed_dim",
                value: e,
                reason: format!("must be divisible by num_heads = {h}"),
            });
        }
        let hkv = positive("num_kv_heads", self.num_kv_heads.unwrap_or(h))?;
        if h % hkv != 0 {
            return Err(AttnError::Config {
                arg: "num_kv_heads",
                value: hkv,
                reason: format!("must divide num_heads = {h}"),
            });
        }
        let kdim = positive("kdim", self.kdim.unwrap_or(e))?;
        let vdim = positive("vdim", self.vdim.unwrap_or(e))?;
        // Every weight and bias length the layer forms is at most 3·E·max(E, kdim, vdim).
        let widest = e.max(kdim).max(vdim);
        if e.checked_mul(3)
            .and_then(|r| r.checked_mul(widest))
            .is_none_or(|n| n > isize::MAX as usize)
        {
            return Err(AttnError::Config {
                arg: "embed_dim",
                value: e,
                reason: format!("with kdim = {kdim}, vdim = {vdim} the weights cannot be held"),
            });
        }
        Ok((e, h, hkv, e / h, kdim, vdim))
    }
}

/// Which attention kernel a layer runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttnPath {
    /// The fused kernel ([`crate::sdpa`]): the score matrix never exists.
    #[default]
    Fused,
    /// The unfused baseline ([`crate::unfused::sdpa_unfused_with`]): scores materialised per
    /// head. For measurements; it cannot return attention weights.
    Unfused,
}

#[derive(Clone, Copy, Debug)]
enum MaskData<'a> {
    Bool(&'a [bool]),
    Float(&'a [f32]),
}

/// An `attn_mask` of `nn.MultiheadAttention`: `(Lq, Lk)` shared by every batch element and
/// head, or `(B·H, Lq, Lk)` with index `b·H + h` (PyTorch's 3-D form).
///
/// **Polarity**: a bool mask is PyTorch MHA's, `true` = *masked* (not attended), the opposite
/// of [`crate::SdpaOptions::bool_mask`]. A float mask is added to the scaled scores (`-inf`
/// masks).
///
/// ```
/// use attnkit::MhaMask;
/// // nn.Transformer.generate_square_subsequent_mask(3) as a bool mask: true above the diagonal.
/// let m: Vec<bool> = (0..9).map(|i| i % 3 > i / 3).collect();
/// let mask = MhaMask::bool_2d(&m, 3, 3);
/// # let _ = mask;
/// ```
#[derive(Clone, Copy, Debug)]
pub struct MhaMask<'a> {
    data: MaskData<'a>,
    shape: [usize; 3],
    dims: usize,
}

impl<'a> MhaMask<'a> {
    /// Bool `(Lq, Lk)`, `true` = masked.
    pub fn bool_2d(data: &'a [bool], lq: usize, lk: usize) -> Self {
        MhaMask {
            data: MaskData::Bool(data),
            shape: [1, lq, lk],
            dims: 2,
        }
    }
    /// Bool `(B·H, Lq, Lk)`, `true` = masked.
    pub fn bool_3d(data: &'a [bool], bh: usize, lq: usize, lk: usize) -> Self {
        MhaMask {
            data: MaskData::Bool(data),
            shape: [bh, lq, lk],
            dims: 3,
        }
    }
    /// Additive float `(Lq, Lk)`.
    pub fn float_2d(data: &'a [f32], lq: usize, lk: usize) -> Self {
        MhaMask {
            data: MaskData::Float(data),
            shape: [1, lq, lk],
            dims: 2,
        }
    }
    /// Additive float `(B·H, Lq, Lk)`.
    pub fn float_3d(data: &'a [f32], bh: usize, lq: usize, lk: usize) -> Self {
        MhaMask {
            data: MaskData::Float(data),
            shape: [bh, lq, lk],
            dims: 3,
        }
    }
    fn shape_vec(&self) -> Vec<usize> {
        self.shape[3 - self.dims..].to_vec()
    }
}

#[derive(Clone, Copy, Debug)]
enum KpData<'a> {
    Bool(&'a [bool], [usize; 2]),
    Float(&'a [f32], [usize; 2]),
    Lengths(&'a [usize]),
}

/// A `key_padding_mask` of `nn.MultiheadAttention`, `(B, Lk)`.
///
/// **Polarity**: bool `true` = *padded* (ignored), as in PyTorch MHA. A float mask is added to the
/// scores of every query. [`KeyPadding::lengths`] (an extension) gives the valid key count per
/// batch element instead, which also lets the kernel skip the padded keys; a bool mask whose rows
/// are all "valid prefix, padded suffix" is converted to that form automatically.
#[derive(Clone, Copy, Debug)]
pub struct KeyPadding<'a>(KpData<'a>);

impl<'a> KeyPadding<'a> {
    /// Bool `(B, Lk)`, `true` = padded.
    pub fn bool(data: &'a [bool], shape: [usize; 2]) -> Self {
        KeyPadding(KpData::Bool(data, shape))
    }
    /// Additive float `(B, Lk)`.
    pub fn float(data: &'a [f32], shape: [usize; 2]) -> Self {
        KeyPadding(KpData::Float(data, shape))
    }
    /// Valid key count per batch element: keys `j ≥ lengths[b]` are padded.
    pub fn lengths(lengths: &'a [usize]) -> Self {
        KeyPadding(KpData::Lengths(lengths))
    }
}

/// Options of a [`MultiheadAttention`] (and [`crate::SelfAttention`]) forward pass, named as
/// the arguments of PyTorch's `forward`.
///
/// Differences from PyTorch: `need_weights` defaults to `false` (PyTorch: `true`), since asking
/// for the weights materialises them; `is_causal` without `attn_mask` is allowed (PyTorch raises)
/// and with one both are applied.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct MhaOptions<'a> {
    /// `key_padding_mask` (`true` = padded).
    pub key_padding_mask: Option<KeyPadding<'a>>,
    /// `attn_mask` (`true` = masked, or additive).
    pub attn_mask: Option<MhaMask<'a>>,
    /// Causal masking, top-left aligned (query `i` sees keys `j ≤ i`), as PyTorch.
    pub is_causal: bool,
    /// Return the attention weights ([`LayerOutput::weights`]).
    pub need_weights: bool,
    /// Average the weights over heads (`(B, Lq, Lk)`) rather than per head (`(B, H, Lq, Lk)`).
    pub average_attn_weights: bool,
    /// SIMD path; `None` = [`Isa::detect`].
    pub isa: Option<Isa>,
    /// Threading of the projections and the attention.
    pub par: Par,
    /// GEMM library of the projections.
    pub backend: Backend,
    /// Attention kernel.
    pub path: AttnPath,
    /// ALiBi slopes, one per head (see [`crate::SdpaOptions::alibi`]; [`crate::alibi_slopes`]
    /// makes the standard ones).
    pub alibi: Option<&'a [f32]>,
    /// Softcap of the scaled scores (see [`crate::SdpaOptions::softcap`]).
    pub softcap: Option<f32>,
    /// Attention-sink logits, one per head (see [`crate::SdpaOptions::sinks`]).
    pub sinks: Option<&'a [f32]>,
}

impl Default for MhaOptions<'_> {
    fn default() -> Self {
        MhaOptions {
            key_padding_mask: None,
            attn_mask: None,
            is_causal: false,
            need_weights: false,
            average_attn_weights: true,
            isa: None,
            par: Par::Rayon,
            backend: Backend::default(),
            path: AttnPath::Fused,
            alibi: None,
            softcap: None,
            sinks: None,
        }
    }
}

impl<'a> MhaOptions<'a> {
    /// Defaults: no masks, no weights (averaged when asked), best ISA, rayon, fused kernel.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets `key_padding_mask`.
    pub fn key_padding_mask(mut self, kpm: KeyPadding<'a>) -> Self {
        self.key_padding_mask = Some(kpm);
        self
    }
    /// Sets `attn_mask`.
    pub fn attn_mask(mut self, mask: MhaMask<'a>) -> Self {
        self.attn_mask = Some(mask);
        self
    }
    /// Sets `is_causal`.
    pub fn causal(mut self, is_causal: bool) -> Self {
        self.is_causal = is_causal;
        self
    }
    /// Sets `need_weights` and `average_attn_weights`.
    pub fn need_weights(mut self, need: bool, average: bool) -> Self {
        self.need_weights = need;
        self.average_attn_weights = average;
        self
    }
    /// Forces a SIMD path.
    pub fn isa(mut self, isa: Isa) -> Self {
        self.isa = Some(isa);
        self
    }
    /// Sets threading.
    pub fn par(mut self, par: Par) -> Self {
        self.par = par;
        self
    }
    /// Sets the GEMM library.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    /// Sets the attention kernel.
    pub fn path(mut self, path: AttnPath) -> Self {
        self.path = path;
        self
    }
    /// Sets ALiBi slopes (one per head).
    pub fn alibi(mut self, slopes: &'a [f32]) -> Self {
        self.alibi = Some(slopes);
        self
    }
    /// Sets a softcap.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }
    /// Sets attention-sink logits (one per head).
    pub fn sinks(mut self, sinks: &'a [f32]) -> Self {
        self.sinks = Some(sinks);
        self
    }
}

/// What a layer's `forward` returns.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerOutput {
    /// The output, dense, in the query's memory order: `(B, Lq, E)` for a batch-first query,
    /// `(Lq, B, E)` for a sequence-first one.
    pub out: Vec<f32>,
    /// Shape of `out` in its memory order.
    pub shape: [usize; 3],
    /// Attention weights if asked: `(B, Lq, Lk)` averaged over heads, else `(B, H, Lq, Lk)`;
    /// always batch-first, as PyTorch returns them. Rows whose keys are all masked are zeros.
    pub weights: Option<Vec<f32>>,
    /// Shape of `weights` (empty if none).
    pub weights_shape: Vec<usize>,
}

/// The projections and attention shared by [`MultiheadAttention`] and [`crate::SelfAttention`]:
/// `H` query heads of width `d`, `Hkv` KV heads (key width `d`, value width `dv`), the three
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

/// Masks converted to SDPA's forms; owns what had to be materialised.
#[derive(Default)]
struct SdpaMasks<'a> {
    key_lengths: Option<Vec<usize>>,
    bool_mask: Option<(Vec<bool>, [usize; 4])>,
    owned_bias: Option<(Vec<f32>, [usize; 4])>,
    borrowed_bias: Option<(&'a [f32], [usize; 4])>,
}

impl Core {
    /// Rows of projection part `p` (0 = q, 1 = k, 2 = v).
    fn rows(&self, p: usize) -> usize {
        [self.h * self.d, self.hkv * self.d, self.hkv * self.dv][p]
    }
    /// Offset of part `p` in `w`.
    fn w_off(&self, p: usize) -> usize {
        (0..p).map(|i| self.rows(i) * self.e_in[i]).sum()
    }
    /// Offset of part `p` in `bias`.
    fn b_off(&self, p: usize) -> usize {
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
        let average = opts.average_attn_weights;
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
            if opts.path == AttnPath::Unfused {
                return Err(AttnError::BadParam {
                    arg: "need_weights",
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
        if opts.is_causal {
            sdpa_opts.causal = Some(Causal::TopLeft);
        }
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
        match opts.path {
            AttnPath::Fused => {
                let extras = Extras {
                    lse: None,
                    weights: extras_weights,
                };
                crate::sdpa_ext(&qv, &kv, &vv, &mut ov, &sdpa_opts, extras)?
            }
            AttnPath::Unfused => {
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
        let weights_shape = match (opts.need_weights, opts.average_attn_weights) {
            (false, _) => vec![],
            (true, true) => vec![b, lq, lk],
            (true, false) => vec![b, h, lq, lk],
        };
        let mut weights = if opts.need_weights {
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

impl<'a> SdpaMasks<'a> {
    fn apply<'s>(&'s self, o: &mut SdpaOptions<'s>) {
        o.key_lengths = self.key_lengths.as_deref();
        if let Some((m, s)) = &self.bool_mask {
            o.mask = Some(crate::AttnMask::Bool(MaskRef::new(m, *s)));
        } else if let Some((m, s)) = &self.owned_bias {
            o.mask = Some(crate::AttnMask::Bias(MaskRef::new(m, *s)));
        } else if let Some((m, s)) = self.borrowed_bias {
            o.mask = Some(crate::AttnMask::Bias(MaskRef::new(m, s)));
        }
    }
}

/// Validates the PyTorch-polarity masks and converts them to SDPA's: key lengths where the
/// padding is a suffix, the attention mask as is (float) or inverted (bool), and a materialised
/// `(B, 1|H, Lq, Lk)` combination only when a non-suffix key padding mask meets an attention
/// mask.
fn sdpa_masks<'a>(
    opts: &MhaOptions<'a>,
    b: usize,
    h: usize,
    lq: usize,
    lk: usize,
) -> Result<SdpaMasks<'a>> {
    let mut out = SdpaMasks::default();
    // The attention mask: (1 or B·H, Lq, Lk) → [1|B, 1|H, Lq, Lk].
    let am = match opts.attn_mask {
        None => None,
        Some(m) => {
            let bh = product("attn_mask", &[b, h])?;
            let ok = m.shape[1] == lq && m.shape[2] == lk && (m.dims == 2 || m.shape[0] == bh);
            if !ok {
                let expected = if m.dims == 2 {
                    vec![lq, lk]
                } else {
                    vec![bh, lq, lk]
                };
                return Err(AttnError::InputShape {
                    arg: "attn_mask",
                    expected,
                    got: m.shape_vec(),
                });
            }
            let needed = product("attn_mask", &m.shape)?;
            let got = match m.data {
                MaskData::Bool(d) => d.len(),
                MaskData::Float(d) => d.len(),
            };
            if got != needed {
                return Err(AttnError::BufferLength {
                    arg: "attn_mask",
                    needed,
                    got,
                });
            }
            let shape4 = if m.dims == 2 {
                [1, 1, lq, lk]
            } else {
                [b, h, lq, lk]
            };
            Some((m.data, shape4))
        }
    };
    // The key padding mask: lengths, or a (B, Lk) mask that is not a suffix pattern.
    let mut kp: Option<KpData<'a>> = None;
    if let Some(KeyPadding(k)) = opts.key_padding_mask {
        let check_shape = |shape: [usize; 2], len: usize| -> Result<()> {
            if shape != [b, lk] {
                return Err(AttnError::InputShape {
                    arg: "key_padding_mask",
                    expected: vec![b, lk],
                    got: shape.to_vec(),
                });
            }
            let needed = product("key_padding_mask", &[b, lk])?;
            if len != needed {
                return Err(AttnError::BufferLength {
                    arg: "key_padding_mask",
                    needed,
                    got: len,
                });
            }
            Ok(())
        };
        match k {
            KpData::Lengths(l) => {
                if l.len() != b {
                    return Err(AttnError::InputShape {
                        arg: "key_padding_mask",
                        expected: vec![b],
                        got: vec![l.len()],
                    });
                }
                if let Some((batch, &len)) = l.iter().enumerate().find(|(_, &x)| x > lk) {
                    return Err(AttnError::KeyLength { batch, len, lk });
                }
                out.key_lengths = Some(l.to_vec());
            }
            KpData::Bool(d, s) => {
                check_shape(s, d.len())?;
                match suffix_lengths(d, b, lk) {
                    Some(l) => out.key_lengths = Some(l),
                    None => kp = Some(k),
                }
            }
            KpData::Float(d, s) => {
                check_shape(s, d.len())?;
                kp = Some(k);
            }
        }
    }
    match (kp, am) {
        (None, None) => {}
        (None, Some((MaskData::Bool(d), s))) => {
            out.bool_mask = Some((d.iter().map(|&x| !x).collect(), s))
        }
        (None, Some((MaskData::Float(d), s))) => out.borrowed_bias = Some((d, s)),
        (Some(KpData::Bool(d, _)), None) => {
            out.bool_mask = Some((d.iter().map(|&x| !x).collect(), [b, 1, 1, lk]))
        }
        (Some(KpData::Float(d, _)), None) => out.borrowed_bias = Some((d, [b, 1, 1, lk])),
        (Some(k), Some((a, s))) => {
            // Both: materialise [B, 1|H, Lq, Lk].
            let mh = s[1];
            let shape = [b, mh, lq, lk];
            let n = product("attn_mask", &shape)?;
            // 2-D masks are [1, 1, Lq, Lk]; 3-D ones [B, H, Lq, Lk] (the same when B = H = 1).
            let am_index = |bi: usize, hi: usize, i: usize, j: usize| {
                if s[0] == 1 && s[1] == 1 {
                    i * lk + j
                } else {
                    ((bi * h + hi) * lq + i) * lk + j
                }
            };
            let idx = |t: usize| {
                let (j, r) = (t % lk, t / lk);
                let (i, r) = (r % lq, r / lq);
                (r / mh, r % mh, i, j)
            };
            match (k, a) {
                (KpData::Bool(kd, _), MaskData::Bool(ad)) => {
                    let m = (0..n)
                        .map(|t| {
                            let (bi, hi, i, j) = idx(t);
                            !kd[bi * lk + j] && !ad[am_index(bi, hi, i, j)]
                        })
                        .collect();
                    out.bool_mask = Some((m, shape));
                }
                (k, a) => {
                    let kval = |bi: usize, j: usize| match k {
                        KpData::Bool(kd, _) => {
                            if kd[bi * lk + j] {
                                f32::NEG_INFINITY
                            } else {
                                0.0
                            }
                        }
                        KpData::Float(kd, _) => kd[bi * lk + j],
                        KpData::Lengths(_) => 0.0,
                    };
                    let aval = |x: usize| match a {
                        MaskData::Bool(ad) => {
                            if ad[x] {
                                f32::NEG_INFINITY
                            } else {
                                0.0
                            }
                        }
                        MaskData::Float(ad) => ad[x],
                    };
                    let m = (0..n)
                        .map(|t| {
                            let (bi, hi, i, j) = idx(t);
                            aval(am_index(bi, hi, i, j)) + kval(bi, j)
                        })
                        .collect();
                    out.owned_bias = Some((m, shape));
                }
            }
        }
        (Some(KpData::Lengths(_)), _) => unreachable!("lengths are never kept as a mask"),
    }
    Ok(out)
}

/// Per-row valid lengths if every row of the `(B, Lk)` padding mask is `false…false true…true`.
fn suffix_lengths(m: &[bool], b: usize, lk: usize) -> Option<Vec<usize>> {
    (0..b)
        .map(|bi| {
            let row = &m[bi * lk..(bi + 1) * lk];
            let len = row.iter().position(|&x| x).unwrap_or(lk);
            row[len..].iter().all(|&x| x).then_some(len)
        })
        .collect()
}

/// `torch.nn.MultiheadAttention` (inference): `out = concat_h(softmax(Q_h·K_hᵀ/√d + masks)·V_h)·W_oᵀ
/// + b_o` with `Q = query·W_qᵀ + b_q`, `K = key·W_kᵀ + b_k`, `V = value·W_vᵀ + b_v`.
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
/// use attnkit::{MhaConfig, MhaOptions, MultiheadAttention, StateDict, Tokens};
/// let (e, h) = (8, 2);
/// let mut sd = StateDict::new();
/// let w: Vec<f32> = (0..3 * e * e).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.05).collect();
/// sd.insert("in_proj_weight", &[3 * e, e], &w)?;
/// sd.insert("in_proj_bias", &[3 * e], &vec![0.0; 3 * e])?;
/// sd.insert("out_proj.weight", &[e, e], &w[..e * e])?;
/// sd.insert("out_proj.bias", &[e], &vec![0.0; e])?;
/// let mha = MultiheadAttention::from_state_dict(MhaConfig::new(e, h), &sd, "")?;
/// let x = vec![0.5f32; 2 * 3 * e];
/// let x = Tokens::batch_first(&x, [2, 3, e]);
/// let y = mha.forward(&x, &x, &x, &MhaOptions::new().need_weights(true, true))?;
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
    /// Builds the layer from a PyTorch-style state dict; `prefix` is the module's name in it
    /// (`""` for a bare module's `state_dict()`, `"encoder.layers.0.self_attn"` inside a model).
    ///
    /// # Errors
    /// [`AttnError::Config`] for an inconsistent configuration (`embed_dim` not divisible by
    /// `num_heads`, …); [`AttnError::MissingTensor`], [`AttnError::WeightShape`] (expected and
    /// found shapes) and [`AttnError::WeightDtype`] naming the tensor; [`AttnError::Config`] for a
    /// bias present with `bias = false`, or `bias_k`/`bias_v` (`add_bias_kv`).
    pub fn from_state_dict(cfg: MhaConfig, sd: &StateDict, prefix: &str) -> Result<Self> {
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
    /// `need_weights`, the attention weights.
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
    /// order (`B·Lq·E` elements), `attn_weights` (`B·Lq·Lk` if `opts.average_attn_weights`, else
    /// `B·H·Lq·Lk`) if given; `opts.need_weights` is ignored.
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

    /// The configuration.
    pub fn config(&self) -> &MhaConfig {
        &self.cfg
    }
    /// `E / H`.
    pub fn head_dim(&self) -> usize {
        self.core.d
    }
}
