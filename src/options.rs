//! Options of [`crate::sdpa`]: scale, causal alignment, masks, key lengths, ISA and parallelism.

use attnkit_kernels::{Isa, Precision};

/// Causal masking and how it is aligned when `Lq ≠ Lk`.
///
/// The two bottom-right alignments differ only with [`SdpaOptions::key_lengths`]:
/// [`Causal::BottomRight`] ends each batch's diagonal at *its own* last key (the new queries are
/// the last tokens of a ragged KV cache), [`Causal::BottomRightAtLk`] at key `Lk − 1` of the
/// buffer for every batch (PyTorch's `causal_lower_right` combined with a key-padding mask).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Causal {
    /// Query `i` sees keys `j ≤ i` (PyTorch `is_causal=True`).
    TopLeft,
    /// Query `i` of batch `b` sees keys `j ≤ i + key_len[b] − Lq`, `key_len[b]` its entry in
    /// [`SdpaOptions::key_lengths`] (`Lk` without them): the new queries are the *last* `Lq`
    /// positions of each sequence, as KV-cache decoding of a ragged batch needs. Without key
    /// lengths this is PyTorch's `causal_lower_right`.
    BottomRight,
    /// Query `i` sees keys `j ≤ i + Lk − Lq` whatever the key lengths, which then only mask keys
    /// `j ≥ key_len[b]`: PyTorch's `causal_lower_right` plus a key-padding mask.
    BottomRightAtLk,
}

/// A mask broadcast over `(B, H, Lq, Lk)`: a dense row-major buffer whose shape has each of the
/// first three dimensions either full or 1 (broadcast without copies), and `Lk` keys last.
/// `(Lq, Lk)` is `[1, 1, Lq, Lk]`; a key-padding style `(B, Lk)` mask is `[B, 1, 1, Lk]`.
#[derive(Clone, Copy, Debug)]
pub struct MaskRef<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) shape: [usize; 4],
}

impl<'a, T> MaskRef<'a, T> {
    /// A `(mb, mh, mq, Lk)` mask; `mb ∈ {1, B}`, `mh ∈ {1, H}`, `mq ∈ {1, Lq}`.
    pub fn new(data: &'a [T], shape: [usize; 4]) -> Self {
        MaskRef { data, shape }
    }
    /// An `(Lq, Lk)` mask shared by every batch and head.
    pub fn lq_lk(data: &'a [T], lq: usize, lk: usize) -> Self {
        Self::new(data, [1, 1, lq, lk])
    }
}

