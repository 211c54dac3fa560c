//! Fused additive (Bahdanau) attention for one block of query rows of one batch element.
//!
//! Score of query row `i` and key `j`: `s_ij = Σ_a w_a · tanh(q′_ia + k′_ja)` (+ bias, masks),
//! where `q′ = W_q·q + b` and `k′ = W_k·k` were projected once by a GEMM outside the kernel.
//! Then `out_i = softmax_j(s_i·) · V`.
//!
//! Per query row the keys are streamed in blocks of [`ADDITIVE_KEY_BLOCK`]. Within a block the
//! scores are computed with keys along the SIMD axis: `k′` is stored transposed (`A × n`, key
//! index contiguous), so one step of the reduction over `a` broadcasts `q′_ia` and `w_a`, loads
//! `G` vectors of `k′ᵀ[a, j..]` and does `acc += w_a·tanh(q′_ia + k′ᵀ[a, j..])` into `G`
//! independent accumulators (one vector per lane group of keys, no horizontal sums):
//! ```text
//!   a = 0..A:   qa = splat(q′[i, a])   wa = splat(w[a])
//!               acc[g] += wa · tanh(qa + k′ᵀ[a, j0 + g·W .. j0 + (g+1)·W])   g = 0..G
//! ```
//! An online softmax (running max `m`, sum `l`, output rescaled by `exp(m_old − m_new)` when the
//! max rises) folds each block into the output row, `o += Σ_j p_j·V[j]`, vectorised along `dv`.
//! Nothing of size `Lq × Lk × A` (nor `Lq × Lk`, unless the caller asks for scores or weights)
//! ever exists.

use crate::score::ScoreSpec;
use crate::simd::{aligned, exp2, tanh, Simd, SimdDiv, ALIGN_SLACK};

const LOG2E: f32 = core::f32::consts::LOG2_E;

/// Keys per online-softmax block of [`crate::additive_forward`].
pub const ADDITIVE_KEY_BLOCK: usize = 128;

/// The transposed projected keys `kpt` must be readable (any finite or non-finite values) for
/// `n` rounded up to a multiple of this many columns: the kernel computes whole vectors of keys
/// and ignores the lanes past `key_len`.
pub const ADDITIVE_KEY_PAD: usize = 16;

/// Vectors of keys evaluated together in the score loop (independent tanh chains).
const G: usize = 4;

/// Everything the fused additive kernel needs for one (batch element, block of query rows).
/// Pointers are raw because rows of different blocks may interleave in memory.
#[derive(Clone, Copy, Debug)]
pub struct AdditiveArgs {
    /// Query rows in this block.
    pub m: usize,
    /// Keys (rows of the values).
    pub n: usize,
    /// Attention width `A` (columns of the projections).
    pub a: usize,
    /// Value width (columns of V and of the output).
    pub dv: usize,
    /// Which keys each row sees and what is added to its scores (the rule of the SDPA kernels:
    /// key length, bias, mask, and causality, window, ALiBi, softcap if set; not the sink).
    /// Keys at index `≥ spec.key_len ≤ n` are never read (key padding); local row `r` is
    /// `spec.row0 + r`, with its bias and mask rows at `r·ldbias`, `r·ldmask`.
    pub spec: ScoreSpec,
    /// Projected queries `q′` (bias included): element `(r, p)` at `qp + r*ldq + p`, `p < a`.
    pub qp: *const f32,
    /// Row stride of `qp`.
    pub ldq: usize,
    /// Projected keys, transposed: `k′_jp` at `kpt + p*ldkt + j`. Readable for every
    /// `j < round_up(n, ADDITIVE_KEY_PAD)` (the padding values are ignored).
    pub kpt: *const f32,
    /// Row stride of `kpt` (`≥ round_up(n, ADDITIVE_KEY_PAD)` when `a > 1`).
    pub ldkt: usize,
    /// The score vector `w` (`a` entries): `s = Σ_p w_p·tanh(q′_p + k′_p)`.
    pub wv: *const f32,
    /// Values: element `(j, c)` at `v + j*ldv + c`, `c < dv`.
    pub v: *const f32,
    /// Row stride of the values.
    pub ldv: usize,
    /// Output rows: element `(r, c)` at `o + r*ldo + c`; only `c < dv` is written.
    pub o: *mut f32,
    /// Row stride of the output.
    pub ldo: usize,
    /// Scores the softmax sees (`s` + bias, `−inf` where masked) `(r, j)` at
    /// `scores + r*ldw + j`, `j < n`, or null.
    pub scores: *mut f32,
    /// Attention weights `(r, j)` at `weights + r*ldw + j`, `j < n`, or null.
    pub weights: *mut f32,
    /// Row stride of `scores` and `weights`.
    pub ldw: usize,
}

