//! The fused attention forward pass for one block of query rows of one head.
//!
//! Streams the keys in blocks of `nb`: scores for the block (one GEMM into an `m × nb` tile),
//! mask, online softmax (running max `mᵢ` and sum `lᵢ`, accumulator rescaled by
//! `α = 2^(m_old − m_new)` fused into the next GEMM's load of O), then `O += P·V`. The scores live in
//! an O(m·nb) tile; the `Lq × Lk` matrix exists only if the caller asks for the weights.
//!
//! Scores are kept in base-2 units: Q is packed pre-multiplied by `scale·log2(e)`, so the
//! exponent is a bare `exp2(s − m)` and the additive bias is multiplied by `log2(e)` once.

use crate::gemm::{Accum, Tiles};
use crate::simd::{exp2, Simd};

const LOG2E: f32 = core::f32::consts::LOG2_E;
const LN2: f32 = core::f32::consts::LN_2;

/// Causal masking: key `j` is visible to query row `r` (index in the whole query sequence) iff
/// `j ≤ r + offset`. Top-left alignment is `offset = 0`, bottom-right is `offset = Lk − Lq`.
pub type CausalOffset = isize;

/// Everything the fused kernel needs for one (batch, head, query block). Pointers are raw
/// because the output rows of different blocks interleave in memory (BLHD layout).
#[derive(Clone, Copy, Debug)]
pub struct FlashArgs {
    /// Query rows in this block.
    pub m: usize,
    /// Keys in the sequence (the key/value row count).
    pub n: usize,
    /// Head dimension of Q and K.
    pub d: usize,
    /// Head dimension of V and O.
    pub dv: usize,
    /// Index of this block's first row in the query sequence (for causal masking).
    pub row0: usize,
    /// Softmax scale applied to `q·k` (before the bias is added).
    pub scale: f32,
    /// Keys at index `≥ key_len` are masked (per-batch key padding); `key_len ≤ n`.
    pub key_len: usize,
    /// Causal mask, if any.
    pub causal: Option<CausalOffset>,
    /// Q rows: element `(r, p)` at `q + r*ldq + p`.
    pub q: *const f32,
    /// Row stride of Q.
    pub ldq: usize,
    /// K rows: element `(j, p)` at `k + j*ldk + p`.
    pub k: *const f32,
    /// Row stride of K.
    pub ldk: usize,
    /// V rows: element `(j, c)` at `v + j*ldv + c`.
    pub v: *const f32,
    /// Row stride of V.
    pub ldv: usize,
    /// Output rows: element `(r, c)` at `o + r*ldo + c`; only `c < dv` is written.
    pub o: *mut f32,
    /// Row stride of O.
    pub ldo: usize,
    /// Additive bias `(r, j)` at `bias + r*ldbias + j`, or null.
    pub bias: *const f32,
    /// Row stride of the bias (0 broadcasts one row).
    pub ldbias: usize,
    /// Boolean mask (true = attend) `(r, j)` at `mask + r*ldmask + j`, or null.
    pub mask: *const bool,
    /// Row stride of the mask (0 broadcasts one row).
    pub ldmask: usize,
    /// Per-row natural-log logsumexp output (`m` values), or null.
    pub lse: *mut f32,
    /// Attention weights `(r, j)` at `weights + r*ldw + j` (`j < n`), or null.
    pub weights: *mut f32,
    /// Row stride of the weights.
    pub ldw: usize,
}

/// Key block length used by the fused kernel.
pub const fn key_block(d: usize) -> usize {
    if d <= 128 {
        128
    } else {
        64
    }
}

const fn round_up(x: usize, w: usize) -> usize {
    x.div_ceil(w) * w
}

/// f32 elements of scratch [`crate::flash_forward`] needs for these extents (enough for every ISA).
pub fn scratch_len(m: usize, d: usize, dv: usize) -> usize {
    const W: usize = 16;
    let nb = round_up(key_block(d), W);
    let dvp = round_up(dv, W);
    m * d + d * nb + nb * dvp + m * nb + m * dvp + 3 * m
}

