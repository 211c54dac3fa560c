//! Decode attention: a few query rows (new tokens × the query heads sharing one KV head) against a
//! range of a long key/value cache.
//!
//! The shape is memory-bound, so the kernel is built to read each K and V row exactly once for all
//! the rows of the group (GQA grouping): lanes run along the head dimension; the scores of KEYS
//! keys × R rows are dot products reduced together by one transposed reduction; `O += p·V` keeps
//! one accumulator per row and chunk in registers while a V row chunk is loaded once. Walking
//! several K rows at once hides them from the hardware prefetchers, so those rows are prefetched
//! in software, a few lines at a time, ahead of use. The result is a *partial*
//! `(m, l, O)` (base-2 running max, sum, unnormalised output) for the key range, so a long cache
//! can be cut into chunks processed in parallel and merged exactly ([`merge_partials`]).

use crate::simd::{exp2, Simd};

const LOG2E: f32 = core::f32::consts::LOG2_E;

/// Keys per block of the decode loop: one block of K and V rows stays in L1.
pub const DECODE_KEY_BLOCK: usize = 32;
/// Software prefetch distance of the decode loop, in keys. Measured (B1 H32 Hkv8 D128, Lk 32768,
/// huge pages, 1 thread, medians of 3): 3 keys 12.1 GB/s, 5: 16.2, 8: 18.4, 12: 18.9, 16–48:
/// slowly down again; T1 and T2 hints alike, NTA and T0 worse; no prefetch about half.
const PF: usize = 12;

/// Rows one kernel call handles at most (more are processed in several passes by the caller).
pub const DECODE_MAX_ROWS: usize = 8;

/// One query row of a decode group.
#[derive(Clone, Copy, Debug)]
pub struct DecodeRow {
    /// The query vector (`d` values).
    pub q: *const f32,
    /// First key this row cannot see (`min(key_len, causal limit)`), exclusive.
    pub hi: usize,
    /// First key this row can see (sliding window), inclusive.
    pub lo: usize,
    /// Additive bias for this row, indexed by key (`n` values), or null.
    pub bias: *const f32,
    /// Boolean mask (true = attend) for this row, indexed by key, or null.
    pub mask: *const bool,
}

/// A group of rows sharing K and V, and the key range `[j_begin, j_end)` to process.
#[derive(Clone, Copy, Debug)]
pub struct DecodeArgs<'a> {
    /// The rows (at most [`DECODE_MAX_ROWS`]).
    pub rows: &'a [DecodeRow],
    /// Head dimension of Q and K.
    pub d: usize,
    /// Head dimension of V.
    pub dv: usize,
    /// Key row `j` at `k + j*ldk`.
    pub k: *const f32,
    /// Row stride of K.
    pub ldk: usize,
    /// Value row `j` at `v + j*ldv`.
    pub v: *const f32,
    /// Row stride of V.
    pub ldv: usize,
    /// First key of the range.
    pub j_begin: usize,
    /// End of the key range (exclusive).
    pub j_end: usize,
    /// Softmax scale.
    pub scale: f32,
}

/// Floats of one row's partial result: `[m, l, o_0 … o_{dv−1}]`.
pub const fn partial_len(dv: usize) -> usize {
    dv + 2
}

/// Scratch floats [`crate::decode_partial`] needs.
pub fn decode_scratch_len(d: usize, dv: usize) -> usize {
    let r = DECODE_MAX_ROWS;
    r * d.div_ceil(16) * 16 + r * dv.div_ceil(16) * 16 + r * DECODE_KEY_BLOCK
}

/// Requests the cache line holding `p` (a prefetch never faults, so `p` may be anywhere).
#[inline(always)]
fn prefetch(p: *const f32) {
    crate::simd::prefetch_l2(p.cast());
}

/// A cursor over the cache lines of `rows` rows of `n` floats (stride `ld`), requested a few at a
/// time in address order, so the prefetches of a key group are spread over its compute loop
/// (measured: sent in one burst per group, or as straight-line code, they were slower from DRAM;
/// perhaps the miss queues overflow and drop them).
struct Lines {
    p: *const f32,
    ld: usize,
    per_row: usize,
    rows: usize,
    row: usize,
    line: usize,
}