const fn round_up(x: usize, w: usize) -> usize {
    x.div_ceil(w) * w
}

/// f32 elements of scratch [`crate::additive_forward`] needs for value width `dv`.
pub fn additive_scratch_len(dv: usize) -> usize {
    ADDITIVE_KEY_BLOCK + round_up(dv, ADDITIVE_KEY_PAD) + ALIGN_SLACK
}

/// `max` that lets NaN win (so it propagates), as the softmax of the SDPA kernels does.
#[inline(always)]
fn nan_max(acc: f32, x: f32) -> f32 {
    if x > acc || x.is_nan() {
        x
    } else {
        acc
    }
}

/// The fused kernel, generic over the vector type.
///
/// # Safety
/// Every pointer in `args` is valid for the extents it describes (see [`AdditiveArgs`]); `o`,
/// `scores` and `weights` overlap no input and no other task's rows;
/// `scratch.len() ≥ additive_scratch_len(dv)`; the ISA of `S` is enabled on this CPU.
#[inline(always)]
pub(crate) unsafe fn forward<S: SimdDiv>(x: &AdditiveArgs, scratch: &mut [f32]) {
    debug_assert!(
        scratch.len() >= additive_scratch_len(x.dv),
        "additive scratch too short"
    );
    debug_assert!(
        x.spec.key_len <= x.n,
        "key_len {} > n {}",
        x.spec.key_len,
        x.n
    );
    debug_assert!(x.spec.sink.is_none(), "the additive kernel has no sink");
    let (s, rest) = aligned(scratch).split_at_mut(ADDITIVE_KEY_BLOCK);
    let o = &mut rest[..x.dv];
    let lim = x.spec.key_len.min(x.n);
    // SAFETY: (whole body) reads and writes stay inside the extents `x` describes and the scratch
    // slices split above; the ISA is enabled per this function's contract.
    unsafe {
        for r in 0..x.m {
            let qrow = x.qp.add(r * x.ldq);
            let (mut mx, mut l) = (f32::NEG_INFINITY, 0.0f32);
            o.fill(0.0);
            let mut j0 = 0;
            while j0 < lim {
                let nb = ADDITIVE_KEY_BLOCK.min(lim - j0);
                score_block::<S>(x, qrow, j0, nb, s.as_mut_ptr());
                let s = &mut s[..nb];
                mask_block::<S>(x, r, j0, s);
                let bm = s.iter().fold(f32::NEG_INFINITY, |a, &b| nan_max(a, b));
                let m_new = nan_max(mx, bm);
                if m_new == f32::NEG_INFINITY {
                    // Every key so far is masked: nothing to add.
                    j0 += nb;
                    continue;
                }
                let alpha = if mx == f32::NEG_INFINITY {
                    0.0
                } else {
                    ((mx - m_new) * LOG2E).exp2()
                };
                let sum = exp_block::<S>(s, m_new);
                l = l * alpha + sum;
                if alpha != 1.0 {
                    o.iter_mut().for_each(|c| *c *= alpha);
                }
                accumulate_pv::<S>(o, s, x.v.add(j0 * x.ldv), x.ldv);
                mx = m_new;
                j0 += nb;
            }
            // A row that saw no key (l = 0) gives zeros.
            let inv = if l == 0.0 { 0.0 } else { 1.0 / l };
            let out = core::slice::from_raw_parts_mut(x.o.add(r * x.ldo), x.dv);
            for (d, &c) in out.iter_mut().zip(o.iter()) {
                *d = c * inv;
            }
            if !x.scores.is_null() {
                let row = core::slice::from_raw_parts_mut(x.scores.add(r * x.ldw), x.n);
                row[lim..].fill(f32::NEG_INFINITY);
            }
            if !x.weights.is_null() {
                let row = core::slice::from_raw_parts_mut(x.weights.add(r * x.ldw), x.n);
                let (done, rest) = row.split_at_mut(lim);
                rest.fill(0.0);
                if inv == 0.0 {
                    done.fill(0.0);
                } else {
                    for w in done.iter_mut() {
                        *w = ((*w - mx) * LOG2E).exp2() * inv;
                    }
                }
            }
        }
    }
}

