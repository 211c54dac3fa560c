//! Options of [`crate::sdpa`]: scale, causal alignment, masks, key lengths, ISA and parallelism.

use attnkit_kernels::Isa;

/// Causal masking and how it is aligned when `Lq ≠ Lk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Causal {
    /// Query `i` sees keys `j ≤ i` (PyTorch `is_causal=True`).
    TopLeft,
    /// Query `i` sees keys `j ≤ i + Lk − Lq`: the new queries are the *last* `Lq` positions of
    /// the sequence (KV-cache decoding, PyTorch `causal_lower_right`).
    BottomRight,
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

/// An attention mask in SDPA's polarity.
#[derive(Clone, Copy, Debug)]
pub enum AttnMask<'a> {
    /// `true` = attend, `false` = masked (PyTorch SDPA bool `attn_mask`).
    Bool(MaskRef<'a, bool>),
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

/// Which kernel computes a call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Path {
    /// Chosen from the shape: [`Path::Decode`] for few new queries (`Lq ≤ 4`, or `Lq ≤ 8`
    /// against at least 512 keys) and no weights asked for, else [`Path::Prefill`]. The
    /// thresholds were measured; see BENCHMARKS.md.
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
    /// A boolean or additive mask.
    pub mask: Option<AttnMask<'a>>,
    /// Per-batch valid key counts: keys `j ≥ key_lengths[b]` are masked (key padding). With
    /// [`Causal::BottomRight`] the diagonal is aligned to each batch's own length (query `i`
    /// sees `j ≤ i + key_lengths[b] − Lq`), as a ragged KV cache needs.
    pub key_lengths: Option<&'a [usize]>,
    /// Sliding window (needs `causal`): each query sees only the `window` most recent keys up to
    /// its diagonal, i.e. `j > i + offset − window`. At least 1; a window of `max(Lq, Lk)` or
    /// more hides nothing (`usize::MAX` reads as "unbounded").
    pub window: Option<usize>,
    /// Kernel choice; [`Path::Auto`] by default.
    pub path: Path,
    /// The code path; `None` means [`Isa::detect`] (honours `ATTNKIT_ISA`).
    pub isa: Option<Isa>,
    /// Threading.
    pub par: Par,
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
    /// Sets a boolean mask (`true` = attend).
    pub fn bool_mask(mut self, mask: MaskRef<'a, bool>) -> Self {
        self.mask = Some(AttnMask::Bool(mask));
        self
    }
    /// Sets an additive mask.
    pub fn bias(mut self, bias: MaskRef<'a, f32>) -> Self {
        self.mask = Some(AttnMask::Bias(bias));
        self
    }
    /// Sets per-batch key lengths.
    pub fn key_lengths(mut self, lens: &'a [usize]) -> Self {
        self.key_lengths = Some(lens);
        self
    }
    /// Sets a sliding window (with causal masking).
    pub fn window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }
    /// Forces a kernel.
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }
    /// Forces a code path.
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
