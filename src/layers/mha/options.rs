//! The arguments of a forward call ([`MhaOptions`], [`MhaMask`], [`KeyPadding`]) and its result
//! ([`LayerOutput`]).

use crate::gemm::Backend;
use crate::options::{Causal, Par};
use attnkit_kernels::Isa;

/// Whether a layer runs fused attention or the unfused baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fusion {
    /// The fused kernel ([`crate::sdpa`]): the score matrix never exists.
    #[default]
    Fused,
    /// The unfused baseline ([`crate::unfused::sdpa_unfused_with`]): scores materialised per
    /// head. For measurements; it cannot return attention weights.
    Unfused,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum MaskData<'a> {
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
    pub(super) data: MaskData<'a>,
    pub(super) shape: [usize; 3],
    pub(super) dims: usize,
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
    pub(super) fn shape_vec(&self) -> Vec<usize> {
        self.shape[3 - self.dims..].to_vec()
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) enum KpData<'a> {
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
pub struct KeyPadding<'a>(pub(super) KpData<'a>);

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

/// Which attention weights a layer returns (PyTorch's `need_weights` and
/// `average_attn_weights`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Weights {
    /// None (`need_weights=False`): the score matrix is never materialised.
    #[default]
    None,
    /// `(B, Lq, Lk)`, averaged over heads (`need_weights=True`, PyTorch's default averaging).
    Averaged,
    /// `(B, H, Lq, Lk)`, one matrix per head (`average_attn_weights=False`).
    PerHead,
}

/// Options of a [`crate::MultiheadAttention`] (and [`crate::SelfAttention`]) forward pass,
/// named as the arguments of PyTorch's `forward` where they have one.
///
/// Differences from PyTorch: no weights by default (PyTorch's `need_weights` defaults to
/// `true`), since asking for them materialises them; causal masking without `attn_mask` is
/// allowed (PyTorch's `is_causal` raises) and with one both are applied.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct MhaOptions<'a> {
    /// `key_padding_mask` (`true` = padded).
    pub key_padding_mask: Option<KeyPadding<'a>>,
    /// `attn_mask` (`true` = masked, or additive).
    pub attn_mask: Option<MhaMask<'a>>,
    /// Causal masking and its alignment, as [`crate::SdpaOptions::causal`]: PyTorch's
    /// `is_causal=True` is [`Causal::TopLeft`].
    pub causal: Option<Causal>,
    /// The attention weights to return ([`LayerOutput::weights`]).
    pub weights: Weights,
    /// Instruction set; `None` = [`Isa::detect`].
    pub isa: Option<Isa>,
    /// Threading of the projections and the attention.
    pub par: Par,
    /// GEMM library of the projections.
    pub backend: Backend,
    /// Fused attention or the unfused baseline.
    pub fusion: Fusion,
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
            causal: None,
            weights: Weights::None,
            isa: None,
            par: Par::Rayon,
            backend: Backend::default(),
            fusion: Fusion::Fused,
            alibi: None,
            softcap: None,
            sinks: None,
        }
    }
}

impl<'a> MhaOptions<'a> {
    /// Defaults: no masks, no weights, best ISA, rayon, fused kernel.
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
    /// Sets causal masking (PyTorch's `is_causal=True` is `.causal(Causal::TopLeft)`).
    pub fn causal(mut self, causal: Causal) -> Self {
        self.causal = Some(causal);
        self
    }
    /// Sets the weights to return.
    pub fn weights(mut self, weights: Weights) -> Self {
        self.weights = weights;
        self
    }
    /// Forces an instruction set.
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
    /// Chooses fused attention or the unfused baseline.
    pub fn fusion(mut self, fusion: Fusion) -> Self {
        self.fusion = fusion;
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