impl Lines {
    #[inline(always)]
    fn new(p: *const f32, ld: usize, n: usize, rows: usize) -> Self {
        Lines {
            p,
            ld,
            per_row: n.div_ceil(16),
            rows,
            row: 0,
            line: 0,
        }
    }
    #[inline(always)]
    fn total(&self) -> usize {
        self.rows * self.per_row
    }
    /// Requests the next `count` lines (fewer at the end).
    #[inline(always)]
    fn next(&mut self, count: usize) {
        let mut left = count;
        while left > 0 && self.row < self.rows {
            prefetch(self.p.wrapping_add(self.row * self.ld + self.line * 16));
            self.line += 1;
            if self.line == self.per_row {
                self.line = 0;
                self.row += 1;
            }
            left -= 1;
        }
    }
}

/// The decode kernel for `R` rows.
///
/// # Safety
/// Pointers in `args` valid for the extents they describe (K/V rows `< j_end`, `d`/`dv` columns;
/// bias/mask entries `< j_end`); `partial` writable at `r*ldp + [0, dv+2)` for each row;
/// `scratch.len() ≥ decode_scratch_len(d, dv)`; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn decode_rows<S: Simd, const R: usize, const KEYS: usize, const NC: usize>(
    a: &DecodeArgs,
    partial: *mut f32,
    ldp: usize,
    scratch: &mut [f32],
) {
    let w = S::W;
    let (d, dv) = (a.d, a.dv);
    let dp = d.div_ceil(w) * w;
    let dvp = dv.div_ceil(w) * w;
    const KB: usize = DECODE_KEY_BLOCK;
    let (qbuf, rest) = scratch.split_at_mut(R * dp);
    let (obuf, rest) = rest.split_at_mut(R * dvp);
    let sbuf = &mut rest[..R * KB];
    let rows = &a.rows[..R];
    let mut m = [f32::NEG_INFINITY; R];
    let mut l = [0.0f32; R];
    let qscale = a.scale * LOG2E;
    let (dfull, dvfull) = (d / w * w, dv / w * w);
    assert!(R * KEYS <= w, "decode: R·KEYS exceeds the lanes");
    let mut sums = [0.0f32; 16];

    // SAFETY: (whole body) all accesses are inside the extents of the contract above; scratch
    // slices were split to their sizes; `dp`, `dvp`, `KB` are lane multiples.
    unsafe {
        qbuf.fill(0.0);
        obuf.fill(0.0);
        for (r, row) in rows.iter().enumerate() {
            for p in 0..d {
                qbuf[r * dp + p] = *row.q.add(p) * qscale;
            }
        }
        let jlo = rows.iter().map(|r| r.lo).min().unwrap_or(0).max(a.j_begin);
        let jhi = rows.iter().map(|r| r.hi).max().unwrap_or(0).min(a.j_end);
        let mut jb = jlo;
        while jb < jhi {
            let nk = KB.min(jhi - jb);
            // Scores: KEYS keys × R rows of dot products at a time, so each K chunk load serves
            // R rows and each Q chunk load serves KEYS keys (R·KEYS ≤ W independent chains), then
            // one transposed reduction turns the R·KEYS accumulators into one register of scores.
            let mut jj = 0;
            while jj < nk {
                let live = KEYS.min(nk - jj);
                // A short last group repeats its last key (computed, not stored).
                let mut kp = [a.k; KEYS];
                for (k, p) in kp.iter_mut().enumerate() {
                    *p = a.k.add((jb + jj + k.min(live - 1)) * a.ldk);
                }
                // Walking KEYS rows side by side defeats the hardware stream prefetchers (each
                // row is a short stream; measured: half the bandwidth), so the K and V rows PF
                // keys ahead are requested explicitly, in address order.
                let jp = jb + jj + PF;
                let npf = if KEYS > 1 && jp < a.j_end {
                    KEYS.min(a.j_end - jp)
                } else {
                    0
                };
                let mut kpf = Lines::new(a.k.wrapping_add(jp * a.ldk), a.ldk, d, npf);
                let mut vpf = Lines::new(a.v.wrapping_add(jp * a.ldv), a.ldv, dv, npf);
                let per_k = kpf.total().div_ceil((dfull / w).max(1));
                let per_v = vpf.total().div_ceil((dfull / w).max(1));
                let mut acc = [[S::splat(0.0); KEYS]; R];
                let mut c = 0;
                while c < dfull {
                    kpf.next(per_k);
                    vpf.next(per_v);
                    let mut kv = [S::splat(0.0); KEYS];
                    for (x, p) in kv.iter_mut().zip(kp) {
                        *x = S::load(p.add(c));
                    }
                    for (r, accr) in acc.iter_mut().enumerate() {
                        let q = S::load(qbuf.as_ptr().add(r * dp + c));
                        for k in 0..KEYS {
                            accr[k] = S::fma(q, kv[k], accr[k]);
                        }
                    }
                    c += w;
                }
                kpf.next(usize::MAX);
                vpf.next(usize::MAX);
                let mut regs = [S::splat(0.0); 16];
                for r in 0..R {
                    for k in 0..KEYS {
                        regs[r * KEYS + k] = acc[r][k];
                    }
                }
                S::store(sums.as_mut_ptr(), S::hsums(&regs[..w]));
                for r in 0..R {
                    for k in 0..live {
                        let mut s = sums[r * KEYS + k];
                        for p in dfull..d {
                            s += qbuf[r * dp + p] * *kp[k].add(p);
                        }
                        sbuf[r * KB + jj + k] = s;
                    }
                }
                jj += KEYS;
            }
            // Masks, then the online-softmax step per row.
            for (r, row) in rows.iter().enumerate() {
                let srow = &mut sbuf[r * KB..(r + 1) * KB];
                // Most blocks lie inside the row's visible range with no mask: skip the loop.
                let inside = jb >= row.lo && jb + nk <= row.hi;
                if !(inside && row.mask.is_null() && row.bias.is_null()) {
                    for (jj, x) in srow[..nk].iter_mut().enumerate() {
                        let j = jb + jj;
                        if j < row.lo || j >= row.hi || (!row.mask.is_null() && !*row.mask.add(j)) {
                            *x = f32::NEG_INFINITY;
                        } else if !row.bias.is_null() {
                            *x += *row.bias.add(j) * LOG2E;
                        }
                    }
                }
                srow[nk..].fill(f32::NEG_INFINITY);
                let mut mx = S::splat(f32::NEG_INFINITY);
                for c in (0..KB).step_by(w) {
                    mx = S::max(mx, S::load(srow.as_ptr().add(c)));
                }
                let blk = S::hmax(mx);
                let m_new = if blk > m[r] || blk.is_nan() {
                    blk
                } else {
                    m[r]
                };
                // Exponentiate against a finite stand-in while nothing is visible (see flash.rs).
                let m_use = if m_new == f32::NEG_INFINITY {
                    -f32::MAX
                } else {
                    m_new
                };
                let al = (m[r] - m_use).exp2();
                let mu = S::splat(m_use);
                let mut sum = S::splat(0.0);
                for c in (0..KB).step_by(w) {
                    let e = exp2::<S>(S::sub(S::load(srow.as_ptr().add(c)), mu));
                    S::store(srow.as_mut_ptr().add(c), e);
                    sum = S::add(sum, e);
                }
                l[r] = l[r] * al + S::hsum(sum);
                if al != 1.0 {
                    let av = S::splat(al);
                    for c in (0..dvp).step_by(w) {
                        let p = obuf.as_mut_ptr().add(r * dvp + c);
                        S::store(p, S::mul(S::load(p), av));
                    }
                }
                m[r] = m_new;
            }
            // O += P·V, NC lane-chunks of V per pass: R·NC independent accumulators hide the
            // FMA latency, and each V row chunk is loaded once for all rows.
            let mut c = 0;
            while c < dvfull {
                let nc = NC.min((dvfull - c) / w);
                let mut acc = [[S::splat(0.0); NC]; R];
                for r in 0..R {
                    for (cb, x) in acc[r].iter_mut().enumerate().take(nc) {
                        *x = S::load(obuf.as_ptr().add(r * dvp + c + cb * w));
                    }
                }
                // Full passes run a branch-free body; only the last pass of a row is shorter.
                let full_pass = nc == NC;
                for jj in 0..nk {
                    let vrow = a.v.add((jb + jj) * a.ldv + c);
                    let mut pr = [S::splat(0.0); R];
                    for r in 0..R {
                        pr[r] = S::splat(sbuf[r * KB + jj]);
                    }
                    if full_pass {
                        for cb in 0..NC {
                            let vv = S::load(vrow.add(cb * w));
                            for r in 0..R {
                                acc[r][cb] = S::fma(pr[r], vv, acc[r][cb]);
                            }
                        }
                    } else {
                        for cb in 0..nc {
                            let vv = S::load(vrow.add(cb * w));
                            for r in 0..R {
                                acc[r][cb] = S::fma(pr[r], vv, acc[r][cb]);
                            }
                        }
                    }
                }
                for r in 0..R {
                    for (cb, x) in acc[r].iter().enumerate().take(nc) {
                        S::store(obuf.as_mut_ptr().add(r * dvp + c + cb * w), *x);
                    }
                }
                c += nc * w;
            }
            for jj in 0..nk {
                let vp = a.v.add((jb + jj) * a.ldv);
                for r in 0..R {
                    let p = sbuf[r * KB + jj];
                    for c in dvfull..dv {
                        obuf[r * dvp + c] += p * *vp.add(c);
                    }
                }
            }
            jb += nk;
        }
        for r in 0..R {
            let out = partial.add(r * ldp);
            *out = m[r];
            *out.add(1) = l[r];
            core::ptr::copy_nonoverlapping(obuf.as_ptr().add(r * dvp), out.add(2), dv);
        }
    }
}

