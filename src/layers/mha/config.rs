//! [`MhaConfig`]: the layer's sizes, as PyTorch's constructor takes them.

use crate::error::{AttnError, Result};

/// Configuration of a [`crate::MultiheadAttention`], as the arguments of PyTorch's
/// constructor.
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
    pub(super) fn resolve(&self) -> Result<(usize, usize, usize, usize, usize, usize)> {
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