impl<'a, T: MaskElem> MaskRef<'a, T> {
    /// The same mask as bytes, nonzero = attend: what the kernels read. No copy.
    pub fn as_bytes(self) -> MaskRef<'a, u8> {
        MaskRef {
            // SAFETY: `T` is `bool` or `u8` (sealed): one byte, every value a valid `u8`, same
            // alignment; the length and lifetime are the original slice's.
            data: unsafe {
                core::slice::from_raw_parts(self.data.as_ptr().cast::<u8>(), self.data.len())
            },
            shape: self.shape,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for bool {}
    impl Sealed for u8 {}
    impl Sealed for usize {}
    impl Sealed for u32 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

/// Element types of a boolean mask: `bool`, or `u8` with nonzero = attend (what NumPy and
/// PyTorch files hold for bool arrays). Either is read in place.
pub trait MaskElem: sealed::Sealed + Copy {}
impl MaskElem for bool {}
impl MaskElem for u8 {}

/// Per-batch valid key counts in the integer type the caller holds, read in place (no
/// conversion copy): `usize`, `u32`, `i32` or `i64`. Built by [`SdpaOptions::key_lengths`]
/// from a slice, array or `Vec` of any of them; a negative count is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyLengths<'a> {
    /// `usize` counts.
    Usize(&'a [usize]),
    /// `u32` counts.
    U32(&'a [u32]),
    /// `i32` counts (PyTorch `int32`, ONNX).
    I32(&'a [i32]),
    /// `i64` counts (PyTorch's default integer type).
    I64(&'a [i64]),
}

impl KeyLengths<'_> {
    /// Number of entries.
    pub fn len(&self) -> usize {
        match self {
            KeyLengths::Usize(x) => x.len(),
            KeyLengths::U32(x) => x.len(),
            KeyLengths::I32(x) => x.len(),
            KeyLengths::I64(x) => x.len(),
        }
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Entry `b` widened to `i128` (every type fits), or `None` past the end.
    pub fn get(&self, b: usize) -> Option<i128> {
        match self {
            KeyLengths::Usize(x) => x.get(b).map(|&v| v as i128),
            KeyLengths::U32(x) => x.get(b).map(|&v| v as i128),
            KeyLengths::I32(x) => x.get(b).map(|&v| v as i128),
            KeyLengths::I64(x) => x.get(b).map(|&v| v as i128),
        }
    }
}

macro_rules! key_lengths_from {
    ($($t:ty => $v:ident),*) => {$(
        impl<'a> From<&'a [$t]> for KeyLengths<'a> {
            fn from(x: &'a [$t]) -> Self {
                KeyLengths::$v(x)
            }
        }
        impl<'a, const N: usize> From<&'a [$t; N]> for KeyLengths<'a> {
            fn from(x: &'a [$t; N]) -> Self {
                KeyLengths::$v(x)
            }
        }
        impl<'a> From<&'a Vec<$t>> for KeyLengths<'a> {
            fn from(x: &'a Vec<$t>) -> Self {
                KeyLengths::$v(x)
            }
        }
    )*};
}
key_lengths_from!(usize => Usize, u32 => U32, i32 => I32, i64 => I64);

/// An attention mask in SDPA's polarity.
#[derive(Clone, Copy, Debug)]
pub enum AttnMask<'a> {
    /// `true` = attend, `false` = masked (PyTorch SDPA bool `attn_mask`).
    Bool(MaskRef<'a, bool>),
    /// The same as bytes: nonzero = attend (a NumPy / PyTorch bool array saved as `u8`).
    Bytes(MaskRef<'a, u8>),
    /// Added to `scale·q·k` before the softmax (PyTorch SDPA float `attn_mask`); `-inf` masks.
    Bias(MaskRef<'a, f32>),
}

/// How a call may use threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Par {
    /// Run on the calling thread only.
    Seq,
    /// Split into tasks on the current rayon pool (`ThreadPool::install` chooses it), unless the
    /// call is too small to gain from it. Results are bitwise identical to `Seq`.
    #[default]
    Rayon,
}

/// Which fused kernel computes a call (the unfused baseline is a separate function, [`crate::unfused`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kernel {
    /// Chosen from the shape: [`Kernel::Decode`] for few new queries (`Lq ≤ 4`, or `Lq ≤ 8`
    /// against at least 512 keys) and no weights asked for, else [`Kernel::Prefill`]. The
    /// thresholds were measured; see docs/tuning-log.md, "Kernel choice".
    #[default]
    Auto,
    /// The tiled flash kernel: queries on the SIMD axis, parallel over (batch, head, query block).
    Prefill,
    /// The decode kernel: the query heads of a GQA group processed together so K and V are read
    /// once per group, and long key ranges split into chunks processed in parallel and merged by
    /// logsumexp (split-KV). The split depends on the shape only, so results do not depend on the
    /// thread count. Cannot produce attention weights (asking for them selects `Prefill`).
    Decode,
}

/// Options of [`crate::sdpa`]. Built with [`SdpaOptions::new`] and the chained setters.
///
/// ```
/// use attnkit::{Causal, SdpaOptions};
/// let opts = SdpaOptions::new().causal(Causal::TopLeft).scale(0.125);
/// # let _ = opts;
/// ```
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct SdpaOptions<'a> {
    /// Multiplies `q·k`; `None` means `1/√D`. `Some(1.0)` is plain dot-product attention.
    pub scale: Option<f32>,
    /// Causal masking, combined with every other mask.
    pub causal: Option<Causal>,
    /// Boolean mask (`true` = attend; PyTorch SDPA's bool `attn_mask`), broadcast over any of
    /// `(B, Hq, Lq)` of size 1, held as bytes (nonzero = attend): [`SdpaOptions::bool_mask`]
    /// takes `bool` or `u8` masks and reads either in place.
    pub bool_mask: Option<MaskRef<'a, u8>>,
    /// Additive bias (PyTorch SDPA's float `attn_mask`; `-inf` masks), broadcast likewise.
    /// With a [`SdpaOptions::bool_mask`] as well, both apply: the bias is added where the mask
    /// attends (PyTorch's MHA combining `key_padding_mask` with `attn_mask`).
    pub bias: Option<MaskRef<'a, f32>>,
    /// Per-batch valid key counts, in any of the integer types of [`KeyLengths`]: keys
    /// `j ≥ key_lengths[b]` are masked (key padding). **With
    /// [`Causal::BottomRight`] the diagonal moves too**: it is aligned to each batch's own length
    /// (query `i` sees `j ≤ i + key_lengths[b] − Lq`), as a ragged KV cache needs;
    /// [`Causal::BottomRightAtLk`] keeps it at `Lk` (PyTorch's `causal_lower_right` with a
    /// padding mask).
    pub key_lengths: Option<KeyLengths<'a>>,
    /// Sliding window (needs `causal`): each query sees only the `window` most recent keys up to
    /// its diagonal, i.e. `j > i + offset − window`. At least 1; a window of `max(Lq, Lk)` or
    /// more hides nothing (`usize::MAX` reads as "unbounded").
    pub window: Option<usize>,
    /// ALiBi slopes, one per query head (`Hq`): `−slope[h]·|pos(i) − j|` is added to every
    /// score, with `pos(i) = i + key_len − Lq` (the queries are the last positions, as for
    /// [`Causal::BottomRight`]; `pos(i) = i` under [`Causal::TopLeft`], `i + Lk − Lq` under
    /// [`Causal::BottomRightAtLk`]). [`alibi_slopes`] makes
    /// the standard ones.
    pub alibi: Option<&'a [f32]>,
    /// Softcap (Gemma 2, Grok): each scaled score `x` becomes `cap·tanh(x/cap)`, before any mask,
    /// bias or ALiBi term is applied. Positive and finite.
    pub softcap: Option<f32>,
    /// Attention-sink logits, one per query head (`Hq`; gpt-oss, StreamingLLM): each joins its
    /// rows' softmax denominator and contributes no value, so a row's weights sum to less than
    /// one; the logsumexp includes it. A fully masked row still gives zeros (its lse is the
    /// sink). `-inf` means no sink for that head.
    pub sinks: Option<&'a [f32]>,
    /// Which fused kernel runs; [`Kernel::Auto`] by default.
    pub kernel: Kernel,
    /// The instruction set the kernels use; `None` means [`Isa::detect`] (honours `ATTNKIT_ISA`).
    pub isa: Option<Isa>,
    /// Threading.
    pub par: Par,
    /// How the prefill kernel multiplies f32 Q, K and V (PyTorch's
    /// `torch.set_float32_matmul_precision`): [`Precision::Medium`] rounds them to bf16 and runs
    /// the bf16 pair products on [`Isa::Avx512Bf16`] (the default on AMD CPUs that have it)
    /// when `D` is even, else the f32 products ([`Isa::Amx`] too: see [`Precision::Medium`]).
    /// With [`SdpaOptions::isa`] forced to an ISA without bf16 products (neither of those two),
    /// `Medium` is an error rather than a silent f32 run. No effect on 16-bit
    /// operands, the decode kernel (bound by reading K and V, not by products), paged caches
    /// and the unfused kernel.
    pub precision: Precision,
}

impl<'a> SdpaOptions<'a> {
    /// Defaults: scale `1/√D`, no mask, best ISA, rayon.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets the scale.
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Sets causal masking.
    pub fn causal(mut self, causal: Causal) -> Self {
        self.causal = Some(causal);
        self
    }
    /// Sets the boolean mask (`true`, or a nonzero byte, = attend); a bias set as well still
    /// applies.
    pub fn bool_mask<T: MaskElem>(mut self, mask: MaskRef<'a, T>) -> Self {
        self.bool_mask = Some(mask.as_bytes());
        self
    }
    /// Sets the additive bias; a boolean mask set as well still applies.
    pub fn bias(mut self, bias: MaskRef<'a, f32>) -> Self {
        self.bias = Some(bias);
        self
    }
    /// Sets the boolean mask or the bias, whichever `mask` is.
    pub fn mask(self, mask: AttnMask<'a>) -> Self {
        match mask {
            AttnMask::Bool(m) => self.bool_mask(m),
            AttnMask::Bytes(m) => self.bool_mask(m),
            AttnMask::Bias(b) => self.bias(b),
        }
    }
    /// Sets per-batch key lengths (`usize`, `u32`, `i32` or `i64`; slice, array or `Vec`).
    ///
    /// ```
    /// use attnkit::SdpaOptions;
    /// let lens: Vec<i64> = vec![7, 3]; // as a PyTorch int64 tensor holds them
    /// let opts = SdpaOptions::new().key_lengths(&lens);
    /// # let _ = opts;
    /// ```
    pub fn key_lengths(mut self, lens: impl Into<KeyLengths<'a>>) -> Self {
        self.key_lengths = Some(lens.into());
        self
    }
    /// Sets a sliding window (with causal masking).
    pub fn window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }
    /// Sets ALiBi slopes (one per query head).
    pub fn alibi(mut self, slopes: &'a [f32]) -> Self {
        self.alibi = Some(slopes);
        self
    }
    /// Sets a softcap.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }
    /// Sets attention-sink logits (one per query head).
    pub fn sinks(mut self, sinks: &'a [f32]) -> Self {
        self.sinks = Some(sinks);
        self
    }
    /// Forces a kernel.
    pub fn kernel(mut self, kernel: Kernel) -> Self {
        self.kernel = kernel;
        self
    }
    /// Sets the precision of f32 products ([`Precision::Medium`]: bf16 products).
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
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
}

