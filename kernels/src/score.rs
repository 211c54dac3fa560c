//! What a score means, written once: which keys a query row sees and what is applied to its
//! scaled score. Every kernel (the fused prefill, decode, and the unfused baseline through
//! [`crate::apply_scores`]) takes a [`ScoreSpec`] and calls [`ScoreSpec::visible_range`] and
//! the `apply` functions here; the safe layer's key ranges come from the same
//! [`visible_range`].
//!
//! For query row `i` and key `j`, with `x = scale·q_i·k_j`, the logit is
//!
//! `cap·tanh(x/cap) + bias[i, j] − slope·|i + alibi_offset − j|`, or −inf where `mask[i, j]` is
//! false or `j` is not visible,
//!
//! and the sink, if any, joins each row's softmax denominator as one more logit with no value.
//! Softcap comes first, so a hidden key stays −inf rather than becoming −cap.
//!
//! The fused prefill kernel applies the softcap in its score tile as each register is stored
//! (`gemm::Softcap`: a pass over the tile cost a third of the softcap's time), the rest of the
//! spec after it; decode and the unfused path apply all of it through [`ScoreSpec::apply_row`].
//!
//! Kernels may work in scaled units (the fused kernels in base 2: every logit times `log2 e`);
//! `apply` takes the unit `u` and scales the constants, since `u·cap·tanh(x/cap) =
//! (u·cap)·tanh(u·x/(u·cap))`.

use crate::simd::{tanh_with, Simd, SimdDiv};

/// Causal masking: key `j` is visible to query row `i` (index in the whole query sequence) iff
/// `j ≤ i + offset`. Top-left alignment is `offset = 0`, bottom-right is `offset = Lk − Lq`.
pub type CausalOffset = isize;

/// ALiBi's linear position penalty: `−slope·|i + offset − j|` for query row `i` and key `j`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Alibi {
    /// The head's slope (finite).
    pub slope: f32,
    /// Position of query row 0 in key coordinates (`Lk − Lq` for bottom-right alignment).
    pub offset: isize,
}

/// Everything that decides the logits of query rows `row0, row0 + 1, …` of one head, given the
/// scaled dot products. Pointers are raw so that one spec can describe a tile inside a larger
/// (broadcast, strided) mask.
#[derive(Clone, Copy, Debug)]
pub struct ScoreSpec {
    /// Index of local row 0 in the query sequence (for causality, window and ALiBi).
    pub row0: usize,
    /// Keys at index `≥ key_len` are hidden (per-batch key padding).
    pub key_len: usize,
    /// Causal mask, if any.
    pub causal: Option<CausalOffset>,
    /// Sliding window (needs `causal`): key `j` is visible to row `i` only if
    /// `j > i + offset − window`, i.e. the `window` most recent keys up to the diagonal.
    pub window: Option<usize>,
    /// Softcap `cap > 0` (finite), applied to the scaled score before anything else.
    pub softcap: Option<f32>,
    /// ALiBi penalty.
    pub alibi: Option<Alibi>,
    /// Attention-sink logit (natural log), joining the softmax denominator.
    pub sink: Option<f32>,
    /// Additive bias `(r, j)` at `bias + r*ldbias + j` for local row `r`, or null.
    pub bias: *const f32,
    /// Row stride of the bias (0 broadcasts one row).
    pub ldbias: usize,
    /// Boolean mask as bytes (nonzero = attend; a `bool` is such a byte) `(r, j)` at
    /// `mask + r*ldmask + j`, or null.
    pub mask: *const u8,
    /// Row stride of the mask (0 broadcasts one row).
    pub ldmask: usize,
}