/// `s[j] = Σ_p w_p·tanh(q′_p + k′ᵀ[p, j0 + j])` for `j < round_up(nb, W)` (lanes past `nb` are
/// computed from the padding and ignored).
///
/// # Safety
/// As [`forward`]; `s` holds `round_up(nb, W) ≤ ADDITIVE_KEY_BLOCK` floats.
#[inline(always)]
unsafe fn score_block<S: SimdDiv>(
    x: &AdditiveArgs,
    qrow: *const f32,
    j0: usize,
    nb: usize,
    s: *mut f32,
) {
    let w = S::W;
    let nvec = nb.div_ceil(w);
    // SAFETY: `kpt` columns `< round_up(n, ADDITIVE_KEY_PAD)` are readable and
    // `j0 + nvec·W ≤ round_up(n, W) ≤ round_up(n, ADDITIVE_KEY_PAD)`; `s` is long enough.
    unsafe {
        let mut v = 0;
        while v + G <= nvec {
            let mut acc = [S::splat(0.0); G];
            let base = x.kpt.add(j0 + v * w);
            for p in 0..x.a {
                let qa = S::splat(*qrow.add(p));
                let wa = S::splat(*x.wv.add(p));
                let krow = base.add(p * x.ldkt);
                for (g, acc) in acc.iter_mut().enumerate() {
                    let t = tanh::<S>(S::add(qa, S::load(krow.add(g * w))));
                    *acc = S::fma(wa, t, *acc);
                }
            }
            for (g, acc) in acc.iter().enumerate() {
                S::store(s.add((v + g) * w), *acc);
            }
            v += G;
        }
        while v < nvec {
            let mut acc = S::splat(0.0);
            let base = x.kpt.add(j0 + v * w);
            for p in 0..x.a {
                let t = tanh::<S>(S::add(
                    S::splat(*qrow.add(p)),
                    S::load(base.add(p * x.ldkt)),
                ));
                acc = S::fma(S::splat(*x.wv.add(p)), t, acc);
            }
            S::store(s.add(v * w), acc);
            v += 1;
        }
    }
}

/// Applies the score spec of row `r` to the score block `s` (keys `j0..`), and stores the result
/// to the `scores` and (raw, normalised later) `weights` outputs if asked.
///
/// # Safety
/// As [`forward`].
#[inline(always)]
unsafe fn mask_block<S: SimdDiv>(x: &AdditiveArgs, r: usize, j0: usize, s: &mut [f32]) {
    // SAFETY: bias/mask/scores/weights rows `< m` and columns `< n` are in bounds.
    unsafe {
        x.spec.apply_row::<S>(r, j0, s, 1.0);
        for out in [x.scores, x.weights] {
            if !out.is_null() {
                core::ptr::copy_nonoverlapping(s.as_ptr(), out.add(r * x.ldw + j0), s.len());
            }
        }
    }
}