/// Optional extra outputs of [`crate::sdpa_ext`].
#[derive(Debug, Default)]
pub struct Extras<'a> {
    /// Natural-log logsumexp of each row's scores, `(B, H, Lq)` dense; `-inf` for a fully masked
    /// row.
    pub lse: Option<&'a mut [f32]>,
    /// The attention weights `(B, H, Lq, Lk)` dense. Asking for them materialises the score matrix
    /// (that is the point); without them it never exists.
    pub weights: Option<&'a mut [f32]>,
}

/// The extras [`crate::sdpa_ext_vec`] computes and returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Returns {
    /// The per-row logsumexp.
    pub lse: bool,
    /// The attention weights (materialises the score matrix).
    pub weights: bool,
}

/// What [`crate::sdpa_ext_vec`] returns, dense and f32.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SdpaOutput {
    /// `(B, Hq, Lq, Dv)`.
    pub out: Vec<f32>,
    /// `(B, Hq, Lq)`, if asked for; `-inf` for a fully masked row.
    pub lse: Option<Vec<f32>>,
    /// `(B, Hq, Lq, Lk)`, if asked for.
    pub weights: Option<Vec<f32>>,
}

/// The standard ALiBi slopes for `heads` heads with maximum bias `max_bias` (8 in the paper and
/// in BLOOM/MPT): with `n = 2^⌊log2 heads⌋`, head `h < n` gets `2^(−max_bias·(h+1)/n)` and the
/// remaining heads (a head count that is not a power of two) interleave the slopes of `2n` heads:
/// `2^(−max_bias·(2(h−n)+1)/(2n))`. Computed in f64, rounded once.
///
/// ```
/// let s = attnkit::alibi_slopes(8, 8.0);
/// assert_eq!((s[0], s[7]), (0.5, 1.0 / 256.0));
/// ```
pub fn alibi_slopes(heads: usize, max_bias: f32) -> Vec<f32> {
    if heads == 0 {
        return Vec::new();
    }
    let n = 1usize << heads.ilog2();
    let mb = max_bias as f64;
    let m0 = (-mb / n as f64).exp2();
    let m1 = (-mb / 2.0 / n as f64).exp2();
    (0..heads)
        .map(|h| {
            if h < n {
                m0.powi(h as i32 + 1) as f32
            } else {
                m1.powi(2 * (h - n) as i32 + 1) as f32
            }
        })
        .collect()
}