/// Keys `[lo, hi)` visible to query `i` (index in the whole query sequence) under key length,
/// causality and window: the one rule every kernel and the safe layer use.
pub fn visible_range(
    key_len: usize,
    causal: Option<CausalOffset>,
    window: Option<usize>,
    i: usize,
) -> (usize, usize) {
    let Some(off) = causal else {
        return (0, key_len);
    };
    // Saturating: offsets and windows near the ends of their ranges must not wrap.
    let diag = (i as isize).saturating_add(off).saturating_add(1);
    let hi = key_len.min(diag.max(0) as usize);
    let lo = match window {
        Some(w) => diag.saturating_sub(window_isize(w)).max(0) as usize,
        None => 0,
    };
    (lo.min(hi), hi)
}

/// A window length as a signed distance: windows past `isize::MAX` keys (e.g. `usize::MAX` for
/// "unbounded") behave as `isize::MAX`, which no key index can reach, instead of wrapping negative.
pub(crate) fn window_isize(w: usize) -> isize {
    isize::try_from(w).unwrap_or(isize::MAX)
}

/// Key indices `0..16` as lanes, for the ALiBi distance.
const IOTA: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
];

impl ScoreSpec {
    /// Every key `< key_len` visible, nothing applied.
    pub fn new(key_len: usize) -> Self {
        ScoreSpec {
            row0: 0,
            key_len,
            causal: None,
            window: None,
            softcap: None,
            alibi: None,
            sink: None,
            bias: core::ptr::null(),
            ldbias: 0,
            mask: core::ptr::null(),
            ldmask: 0,
        }
    }

    /// Keys `[lo, hi)` visible to local row `r`.
    #[inline(always)]
    pub fn visible_range(&self, r: usize) -> (usize, usize) {
        visible_range(self.key_len, self.causal, self.window, self.row0 + r)
    }

    /// Whether the logit is the bare scaled score wherever the key is visible.
    #[inline(always)]
    pub(crate) fn is_bare(&self) -> bool {
        self.bias.is_null() && self.mask.is_null() && self.softcap.is_none() && self.alibi.is_none()
    }

    /// The sink in units `u`, or −inf when there is none (a logit that contributes nothing).
    #[inline(always)]
    pub(crate) fn sink_in(&self, u: f32) -> f32 {
        self.sink.map_or(f32::NEG_INFINITY, |s| s * u)
    }