/// `s ← exp(s − m)` in place (through `exp2`), returning `Σ s`.
#[inline(always)]
unsafe fn exp_block<S: Simd>(s: &mut [f32], m: f32) -> f32 {
    let w = S::W;
    // SAFETY: full chunks are W long; the tail goes through a W-long stack buffer.
    unsafe {
        let (mv, k) = (S::splat(m), S::splat(LOG2E));
        let mut chunks = s.chunks_exact_mut(w);
        for c in &mut chunks {
            let e = exp2::<S>(S::mul(S::sub(S::load(c.as_ptr()), mv), k));
            S::store(c.as_mut_ptr(), e);
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut buf = [f32::NEG_INFINITY; 16];
            buf[..tail.len()].copy_from_slice(tail);
            let e = exp2::<S>(S::mul(S::sub(S::load(buf.as_ptr()), mv), k));
            S::store(buf.as_mut_ptr(), e);
            tail.copy_from_slice(&buf[..tail.len()]);
        }
    }
    s.iter().sum()
}

/// `o += Σ_j p_j · V[j, ..dv]` (`dv = o.len()`), four output vectors kept in registers while the
/// keys stream past.
///
/// # Safety
/// `v` is readable at `j*ldv + c` for `j < p.len()`, `c < o.len()`; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn accumulate_pv<S: Simd>(o: &mut [f32], p: &[f32], v: *const f32, ldv: usize) {
    const NV: usize = 4;
    let w = S::W;
    let dv = o.len();
    let full = dv / w * w;
    // SAFETY: every vector access covers columns `< full ≤ dv`; scalar ones `< dv`.
    unsafe {
        let mut c0 = 0;
        while c0 < full {
            let nv = NV.min((full - c0) / w);
            let mut acc = [S::splat(0.0); NV];
            for (g, acc) in acc.iter_mut().enumerate().take(nv) {
                *acc = S::load(o.as_ptr().add(c0 + g * w));
            }
            for (j, &pj) in p.iter().enumerate() {
                let pv = S::splat(pj);
                let row = v.add(j * ldv + c0);
                for (g, acc) in acc.iter_mut().enumerate().take(nv) {
                    *acc = S::fma(pv, S::load(row.add(g * w)), *acc);
                }
            }
            for (g, acc) in acc.iter().enumerate().take(nv) {
                S::store(o.as_mut_ptr().add(c0 + g * w), *acc);
            }
            c0 += nv * w;
        }
        for (c, oc) in o.iter_mut().enumerate().skip(full) {
            let mut sum = *oc;
            for (j, &pj) in p.iter().enumerate() {
                sum += pj * *v.add(j * ldv + c);
            }
            *oc = sum;
        }
    }
}

/// `x ← tanh(x)` in place on a slice of any length (the tail goes through a padded buffer).
///
/// # Safety
/// The ISA of `S` is enabled on this CPU.
#[inline(always)]
pub(crate) unsafe fn tanh_inplace<S: SimdDiv>(x: &mut [f32]) {
    // SAFETY: full chunks are W long; the tail is copied through a W-long stack buffer.
    unsafe {
        let mut chunks = x.chunks_exact_mut(S::W);
        for c in &mut chunks {
            S::store(c.as_mut_ptr(), tanh::<S>(S::load(c.as_ptr())));
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut buf = [0.0f32; 16];
            buf[..tail.len()].copy_from_slice(tail);
            S::store(buf.as_mut_ptr(), tanh::<S>(S::load(buf.as_ptr())));
            tail.copy_from_slice(&buf[..tail.len()]);
        }
    }
}

/// The f64 specification of one additive score: `Σ_p w_p · tanh(q′_p + k′_p)` over
/// `p < w.len()`, accumulated in f64 with the exact `tanh`. Combine with
/// [`crate::reference::attention_head`] (which takes any logit function) for the whole kernel.
///
/// # Panics
/// If `q` or `k` is shorter than `w`.
pub fn reference_additive_score(q: &[f32], k: &[f32], w: &[f32]) -> f64 {
    assert!(
        q.len() >= w.len() && k.len() >= w.len(),
        "reference_additive_score: short row"
    );
    w.iter()
        .zip(q)
        .zip(k)
        .map(|((&w, &q), &k)| w as f64 * (q as f64 + k as f64).tanh())
        .sum()
}