/// Runs [`decode_rows`] for `args.rows.len()` rows, in passes of up to [`DECODE_MAX_ROWS`].
///
/// # Safety
/// As [`decode_rows`].
#[inline(always)]
pub(crate) unsafe fn decode<S: Simd>(
    a: &DecodeArgs,
    partial: *mut f32,
    ldp: usize,
    scratch: &mut [f32],
) {
    let mut r0 = 0;
    while r0 < a.rows.len() {
        let n = DECODE_MAX_ROWS.min(a.rows.len() - r0);
        let sub = DecodeArgs {
            rows: &a.rows[r0..r0 + n],
            ..*a
        };
        // SAFETY: forwarded contract; the row subset and its partial rows stay in bounds.
        unsafe {
            let p = partial.add(r0 * ldp);
            // KEYS: keys per score group (R·KEYS ≤ W accumulators, plus KEYS K registers);
            // NC: V chunks per P·V pass (R·NC accumulators). Sized for 32 registers at W = 16
            // and 16 registers at W = 8.
            macro_rules! run {
                ($r:literal, $k16:literal, $nc16:literal, $k8:literal, $nc8:literal) => {
                    if S::W == 16 {
                        decode_rows::<S, $r, $k16, $nc16>(&sub, p, ldp, scratch)
                    } else {
                        decode_rows::<S, $r, $k8, $nc8>(&sub, p, ldp, scratch)
                    }
                };
            }
            match n {
                // One row: one key at a time keeps K a single sequential stream, which the
                // hardware prefetchers follow (measured: faster than 4 keys + software prefetch).
                1 => run!(1, 1, 8, 1, 8),
                2 => run!(2, 4, 8, 4, 6),
                3 => run!(3, 4, 6, 2, 4),
                4 => run!(4, 4, 4, 2, 2),
                5 => run!(5, 3, 4, 1, 2),
                6 => run!(6, 2, 3, 1, 1),
                7 => run!(7, 2, 3, 1, 1),
                _ => run!(8, 2, 2, 1, 1),
            }
        }
        r0 += n;
    }
}