/// The fused kernel, generic over the vector type.
///
/// # Safety
/// Every pointer in `args` is valid for the extents it describes; `o`, `lse` and `weights` do not
/// overlap each other or any input; `scratch.len() ≥ scratch_len(m, d, dv)`; the ISA of `S` is
/// enabled on this CPU.
#[inline(always)]
pub(crate) unsafe fn forward<S: Tiles>(a: &FlashArgs, scratch: &mut [f32]) {
    let FlashArgs { m, d, dv, .. } = *a;
    if m == 0 {
        return;
    }
    let w = S::W;
    let nb_max = key_block(d);
    let nbp_max = round_up(nb_max, w);
    let dvp = round_up(dv, w);
    debug_assert!(scratch.len() >= scratch_len(m, d, dv), "flash scratch too short");
    let (qs, rest) = scratch.split_at_mut(m * d);
    let (kt, rest) = rest.split_at_mut(d * nbp_max);
    let (vp, rest) = rest.split_at_mut(nbp_max * dvp);
    let (s, rest) = rest.split_at_mut(m * nbp_max);
    let (oacc, rest) = rest.split_at_mut(m * dvp);
    let (mrow, rest) = rest.split_at_mut(m);
    let (lrow, rest) = rest.split_at_mut(m);
    let alpha = &mut rest[..m];

    // Visible-key limit of row r (exclusive), from key padding and causality.
    let limit = |r: usize| -> usize {
        let mut lim = a.key_len.min(a.n);
        if let Some(off) = a.causal {
            let c = (a.row0 + r) as isize + off + 1;
            lim = lim.min(c.max(0) as usize);
        }
        lim
    };
    // Causal limits grow with r, so the last row bounds the key loop.
    let kmax = limit(m - 1);

    // SAFETY (whole body): reads and writes stay inside the extents `args` describes and the
    // scratch slices split above; the ISA is enabled per this function's contract.
    unsafe {
        // Pack Q pre-scaled into base-2 units.
        let qscale = a.scale * LOG2E;
        for r in 0..m {
            let src = a.q.add(r * a.ldq);
            for p in 0..d {
                qs[r * d + p] = *src.add(p) * qscale;
            }
        }
        mrow.fill(f32::NEG_INFINITY);
        lrow.fill(0.0);

        let mut j0 = 0;
        let mut first = true;
        while j0 < kmax {
            let nb = nb_max.min(kmax - j0);
            let nbp = round_up(nb, w);
            // Kᵀ block: keys along the SIMD axis, zero columns past nb.
            for p in 0..d {
                kt[p * nbp + nb..p * nbp + nbp].fill(0.0);
            }
            for j in 0..nb {
                let src = a.k.add((j0 + j) * a.ldk);
                for p in 0..d {
                    kt[p * nbp + j] = *src.add(p);
                }
            }
            // V block padded to a lane multiple.
            for j in 0..nb {
                let src = a.v.add((j0 + j) * a.ldv);
                let dst = &mut vp[j * dvp..(j + 1) * dvp];
                dst[..dv].copy_from_slice(core::slice::from_raw_parts(src, dv));
                dst[dv..].fill(0.0);
            }

            S::block(m, nbp / w, d, qs.as_ptr(), d, kt.as_ptr(), nbp, s.as_mut_ptr(), nbp, Accum::Replace);

            for r in 0..m {
                let srow = &mut s[r * nbp..(r + 1) * nbp];
                let valid = limit(r).saturating_sub(j0).min(nb);
                if !a.bias.is_null() {
                    let b = a.bias.add(r * a.ldbias + j0);
                    for (j, x) in srow[..valid].iter_mut().enumerate() {
                        *x += *b.add(j) * LOG2E;
                    }
                }
                if !a.mask.is_null() {
                    let mk = a.mask.add(r * a.ldmask + j0);
                    for (j, x) in srow[..valid].iter_mut().enumerate() {
                        if !*mk.add(j) {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
                srow[valid..].fill(f32::NEG_INFINITY);
                if !a.weights.is_null() {
                    // Raw base-2 logits now; normalised once the row's final max and sum are known.
                    let wrow = core::slice::from_raw_parts_mut(a.weights.add(r * a.ldw + j0), nb);
                    wrow.copy_from_slice(&srow[..nb]);
                }

                let m_blk = row_max::<S>(srow);
                let m_old = mrow[r];
                // NaN must win so that it propagates to the output.
                let m_new = if m_blk > m_old || m_blk.is_nan() { m_blk } else { m_old };
                if m_new == f32::NEG_INFINITY {
                    // Nothing visible yet: P = 0, accumulator untouched.
                    srow.fill(0.0);
                    alpha[r] = 1.0;
                    continue;
                }
                let al = if m_old == m_new { 1.0 } else { (m_old - m_new).exp2() };
                alpha[r] = al;
                mrow[r] = m_new;
                lrow[r] = lrow[r] * al + exp_row::<S>(srow, m_new);
            }

            let acc = if first { Accum::Replace } else { Accum::ScaleAdd(alpha.as_ptr()) };
            S::block(m, dvp / w, nb, s.as_ptr(), nbp, vp.as_ptr(), dvp, oacc.as_mut_ptr(), dvp, acc);
            first = false;
            j0 += nb;
        }

        for r in 0..m {
            let l = lrow[r];
            let out = core::slice::from_raw_parts_mut(a.o.add(r * a.ldo), dv);
            // A row that saw no key (l = 0, max still −inf) gives zeros and lse = −inf.
            if first || l == 0.0 {
                out.fill(0.0);
            } else {
                let inv = 1.0 / l;
                for (o, x) in out.iter_mut().zip(&oacc[r * dvp..r * dvp + dv]) {
                    *o = *x * inv;
                }
            }
            if !a.lse.is_null() {
                *a.lse.add(r) = if l == 0.0 {
                    f32::NEG_INFINITY
                } else {
                    (mrow[r] + l.log2()) * LN2
                };
            }
            if !a.weights.is_null() {
                let wrow = core::slice::from_raw_parts_mut(a.weights.add(r * a.ldw), a.n);
                // Keys past the loop bound were never written: they are masked for this row.
                let (done, rest) = wrow.split_at_mut(kmax);
                rest.fill(0.0);
                if l == 0.0 {
                    done.fill(0.0);
                } else {
                    exp_scale::<S>(done, mrow[r], 1.0 / l);
                }
            }
        }
    }
}

/// Max of a row whose length is a lane multiple.
#[inline(always)]
unsafe fn row_max<S: Simd>(x: &[f32]) -> f32 {
    // SAFETY: `x.len()` is a multiple of W, so every load is in bounds.
    unsafe {
        let mut acc = S::splat(f32::NEG_INFINITY);
        for c in x.chunks_exact(S::W) {
            acc = S::max(acc, S::load(c.as_ptr()));
        }
        S::hmax(acc)
    }
}

/// `x ← 2^(x − m)` in place on a lane-multiple row; returns the sum.
#[inline(always)]
unsafe fn exp_row<S: Simd>(x: &mut [f32], m: f32) -> f32 {
    // SAFETY: `x.len()` is a multiple of W, so every load and store is in bounds.
    unsafe {
        let mv = S::splat(m);
        let mut sum = S::splat(0.0);
        for c in x.chunks_exact_mut(S::W) {
            let e = exp2::<S>(S::sub(S::load(c.as_ptr()), mv));
            S::store(c.as_mut_ptr(), e);
            sum = S::add(sum, e);
        }
        S::hsum(sum)
    }
}

/// `x ← 2^(x − m) · k` in place on a row of any length (the tail goes through a padded buffer).
#[inline(always)]
pub(crate) unsafe fn exp_scale<S: Simd>(x: &mut [f32], m: f32, k: f32) {
    // SAFETY: full chunks are W long; the tail is copied through a W-long stack buffer.
    unsafe {
        let (mv, kv) = (S::splat(m), S::splat(k));
        let mut chunks = x.chunks_exact_mut(S::W);
        for c in &mut chunks {
            let e = exp2::<S>(S::sub(S::load(c.as_ptr()), mv));
            S::store(c.as_mut_ptr(), S::mul(e, kv));
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut buf = [f32::NEG_INFINITY; 16];
            buf[..tail.len()].copy_from_slice(tail);
            let e = exp2::<S>(S::sub(S::load(buf.as_ptr()), mv));
            S::store(buf.as_mut_ptr(), S::mul(e, kv));
            tail.copy_from_slice(&buf[..tail.len()]);
        }
    }
}