    /// Applies the spec to a transposed score tile `Sᵀ[nb × mp]` in units `u`: row `j` holds key
    /// `j0 + j`, lane `r < m` local query row `r`. Keys outside `[lo(r), hi(r))` of a row become
    /// −inf (the caller visits only keys inside the union of the rows' ranges, so key length is
    /// already respected); lanes `≥ m` are left finite or −inf, never read as results. The
    /// softcap is not applied here: the fused kernel's score tile applies it as it stores (see
    /// `gemm::Softcap`), so the spec must have none.
    ///
    /// # Safety
    /// `mp` a multiple of `S::W`, `m ≤ mp`, `s.len() ≥ nb·mp`; bias and mask readable at rows
    /// `< m` and columns `< j0 + nb`; the ISA of `S` is enabled.
    #[inline(always)]
    pub(crate) unsafe fn apply_t<S: SimdDiv>(
        &self,
        m: usize,
        j0: usize,
        nb: usize,
        mp: usize,
        s: &mut [f32],
        u: f32,
    ) {
        debug_assert!(
            self.softcap.is_none(),
            "apply_t: softcap belongs to the tile"
        );
        // SAFETY: per the contract; every vector access is a whole lane group below nb·mp.
        unsafe {
            let (slope, pos0) = self.alibi.map_or((0.0, 0.0), |al| {
                // Lane r of key row j: |row0 + r + offset − (j0 + j)|.
                (
                    -al.slope * u,
                    self.row0 as f64 + al.offset as f64 - j0 as f64,
                )
            });
            let sv = S::splat(slope);
            if self.alibi.is_some() {
                for j in 0..nb {
                    for c in (0..mp).step_by(S::W) {
                        let p = s.as_mut_ptr().add(j * mp + c);
                        let base = S::splat((pos0 - j as f64 + c as f64) as f32);
                        let dist = abs::<S>(S::add(S::load(IOTA.as_ptr()), base));
                        S::store(p, S::fma(dist, sv, S::load(p)));
                    }
                }
            }
            for j in 0..nb {
                let jj = j0 + j;
                let row = &mut s[j * mp..j * mp + m];
                if !self.bias.is_null() {
                    for (r, x) in row.iter_mut().enumerate() {
                        *x += *self.bias.add(r * self.ldbias + jj) * u;
                    }
                }
                if !self.mask.is_null() {
                    for (r, x) in row.iter_mut().enumerate() {
                        if *self.mask.add(r * self.ldmask + jj) == 0 {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            self.hide_t::<S>(m, j0, nb, mp, s);
        }
    }

    /// The visibility part of [`ScoreSpec::apply_t`] alone: key `j0 + j` is hidden from the rows
    /// before its causal diagonal (a prefix of the lanes) and, with a window, from the rows past
    /// the window's end (a suffix).
    ///
    /// # Safety
    /// As [`ScoreSpec::apply_t`].
    #[inline(always)]
    pub(crate) unsafe fn hide_t<S: Simd>(
        &self,
        m: usize,
        j0: usize,
        nb: usize,
        mp: usize,
        s: &mut [f32],
    ) {
        let Some(off) = self.causal else {
            return;
        };
        // Key j0 + j is hidden from rows r < h0 + j (row0 + r + off < j0 + j), so only keys from
        // 1 − h0 on need a prefix fill.
        let h0 = (j0 as isize)
            .saturating_sub(off)
            .saturating_sub(self.row0 as isize);
        let start = if self.window.is_some() {
            0
        } else {
            (1 - h0.max(-(nb as isize))).clamp(0, nb as isize) as usize
        };
        for j in start..nb {
            let hidden = h0.saturating_add(j as isize).clamp(0, m as isize) as usize;
            // SAFETY: row j of `s` holds `mp ≥ m` floats, a lane multiple; `hidden ≤ m`.
            unsafe { fill_neg_inf::<S>(s.as_mut_ptr().add(j * mp), hidden) };
            if let Some(w) = self.window {
                // ... and from rows r with row0 + r + off + 1 − window > j0 + j.
                let first = h0
                    .saturating_add(j as isize)
                    .saturating_add(window_isize(w))
                    .clamp(0, m as isize) as usize;
                s[j * mp + first..j * mp + m].fill(f32::NEG_INFINITY);
            }
        }
    }

    /// Applies the spec to the scores of local row `r` for keys `j0 + [0, x.len())` in units `u`:
    /// softcap, ALiBi, bias, mask, and −inf outside the row's visible range.
    ///
    /// # Safety
    /// Bias and mask of row `r` readable at columns `< j0 + x.len()`; the ISA of `S` is enabled.
    #[inline(always)]
    pub(crate) unsafe fn apply_row<S: SimdDiv>(&self, r: usize, j0: usize, x: &mut [f32], u: f32) {
        let n = x.len();
        let full = n / S::W * S::W;
        let (lo, hi) = self.visible_range(r);
        // SAFETY: vector accesses below `full`, scalar ones below `n`; bias/mask per the contract.
        unsafe {
            let p = x.as_mut_ptr();
            if let Some(cap) = self.softcap {
                softcap::<S>(&mut x[..full], cap * u);
                let (cu, inv) = (cap * u, 1.0 / (cap * u));
                for v in &mut x[full..] {
                    *v = cu * (*v * inv).tanh();
                }
            }
            if let Some(al) = self.alibi {
                // Key j0 + c + lane: |row0 + r + offset − j0 − c − lane|.
                let slope = -al.slope * u;
                let pos = self.row0 as f64 + r as f64 + al.offset as f64 - j0 as f64;
                let sv = S::splat(slope);
                for c in (0..full).step_by(S::W) {
                    let base = S::splat((c as f64 - pos) as f32);
                    let dist = abs::<S>(S::add(S::load(IOTA.as_ptr()), base));
                    S::store(p.add(c), S::fma(dist, sv, S::load(p.add(c))));
                }
                for c in full..n {
                    *p.add(c) += slope * (c as f64 - pos).abs() as f32;
                }
            }
            let inside = j0 >= lo && j0 + n <= hi;
            if inside && self.bias.is_null() && self.mask.is_null() {
                return; // most blocks of a long row: nothing per key
            }
            let bias = self.bias.wrapping_add(r * self.ldbias);
            let mask = self.mask.wrapping_add(r * self.ldmask);
            for c in 0..n {
                let j = j0 + c;
                if j < lo || j >= hi || (!self.mask.is_null() && *mask.add(j) == 0) {
                    *p.add(c) = f32::NEG_INFINITY;
                } else if !self.bias.is_null() {
                    *p.add(c) += *bias.add(j) * u;
                }
            }
        }
    }
}

/// [`ScoreSpec::apply_row`] as a free function, for the dispatch macro.
///
/// # Safety
/// As [`ScoreSpec::apply_row`].
#[inline(always)]
pub(crate) unsafe fn apply_row<S: SimdDiv>(
    spec: &ScoreSpec,
    r: usize,
    j0: usize,
    x: &mut [f32],
    u: f32,
) {
    // SAFETY: forwarded contract.
    unsafe { spec.apply_row::<S>(r, j0, x, u) }
}

/// `|x|` lane-wise (the distance of ALiBi; its inputs are never NaN).
#[inline(always)]
unsafe fn abs<S: Simd>(x: S::V) -> S::V {
    // SAFETY: register-only arithmetic.
    unsafe { S::max(x, S::sub(S::splat(0.0), x)) }
}

/// `x ← cap·tanh(x/cap)` over a lane multiple.
///
/// # Safety
/// `x.len()` a multiple of `S::W`; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn softcap<S: SimdDiv>(x: &mut [f32], cap: f32) {
    // SAFETY: whole lane groups of `x`.
    unsafe {
        let (c, inv) = (S::splat(cap), S::splat(1.0 / cap));
        for ch in x.chunks_exact_mut(S::W) {
            let p = ch.as_mut_ptr();
            S::store(p, S::mul(c, tanh_with::<S, true>(S::mul(S::load(p), inv))));
        }
    }
}

/// `x ← −inf` on a row of a lane-multiple buffer, a register at a time with full-width stores
/// only: the partial vector is blended in registers. A scalar fill per key was 15 % of small
/// causal calls, and a masked store is not forwarded to the softmax's full-width loads.
///
/// # Safety
/// `x` starts on a lane boundary of a buffer that extends to the next lane multiple.
#[inline(always)]
pub(crate) unsafe fn fill_neg_inf<S: Simd>(x: *mut f32, len: usize) {
    // SAFETY: per the contract above.
    unsafe {
        let full = len / S::W * S::W;
        for c in (0..full).step_by(S::W) {
            S::store(x.add(c), S::splat(f32::NEG_INFINITY));
        }
        if full < len {
            let p = x.add(full);
            S::store(p, S::set_first(S::load(p), len - full, f32::NEG_INFINITY));
        }
    }
}

/// The normalisation of a row from its base-2 running max `m` and sum `l` (`l > 0`) and its
/// sink `s2` (base 2; −inf for none): the factor on the unnormalised output and the natural-log
/// logsumexp. With a sink the total is taken against `max(m, s2)`, so a dominant sink cannot
/// overflow it.
#[inline(always)]
pub(crate) fn finish(m: f32, l: f32, s2: f32) -> (f32, f32) {
    const LN2: f32 = core::f32::consts::LN_2;
    if s2 == f32::NEG_INFINITY {
        return (1.0 / l, (m + l.log2()) * LN2);
    }
    let mm = if s2 > m { s2 } else { m };
    let (fm, fs) = ((m - mm).exp2(), (s2 - mm).exp2());
    let total = l * fm + fs;
    (fm / total, (mm + total.log2()) * LN2)
}