/// Merges partial results `[m, l, o…]` (base-2 max, sum, unnormalised output) of one row over
/// disjoint key ranges, exactly: `m = max mᵢ`, `l = Σ lᵢ·2^(mᵢ−m)`, `o = Σ oᵢ·2^(mᵢ−m) / l`.
/// Part `i` is `parts[i·stride ..][.. out.len() + 2]`. Writes the normalised output and returns
/// the natural-log logsumexp (−inf and a zero output if no part saw a key). Parts are combined in
/// order, so the result is deterministic.
///
/// # Panics
/// If `parts` is shorter than `(count − 1)·stride + out.len() + 2`.
pub fn merge_partials(parts: &[f32], stride: usize, count: usize, out: &mut [f32]) -> f32 {
    let dv = out.len();
    if count > 0 {
        assert!(
            parts.len() >= (count - 1) * stride + dv + 2,
            "merge_partials: parts too short"
        );
    }
    let part = |i: usize| &parts[i * stride..i * stride + dv + 2];
    let mut mx = f32::NEG_INFINITY;
    for i in 0..count {
        let m = part(i)[0];
        if m > mx || m.is_nan() {
            mx = m;
        }
    }
    out.fill(0.0);
    if mx == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let mut l = 0.0f32;
    for i in 0..count {
        let p = part(i);
        if p[1] == 0.0 {
            continue;
        }
        let f = (p[0] - mx).exp2();
        l += p[1] * f;
        for (o, x) in out.iter_mut().zip(&p[2..]) {
            *o += x * f;
        }
    }
    if l == 0.0 {
        out.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let inv = 1.0 / l;
    for o in out.iter_mut() {
        *o *= inv;
    }
    (mx + l.log2()) * core::f32::consts::LN_2
}
