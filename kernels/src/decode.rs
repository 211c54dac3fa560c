//! Decode attention: a few query rows (new tokens × the query heads sharing one KV head) against a
//! range of a long key/value cache.
//!
//! The shape is memory-bound, so the kernel is built to read each K and V row exactly once for all
//! the rows of the group (GQA grouping): lanes run along the head dimension; the scores of KEYS
//! keys × R rows are dot products reduced together by one transposed reduction; `O += p·V` keeps
//! one accumulator per row and chunk in registers while a V row chunk is loaded once.
//!
//! How K and V are walked decides the speed, since the hardware prefetchers follow only simple
//! streams, and what pays differs between cores ([`DecodeWalk`]: on Zen 4 plain streams, on the
//! Xeon software prefetch for every group). Two walks are used, chosen per (R, vector width,
//! K/V width, [`DecodeWalk`]) by measurement:
//! - *key-major*: each K row and each V row is read start to end, and K and V advance together
//!   in sub-blocks of 8 keys (see [`decode_rows`]); no software prefetch;
//! - *chunk-major*: a lane chunk of KEYS rows at a time, so each Q chunk load serves KEYS keys
//!   (fewer loads when R is large); walking rows side by side hides them from the prefetchers,
//!   so those rows are prefetched in software, a few lines at a time, ahead of use.
//!
//! The result is a *partial* `(m, l, O)` (base-2 running max, sum, unnormalised output) for the
//! key range, so a long cache can be cut into chunks processed in parallel and merged exactly
//! ([`merge_partials`]).

use crate::elem::{get, Dtype, Elem, Stored};
use crate::pages::KvPages;
use crate::score::ScoreSpec;
use crate::simd::{aligned, exp2, Body, Simd, SimdDiv, ALIGN_SLACK};

const LOG2E: f32 = core::f32::consts::LOG2_E;

/// Keys per block of the decode loop (one online-softmax step): a block of K and V rows stays in
/// L1.
pub const DECODE_KEY_BLOCK: usize = 32;
/// Keys per sub-block of the key-major walk, rounded up to whole score groups (4 KiB of K at
/// D = 128). 8 measured fastest (R = 4, DRAM: 47 ns per key); see docs/tuning-log.md, "Decode
/// walks".
const SUB_KEYS: usize = 8;
/// Software prefetch distance of the chunk-major walk, in f32 keys (narrower K/V prefetch the
/// same bytes ahead: `4 / size` times the keys), under [`DecodeWalk::Streams`]: 3 KiB of each
/// f32 K and V stream at D = 128. The best of 3–24 on the Zen 4 VM, or level with the best, for
/// every cache type, contiguous and paged; see docs/tuning-log.md, "Decode walks".
const PF_STREAMS: usize = 6;
/// The same under [`DecodeWalk::Prefetch`]: the best measured on the Xeon (one-row groups:
/// 1.38 of a plain read of K and V); see docs/tuning-log.md, "Decode walks".
const PF_PREFETCH: usize = 24;

/// How the decode kernel walks K and V; which is faster depends on the core's prefetchers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeWalk {
    /// [`DecodeWalk::Streams`] on AMD cores, [`DecodeWalk::Prefetch`] on the others.
    #[default]
    Auto,
    /// K and V rows read whole as plain sequential streams, no software prefetch, except where
    /// several rows side by side defeat the hardware prefetchers (5, 7, 8-row groups). Measured
    /// best on Zen 4 (software prefetch slowed plain streams by 20–30 %); see
    /// docs/tuning-log.md, "Decode walks". Contiguous caches only: a paged cache takes
    /// [`DecodeWalk::Prefetch`]'s walk, as its pages break the streams (with one group shape of
    /// its own: f32 four-row groups score two keys at a time).
    Streams,
    /// Every group prefetches the K and V rows 24 keys ahead in software. Measured best on the
    /// Xeon (Sapphire Rapids class; four-row groups 0.80 → 1.08–1.10 of a plain read of K and
    /// V); see docs/tuning-log.md, "Decode walks".
    Prefetch,
}

impl DecodeWalk {
    /// `Streams` or `Prefetch`, resolving `Auto` by the CPU vendor.
    pub fn resolve(self) -> DecodeWalk {
        match self {
            DecodeWalk::Auto if crate::isa::is_amd() => DecodeWalk::Streams,
            DecodeWalk::Auto => DecodeWalk::Prefetch,
            w => w,
        }
    }
}

/// Rows one kernel call handles at most (more are processed in several passes by the caller).
pub const DECODE_MAX_ROWS: usize = 8;

/// One query row of a decode group (its values of type `Q`, widened to f32 on load).
#[derive(Clone, Copy, Debug)]
pub struct DecodeRow<Q: Elem = f32> {
    /// The query vector (`d` values).
    pub q: *const Q,
    /// The row's score rule: `spec.row0` is the row's index in the query sequence, its bias and
    /// mask pointers address the row (indexed by key). The sink is applied by
    /// [`merge_partials`], not by the kernel.
    pub spec: ScoreSpec,
}

/// A group of rows sharing K and V, and the key range `[j_begin, j_end)` to process. K and V are
/// read as `KV` (any [`Stored`] type, widened to f32 on load; `i8` rows times their scales).
#[derive(Clone, Copy, Debug)]
pub struct DecodeArgs<'a, Q: Elem = f32, KV: Stored = f32> {
    /// The rows (at most [`DECODE_MAX_ROWS`]).
    pub rows: &'a [DecodeRow<Q>],
    /// Head dimension of Q and K.
    pub d: usize,
    /// Head dimension of V.
    pub dv: usize,
    /// Key row `j` at `k + j*ldk` (in a paged cache: see [`KvPages`]).
    pub k: *const KV,
    /// Row stride of K.
    pub ldk: usize,
    /// Value row `j` at `v + j*ldv` (as `k`).
    pub v: *const KV,
    /// Row stride of V.
    pub ldv: usize,
    /// `i8` K only: key row `j` is `k_scale[j]·K[j]` (read for keys `< j_end`). Unused (may be
    /// null) for the float types.
    pub k_scale: *const f32,
    /// `i8` V only: value row `j` is `v_scale[j]·V[j]`, as `k_scale`.
    pub v_scale: *const f32,
    /// First key of the range.
    pub j_begin: usize,
    /// End of the key range (exclusive).
    pub j_end: usize,
    /// Softmax scale.
    pub scale: f32,
    /// How K and V are walked (speed only; every walk gives the same result).
    pub walk: DecodeWalk,
    /// How rows are addressed: [`KvPages::contiguous`] for `k + j·ldk`, or a page table.
    pub pages: KvPages,
}

impl<Q: Elem, KV: Stored> DecodeArgs<'_, Q, KV> {
    /// Key row `j`.
    ///
    /// # Safety
    /// `j < j_end`.
    #[inline(always)]
    unsafe fn k_row(&self, j: usize) -> *const KV {
        // SAFETY: the caller's contract and the struct's.
        unsafe { self.k.add(self.pages.at(j, self.pages.k_stride, self.ldk)) }
    }
    /// Value row `j`; as [`Self::k_row`].
    #[inline(always)]
    unsafe fn v_row(&self, j: usize) -> *const KV {
        // SAFETY: as `k_row`.
        unsafe { self.v.add(self.pages.at(j, self.pages.v_stride, self.ldv)) }
    }
    /// The rows from `j` to the end of its page (every row to `j_end` in a contiguous cache).
    ///
    /// # Safety
    /// As [`Self::k_row`].
    #[inline(always)]
    unsafe fn run(&self, j: usize) -> PageRun<KV> {
        let int8 = KV::DTYPE == Dtype::I8;
        // SAFETY: as `k_row`; int8 rows have scales, and the float types never use theirs.
        unsafe {
            PageRun {
                start: j,
                end: self.pages.page_end(j).min(self.j_end),
                k: self.k_row(j),
                v: self.v_row(j),
                k_scale: if int8 {
                    self.k_scale
                        .add(self.pages.at(j, self.pages.scale_stride, 1))
                } else {
                    self.k_scale
                },
                v_scale: if int8 {
                    self.v_scale
                        .add(self.pages.at(j, self.pages.scale_stride, 1))
                } else {
                    self.v_scale
                },
            }
        }
    }
}

/// Rows `[start, end)` of one page: row `j` at `k + (j − start)·ldk` and likewise V and the int8
/// scales. The key loops address rows through it, one table lookup per page instead of per key
/// (per key, the lookup cost the contiguous decode 4 %).
#[derive(Clone, Copy)]
struct PageRun<KV> {
    start: usize,
    end: usize,
    k: *const KV,
    v: *const KV,
    k_scale: *const f32,
    v_scale: *const f32,
}

impl<KV> PageRun<KV> {
    /// Whether row `j` lies in the run.
    #[inline(always)]
    fn holds(&self, j: usize) -> bool {
        self.start <= j && j < self.end
    }
}

/// K and V narrower than f32 (16 or 8 bits). This and the two below are tested in `const`
/// blocks, so an instance compiles only the variants its types can take (each is seconds of
/// build).
const fn narrow<KV: Stored>() -> bool {
    core::mem::size_of::<KV>() < 4
}

/// bf16 K and V read as pairs on `S`.
const fn bf16_pairs<S: Simd, KV: Stored>() -> bool {
    matches!(KV::DTYPE, Dtype::Bf16) && S::BF16_PAIRS
}

/// int8 K and V, with row scales.
const fn int8<KV: Stored>() -> bool {
    matches!(KV::DTYPE, Dtype::I8)
}

/// Where element `p` of a row lives in the kernel's buffers when the first `n2` elements (a
/// multiple of `2w`) are read as bf16 pairs ([`crate::simd::Simd::load_bf16_pairs`]): each group
/// of `2w` holds its even elements, then its odd ones. Q is stored so, and O accumulates so; the
/// order of a dot product's or an accumulator's terms is all it changes.
#[inline(always)]
fn paired(p: usize, n2: usize, w: usize) -> usize {
    if p < n2 {
        let g = p / (2 * w) * (2 * w);
        let i = p - g;
        g + i / 2 + (i % 2) * w
    } else {
        p
    }
}

/// Where the scaled query value `(r, p)` of `R` rows lives in the kernel's Q buffer (rows of
/// `dp` floats). With 8 lanes (16 registers) the rows' lane chunks are interleaved (chunk `c` of
/// row `r` at `c·R + r·w`), so one pointer with constant offsets reaches every row's chunk: the
/// per-row pointers spilled to the stack at R = 4 (Zen 2). With 16 lanes (32 registers) each row
/// is whole (`r·dp + p`): on Zen 4 the interleaved form ran the f32 cache ≈ 15 % slower from
/// DRAM and int8 5 % slower (docs/tuning-log.md, "Decode walks").
#[inline(always)]
fn q_at<const R: usize>(r: usize, p: usize, w: usize, dp: usize) -> usize {
    if w >= 16 {
        r * dp + p
    } else {
        p / w * (R * w) + r * w + p % w
    }
}

/// Floats of one row's partial result: `[m, l, o_0 … o_{dv−1}]`.
pub const fn partial_len(dv: usize) -> usize {
    dv + 2
}

/// Scratch floats [`crate::decode_partial`] needs.
pub fn decode_scratch_len(d: usize, dv: usize) -> usize {
    let r = DECODE_MAX_ROWS;
    r * d.div_ceil(16) * 16 + r * dv.div_ceil(16) * 16 + 2 * r * DECODE_KEY_BLOCK + ALIGN_SLACK
}

/// The K and V rows a key group prefetches (software, to L2), requested as the group's dot
/// products advance through K's columns, so the requests spread over the compute loop (sent in
/// one burst per group they were slower from DRAM): rows back to back (the usual cache layout)
/// as one run in address order, other rows a line of each at a time. Nothing is tracked per
/// line: a cursor over the lines cost the hot decode loop 23 % of its time on Zen 2, this 15 %
/// (docs/tuning-log.md, "Decode walks").
struct Ahead {
    /// First row of K and of V, and their row strides, in bytes.
    k: *const u8,
    v: *const u8,
    ldk: usize,
    ldv: usize,
    /// Rows to request (0: none).
    n: usize,
    /// Bytes of a K row and of a V row.
    kbytes: usize,
    vbytes: usize,
    /// Whether every row starts on a line (then offsets that are multiples of 64 reach them all).
    aligned: bool,
    /// Whether a step's lines are found the short way ([`Ahead::at`]): K's rows and V's rows
    /// are each back to back and of one length (the usual cache layout), and they are narrower
    /// than f32.
    short_way: bool,
}

impl Ahead {
    #[inline(always)]
    fn new<E: Stored>(
        k: *const E,
        ldk: usize,
        d: usize,
        v: *const E,
        ldv: usize,
        dv: usize,
        n: usize,
    ) -> Self {
        let size = core::mem::size_of::<E>();
        Ahead {
            k: k.cast(),
            v: v.cast(),
            ldk: ldk * size,
            ldv: ldv * size,
            n,
            kbytes: d * size,
            vbytes: dv * size,
            aligned: (k as usize | v as usize | (ldk * size) | (ldv * size)).is_multiple_of(64),
            short_way: ldk == d && ldv == dv && d == dv && size < 4,
        }
    }
    /// Requests the lines of K and V for a step over bytes `[bo, bo + sb)` of a row (`sb ≤ 64`).
    /// Rows back to back (the usual cache layout) are one run of `n·row` bytes, requested in
    /// address order at the same pace, `n·sb` bytes a step (one line a step for two f32 rows at
    /// W = 8); other rows get the line at `bo` of each row when a line starts there.
    #[inline(always)]
    fn at<const KEYS: usize>(&self, bo: usize, sb: usize) {
        // A full group over back-to-back narrow rows whose step spans at most one line of each
        // (`sb` is a constant here): a step whose offset starts a line requests that line of K
        // and of V, with no arithmetic on the row length. The general form below cost the hot
        // score loop a third of its instructions; f32 rows, and steps of several lines, stay
        // on it, as from DRAM they ran slower the short way (docs/tuning-log.md, "Decode
        // walks").
        let len = KEYS * sb;
        if self.short_way && self.n == KEYS && 64 % len == 0 {
            let lo = bo * KEYS;
            if lo.is_multiple_of(64) {
                crate::simd::prefetch_l2(self.k.wrapping_add(lo));
                crate::simd::prefetch_l2(self.v.wrapping_add(lo));
            }
            return;
        }
        // A prefetch never faults, so the addresses may be anywhere.
        let run = |p: *const u8, row: usize| {
            let (lo, hi) = (bo * self.n, (bo + sb).min(row) * self.n);
            let mut l = (lo + 63) & !63;
            while l < hi {
                crate::simd::prefetch_l2(p.wrapping_add(l));
                l += 64;
            }
        };
        let rows = |p: *const u8, ld: usize| {
            for i in 0..KEYS {
                if i < self.n {
                    crate::simd::prefetch_l2(p.wrapping_add(i * ld + bo));
                }
            }
        };
        let line = sb >= 64 || bo.is_multiple_of(64);
        if self.ldk == self.kbytes {
            run(self.k, self.kbytes);
        } else if line {
            rows(self.k, self.ldk);
        }
        if bo < self.vbytes {
            if self.ldv == self.vbytes && self.vbytes == self.kbytes {
                run(self.v, self.vbytes);
            } else if line {
                rows(self.v, self.ldv);
            }
        }
    }
    /// After the loop reached byte `done` of the K rows: the lines it did not request (K's
    /// tail, V past K's length, each row's last line when rows are not line-aligned).
    #[inline(always)]
    fn rest(&self, done: usize) {
        for i in 0..self.n {
            let (k, v) = (
                self.k.wrapping_add(i * self.ldk),
                self.v.wrapping_add(i * self.ldv),
            );
            let mut b = done.div_ceil(64) * 64;
            while b < self.kbytes.max(self.vbytes) {
                if b < self.kbytes {
                    crate::simd::prefetch_l2(k.wrapping_add(b));
                }
                if b < self.vbytes {
                    crate::simd::prefetch_l2(v.wrapping_add(b));
                }
                b += 64;
            }
            if !self.aligned {
                if self.kbytes > 0 {
                    crate::simd::prefetch_l2(k.wrapping_add(self.kbytes - 1));
                }
                if self.vbytes > 0 {
                    crate::simd::prefetch_l2(v.wrapping_add(self.vbytes - 1));
                }
            }
        }
    }
}

/// The decode kernel for `R` rows: scores in groups of `KEYS` keys, walked key-major (`KM`) or
/// chunk-major, and `O += P·V` in passes of `RG` rows × `NC` lane chunks.
///
/// Key-major: K and V are two sequential streams, and they advance together: the scores of key
/// block `b` are computed in sub-blocks of [`SUB_KEYS`] keys, each followed by `P·V` for the same
/// keys of block `b − 1`, whose softmax weights are ready (two score buffers). With a whole
/// block of K read and then a whole block of V, each stream idles half the time and the
/// prefetchers fall behind. Chunk-major: scores, softmax and `P·V` of a block in turn, with
/// software prefetch.
///
/// # Safety
/// Pointers in `args` valid for the extents they describe (K/V rows `< j_end`, `d`/`dv` columns;
/// bias/mask entries `< j_end`; for `i8`, scales `< j_end`); `partial` writable at
/// `r*ldp + [0, dv+2)` for each row; `scratch.len() ≥ decode_scratch_len(d, dv)`; the ISA of `S`
/// is enabled.
#[inline(always)]
unsafe fn decode_rows<
    S: SimdDiv,
    Q: Elem,
    KV: Stored,
    const R: usize,
    const KEYS: usize,
    const KM: bool,
    const RG: usize,
    const NC: usize,
    const PF: bool,
>(
    a: &DecodeArgs<Q, KV>,
    partial: *mut f32,
    ldp: usize,
    scratch: &mut [f32],
) {
    let w = S::W;
    let (d, dv) = (a.d, a.dv);
    let dp = d.div_ceil(w) * w;
    let dvp = dv.div_ceil(w) * w;
    const KB: usize = DECODE_KEY_BLOCK;
    let sub = if KM {
        KEYS * SUB_KEYS.div_ceil(KEYS)
    } else {
        KB
    };
    let (qbuf, rest) = aligned(scratch).split_at_mut(R * dp);
    let (obuf, rest) = rest.split_at_mut(R * dvp);
    let (s_even, rest) = rest.split_at_mut(R * KB);
    let s_odd = &mut rest[..R * KB];
    let mut sb = [s_even, s_odd];
    let rows = &a.rows[..R];
    let mut st = RowState {
        m: [f32::NEG_INFINITY; R],
        l: [0.0f32; R],
    };
    let qscale = a.scale * LOG2E;
    assert!(R * KEYS <= w, "decode: R·KEYS exceeds the lanes");
    // bf16 K and V are read as pairs where the ISA splits them cheaply: the first `d2` columns
    // of Q (scores) and `dv2` of O (P·V, when its passes take whole pairs) in pair order.
    let pairs = const { bf16_pairs::<S, KV>() };
    let d2 = if pairs { d / (2 * w) * (2 * w) } else { 0 };
    let dv2 = if pairs && NC.is_multiple_of(2) {
        dv / (2 * w) * (2 * w)
    } else {
        0
    };

    // SAFETY: (whole body) all accesses are inside the extents of the contract above; scratch
    // slices were split to their sizes; `dp`, `dvp`, `KB` are lane multiples.
    unsafe {
        qbuf.fill(0.0);
        obuf.fill(0.0);
        for (r, row) in rows.iter().enumerate() {
            for p in 0..d {
                qbuf[q_at::<R>(r, paired(p, d2, w), w, dp)] = get(row.q.add(p)) * qscale;
            }
        }
        let ranges: [(usize, usize); R] = core::array::from_fn(|r| rows[r].spec.visible_range(0));
        let jlo = ranges.iter().map(|r| r.0).min().unwrap_or(0).max(a.j_begin);
        let jhi = ranges.iter().map(|r| r.1).max().unwrap_or(0).min(a.j_end);
        // The block whose weights are ready and whose P·V is still to do: (first key, keys).
        let mut prev: Option<(usize, usize)> = None;
        let mut jb = jlo;
        let mut cur = 0;
        while jb < jhi || prev.is_some() {
            let nk = if jb < jhi { KB.min(jhi - jb) } else { 0 };
            let [s0, s1] = &mut sb;
            let (scur, sprev) = if cur == 0 { (s0, &*s1) } else { (s1, &*s0) };
            let pn = prev.map_or(0, |(_, n)| n);
            let mut k0 = 0;
            while k0 < nk.max(pn) {
                if k0 < nk {
                    let k1 = nk.min(k0 + sub);
                    scores::<S, Q, KV, R, KEYS, KM, PF>(
                        a,
                        qbuf.as_ptr(),
                        d2,
                        jb,
                        k0,
                        k1,
                        scur.as_mut_ptr(),
                    );
                }
                if let Some((pj, pn)) = prev.filter(|&(_, n)| k0 < n) {
                    let k1 = pn.min(k0 + sub);
                    pv_block::<S, Q, KV, R, RG, NC>(a, pj, k0, k1, sprev, obuf, dvp, dv2);
                }
                k0 += sub;
            }
            if nk > 0 {
                // Every P·V of the previous block is done: now the rescale may touch O.
                if const { int8::<KV>() } {
                    // Each score times its int8 key row's scale, before the score rule (which
                    // may be nonlinear: softcap).
                    scale_keys::<S, Q, KV, R>(a, false, jb, nk, scur);
                }
                softmax_block::<S, Q, R>(rows, jb, nk, scur, obuf, dvp, &mut st);
                if const { int8::<KV>() } {
                    // The sums are taken; P·V weighs each int8 value row by its scale.
                    scale_keys::<S, Q, KV, R>(a, true, jb, nk, scur);
                }
                if KM {
                    prev = Some((jb, nk));
                    cur ^= 1;
                } else {
                    // Chunk-major groups read V right away, as their prefetches expect.
                    pv_block::<S, Q, KV, R, RG, NC>(a, jb, 0, nk, scur, obuf, dvp, dv2);
                }
            } else {
                prev = None;
            }
            jb += nk;
        }
        for r in 0..R {
            let out = partial.add(r * ldp);
            *out = st.m[r];
            *out.add(1) = st.l[r];
            for p in 0..dv {
                *out.add(2 + p) = obuf[r * dvp + paired(p, dv2, w)];
            }
        }
    }
}

/// `O += P·V` for keys `jb + [k0, k1)` of one block, in passes of RG rows; the first `dv2`
/// columns of O in pair order.
///
/// # Safety
/// As [`decode_rows`]; `p` holds the block's weights (R rows of [`DECODE_KEY_BLOCK`]), `o` R
/// rows of `dvp` floats; `dv2 > 0` only for bf16 V and even NC.
#[inline(always)]
unsafe fn pv_block<
    S: Simd,
    Q: Elem,
    KV: Stored,
    const R: usize,
    const RG: usize,
    const NC: usize,
>(
    a: &DecodeArgs<Q, KV>,
    jb: usize,
    k0: usize,
    k1: usize,
    p: &[f32],
    o: &mut [f32],
    dvp: usize,
    dv2: usize,
) {
    // One segment per page the keys span (one in a contiguous cache), all in one pass: the
    // accumulators stay in registers across a page end (a pass per page reloaded them: page-2
    // decode ran 11 % slower, page 16 within noise). Each output element still takes its keys'
    // products in key order.
    let seg_end = |k: usize| k1.min(a.pages.page_end(jb + k) - jb);
    // SAFETY: key `jb + k0` lies in the range the contract covers.
    let first = (unsafe { a.v_row(jb + k0) }, seg_end(k0) - k0);
    if k0 + first.1 == k1 {
        // SAFETY: forwarded contract; one segment.
        unsafe { pv_pass::<S, KV, R, RG, NC>(&[first], a, p, k0, o, dvp, dv2) };
    } else {
        let mut segs = [first; DECODE_KEY_BLOCK];
        let mut n = 1;
        let mut k = k0 + first.1;
        while k < k1 {
            let ks = seg_end(k);
            // SAFETY: key `jb + k` lies in the range the contract covers.
            segs[n] = (unsafe { a.v_row(jb + k) }, ks - k);
            n += 1;
            k = ks;
        }
        // SAFETY: forwarded contract; the segments cover keys `[k0, k1)` in order.
        unsafe { pv_pass::<S, KV, R, RG, NC>(&segs[..n], a, p, k0, o, dvp, dv2) };
    }
}

/// `O += P·V` for `R` rows in groups of RG, V rows in `segs` (each inside one page), weights
/// from column `k0` of `p`.
///
/// # Safety
/// As [`pv_block`].
#[inline(always)]
unsafe fn pv_pass<S: Simd, KV: Stored, const R: usize, const RG: usize, const NC: usize>(
    segs: &[(*const KV, usize)],
    a: &DecodeArgs<impl Elem, KV>,
    p: &[f32],
    k0: usize,
    o: &mut [f32],
    dvp: usize,
    dv2: usize,
) {
    const KB: usize = DECODE_KEY_BLOCK;
    let blk = PvBlock {
        segs,
        ldv: a.ldv,
        dv: a.dv,
        dvp,
        dv2,
    };
    let mut r0 = 0;
    // SAFETY: row groups stay inside the R rows of `p` and `o`.
    unsafe {
        while r0 + RG <= R {
            let (pp, op) = (p.as_ptr().add(r0 * KB + k0), o.as_mut_ptr().add(r0 * dvp));
            pv_rows::<S, KV, RG, NC>(&blk, pp, op);
            r0 += RG;
        }
        let (pp, op) = (p.as_ptr().add(r0 * KB + k0), o.as_mut_ptr().add(r0 * dvp));
        // What the groups leave: R mod RG, a constant, so only that remainder compiles.
        match const { R % RG } {
            1 => pv_rows::<S, KV, 1, NC>(&blk, pp, op),
            2 => pv_rows::<S, KV, 2, NC>(&blk, pp, op),
            3 => pv_rows::<S, KV, 3, NC>(&blk, pp, op),
            _ => {}
        }
    }
}

/// Multiplies column `k` of the R rows of `buf` (`buf[r·KB + k]`, `k < nk`) by the int8 scale
/// of key `jb + k`: of its key row (`v` false) or value row. A vector of keys at a time within
/// a page run; per key, inside the score loop, the lookups took a tenth of the int8 decode.
///
/// # Safety
/// As [`decode_rows`], for `i8` K/V; keys `jb + [0, nk)` lie in the range; `buf` holds R rows
/// of [`DECODE_KEY_BLOCK`].
#[inline(always)]
unsafe fn scale_keys<S: Simd, Q: Elem, KV: Stored, const R: usize>(
    a: &DecodeArgs<Q, KV>,
    v: bool,
    jb: usize,
    nk: usize,
    buf: &mut [f32],
) {
    const KB: usize = DECODE_KEY_BLOCK;
    let w = S::W;
    let b = buf[..R * KB].as_mut_ptr();
    let mut k = 0;
    // SAFETY: the scales of keys `< j_end` are readable (the contract); each run's keys are
    // `[k, k + n)` with `k + n ≤ nk ≤ KB`.
    unsafe {
        while k < nk {
            let run = a.run(jb + k);
            let sc = if v { run.v_scale } else { run.k_scale };
            let n = run.end.min(jb + nk) - (jb + k);
            let mut i = 0;
            while i + w <= n {
                let x = S::load(sc.add(i));
                for r in 0..R {
                    let p = b.add(r * KB + k + i);
                    S::store(p, S::mul(S::load(p), x));
                }
                i += w;
            }
            while i < n {
                let x = *sc.add(i);
                for r in 0..R {
                    *b.add(r * KB + k + i) *= x;
                }
                i += 1;
            }
            k += n;
        }
    }
}

/// Running (base-2) max and sum per row.
struct RowState<const R: usize> {
    m: [f32; R],
    l: [f32; R],
}

/// Scores of keys `jb + [k0, k1)` for `R` rows into `s[r*KB + k]`: groups of KEYS keys × R rows
/// of dot products, each K chunk load serving R rows (Q comes from L1); one transposed reduction
/// turns the R·KEYS sums into one register of scores.
///
/// # Safety
/// As [`decode_rows`]; `q` holds R rows of scaled query values, laid out by [`q_at`] (the
/// first `d2` of a row in pair order, `d2 > 0` only for bf16 K); `s` writable for R rows of
/// [`DECODE_KEY_BLOCK`]; `k1 ≤ DECODE_KEY_BLOCK`.
#[inline(always)]
unsafe fn scores<
    S: Simd,
    Q: Elem,
    KV: Stored,
    const R: usize,
    const KEYS: usize,
    const KM: bool,
    const PF: bool,
>(
    a: &DecodeArgs<Q, KV>,
    q: *const f32,
    d2: usize,
    jb: usize,
    k0: usize,
    k1: usize,
    s: *mut f32,
) {
    const KB: usize = DECODE_KEY_BLOCK;
    let w = S::W;
    let d = a.d;
    let dfull = d / w * w;
    let dp = d.div_ceil(w) * w;
    let mut sums = [0.0f32; 16];
    // The prefetch distance in f32 keys (narrower K/V: the same bytes ahead); `decode` resolved
    // the walk.
    let dist = if a.walk == DecodeWalk::Prefetch {
        PF_PREFETCH
    } else {
        PF_STREAMS
    };
    // SAFETY: every access stays within the extents of the contract.
    unsafe {
        let mut run = a.run(jb + k0);
        let mut pf_run = run;
        let mut jj = k0;
        while jj < k1 {
            let live = KEYS.min(k1 - jj);
            let j0 = jb + jj;
            if !run.holds(j0) {
                run = a.run(j0);
            }
            let mut kp = [a.k; KEYS];
            for (k, p) in kp.iter_mut().enumerate() {
                // A short last group repeats its last key (computed, not stored).
                let j = j0 + k.min(live - 1);
                *p = if run.holds(j) {
                    run.k.add((j - run.start) * a.ldk)
                } else {
                    a.k_row(j)
                };
            }
            let acc = if KM {
                dots_key_major::<S, KV, R, KEYS>(kp, q, dp, d2, dfull)
            } else {
                // Walking KEYS rows side by side hides K from the hardware prefetchers, so the
                // K and V rows `dist` keys on are requested explicitly (not PF: none, for
                // one-key groups on cores whose prefetchers follow them alone).
                let jp = jb + jj + dist * 4 / core::mem::size_of::<KV>();
                let npf = if PF && jp < a.j_end {
                    KEYS.min(a.j_end - jp)
                } else {
                    0
                };
                // The prefetched rows keep their own page run, so a page costs one table
                // lookup here too. Rows past a page's end are requested at the wrong address,
                // harmlessly.
                let (kpf, vpf) = if npf > 0 {
                    if !pf_run.holds(jp) {
                        pf_run = a.run(jp);
                    }
                    let off = jp - pf_run.start;
                    if KV::DTYPE == Dtype::I8 && !a.pages.is_contiguous() {
                        // Each page keeps its int8 scales apart from the next page's, where
                        // the hardware prefetchers do not follow them (a contiguous cache's
                        // scales are one stream they do): requested with the rows.
                        crate::simd::prefetch_l2(pf_run.k_scale.wrapping_add(off).cast());
                        crate::simd::prefetch_l2(pf_run.v_scale.wrapping_add(off).cast());
                    }
                    (pf_run.k.add(off * a.ldk), pf_run.v.add(off * a.ldv))
                } else {
                    (a.k, a.v)
                };
                let ahead = Ahead::new(kpf, a.ldk, d, vpf, a.ldv, a.dv, npf);
                dots_chunk_major::<S, KV, R, KEYS>(kp, q, dp, d2, dfull, &ahead)
            };
            let mut regs = [S::splat(0.0); 16];
            for r in 0..R {
                for k in 0..KEYS {
                    regs[r * KEYS + k] = acc[r][k];
                }
            }
            S::store(sums.as_mut_ptr(), S::hsums(&regs[..w]));
            for r in 0..R {
                for (k, &kp) in kp.iter().enumerate().take(live) {
                    let mut x = sums[r * KEYS + k];
                    for p in dfull..d {
                        x += *q.add(q_at::<R>(r, p, w, dp)) * get(kp.add(p));
                    }
                    *s.add(r * KB + jj + k) = x;
                }
            }
            jj += KEYS;
        }
    }
}

/// `R × KEYS` dot products over the first `dfull` (a lane multiple) columns, each key's row
/// read start to end, so K stays one sequential stream for the hardware prefetchers; Q comes
/// from L1. The first `d2` columns are read as bf16 pairs (Q in pair order there).
///
/// # Safety
/// `kp[k]` readable for `dfull` values; `q` for R rows of `dp` laid out by [`q_at`]; `d2 > 0`
/// only for bf16 K, a multiple of `2W`; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn dots_key_major<S: Simd, KV: Stored, const R: usize, const KEYS: usize>(
    kp: [*const KV; KEYS],
    q: *const f32,
    dp: usize,
    d2: usize,
    dfull: usize,
) -> [[S::V; KEYS]; R] {
    let w = S::W;
    // SAFETY: every access stays within the extents of the contract.
    unsafe {
        let mut acc = [[S::splat(0.0); KEYS]; R];
        for (k, &p) in kp.iter().enumerate() {
            let mut c = 0;
            while const { bf16_pairs::<S, KV>() } && c < d2 {
                let [ke, ko] = S::load_bf16_pairs(p.add(c).cast());
                for (r, accr) in acc.iter_mut().enumerate() {
                    accr[k] = S::fma(S::load(q.add(q_at::<R>(r, c, w, dp))), ke, accr[k]);
                    accr[k] = S::fma(S::load(q.add(q_at::<R>(r, c + w, w, dp))), ko, accr[k]);
                }
                c += 2 * w;
            }
            while c < dfull {
                let kv = S::load_as(p.add(c));
                for (r, accr) in acc.iter_mut().enumerate() {
                    accr[k] = S::fma(S::load(q.add(q_at::<R>(r, c, w, dp))), kv, accr[k]);
                }
                c += w;
            }
        }
        acc
    }
}

/// `R × KEYS` dot products, chunk by chunk across the KEYS rows, so each Q chunk load serves
/// KEYS keys (fewer loads when R is large); the rows of `ahead` are requested along the way.
///
/// # Safety
/// As [`dots_key_major`].
#[inline(always)]
unsafe fn dots_chunk_major<S: Simd, KV: Stored, const R: usize, const KEYS: usize>(
    kp: [*const KV; KEYS],
    q: *const f32,
    dp: usize,
    d2: usize,
    dfull: usize,
    ahead: &Ahead,
) -> [[S::V; KEYS]; R] {
    let w = S::W;
    let size = core::mem::size_of::<KV>();
    // Pair steps hold either the rows' two Q chunks or the keys' two K chunks in registers,
    // whichever fits beside the R·KEYS accumulators.
    let q_held = 2 * R + R * KEYS + 2 <= if w == 16 { 32 } else { 16 };
    // SAFETY: every access stays within the extents of the contract.
    unsafe {
        let mut acc = [[S::splat(0.0); KEYS]; R];
        let mut c = 0;
        while const { bf16_pairs::<S, KV>() } && c < d2 {
            ahead.at::<KEYS>(c * size, 2 * w * size);
            if q_held {
                // Plain loops, not `array::from_fn`: a closure may stay out of line, and then
                // the intrinsics in it run without the ISA's target features.
                let mut qv = [[S::splat(0.0); 2]; R];
                for (r, x) in qv.iter_mut().enumerate() {
                    *x = [
                        S::load(q.add(q_at::<R>(r, c, w, dp))),
                        S::load(q.add(q_at::<R>(r, c + w, w, dp))),
                    ];
                }
                for (k, p) in kp.iter().enumerate() {
                    let [ke, ko] = S::load_bf16_pairs(p.add(c).cast());
                    for (accr, qr) in acc.iter_mut().zip(&qv) {
                        accr[k] = S::fma(qr[0], ke, accr[k]);
                        accr[k] = S::fma(qr[1], ko, accr[k]);
                    }
                }
            } else {
                let mut kv = [[S::splat(0.0); 2]; KEYS];
                for (x, p) in kv.iter_mut().zip(kp) {
                    *x = S::load_bf16_pairs(p.add(c).cast());
                }
                for (r, accr) in acc.iter_mut().enumerate() {
                    for h in 0..2 {
                        let qv = S::load(q.add(q_at::<R>(r, c + h * w, w, dp)));
                        for k in 0..KEYS {
                            accr[k] = S::fma(qv, kv[k][h], accr[k]);
                        }
                    }
                }
            }
            c += 2 * w;
        }
        while c < dfull {
            ahead.at::<KEYS>(c * size, w * size);
            let mut kv = [S::splat(0.0); KEYS];
            for (x, p) in kv.iter_mut().zip(kp) {
                *x = S::load_as(p.add(c));
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                let qv = S::load(q.add(q_at::<R>(r, c, w, dp)));
                for k in 0..KEYS {
                    accr[k] = S::fma(qv, kv[k], accr[k]);
                }
            }
            c += w;
        }
        ahead.rest(dfull * size);
        acc
    }
}

/// Masks the scores of keys `jb + [0, nk)`, then the online-softmax step per row: the scores
/// become weights `2^(s − m)`, `l` and `m` are updated and the rows of O rescaled.
///
/// # Safety
/// Row bias/mask pointers valid for keys `< jb + nk`; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn softmax_block<S: SimdDiv, Q: Elem, const R: usize>(
    rows: &[DecodeRow<Q>],
    jb: usize,
    nk: usize,
    sbuf: &mut [f32],
    obuf: &mut [f32],
    dvp: usize,
    st: &mut RowState<R>,
) {
    const KB: usize = DECODE_KEY_BLOCK;
    let w = S::W;
    // SAFETY: every access stays within the extents of the contract; KB and dvp are lane
    // multiples.
    unsafe {
        for (r, row) in rows.iter().enumerate().take(R) {
            let srow = &mut sbuf[r * KB..(r + 1) * KB];
            row.spec.apply_row::<S>(0, jb, &mut srow[..nk], LOG2E);
            srow[nk..].fill(f32::NEG_INFINITY);
            let mut mx = S::splat(f32::NEG_INFINITY);
            for c in (0..KB).step_by(w) {
                mx = S::max(mx, S::load(srow.as_ptr().add(c)));
            }
            let blk = S::hmax(mx);
            let m_old = st.m[r];
            let m_new = if blk > m_old || blk.is_nan() {
                blk
            } else {
                m_old
            };
            // Exponentiate against a finite stand-in while nothing is visible (see flash.rs).
            let m_use = if m_new == f32::NEG_INFINITY {
                -f32::MAX
            } else {
                m_new
            };
            let al = (m_old - m_use).exp2();
            let mu = S::splat(m_use);
            let mut sum = S::splat(0.0);
            for c in (0..KB).step_by(w) {
                let e = exp2::<S>(S::sub(S::load(srow.as_ptr().add(c)), mu));
                S::store(srow.as_mut_ptr().add(c), e);
                sum = S::add(sum, e);
            }
            st.l[r] = st.l[r] * al + S::hsum(sum);
            if al != 1.0 {
                let av = S::splat(al);
                for c in (0..dvp).step_by(w) {
                    let p = obuf.as_mut_ptr().add(r * dvp + c);
                    S::store(p, S::mul(S::load(p), av));
                }
            }
            st.m[r] = m_new;
        }
    }
}

/// One key block of V for [`pv_rows`]: segments `(v, n)` of rows `v + jj*ldv`, `jj < n`, one
/// per page the block spans; the block's weights run on across segments.
struct PvBlock<'a, KV> {
    segs: &'a [(*const KV, usize)],
    ldv: usize,
    dv: usize,
    dvp: usize,
    /// Columns `[0, dv2)` are read as bf16 pairs (O in pair order there); 0 for none.
    dv2: usize,
}

/// `O[g] += Σ_jj P[g][jj]·V[jj]` for `G` rows: `P` rows at `p + g*KB`, `O` rows at `o + g*dvp`,
/// NC lane chunks per pass, so G·NC independent accumulators hide the FMA latency and each V
/// chunk load serves every row.
///
/// # Safety
/// `blk` describes readable V rows; `p` readable for `G` rows of `nk` weights (stride
/// [`DECODE_KEY_BLOCK`]); `o` writable for `G` rows of `dvp` floats; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn pv_rows<S: Simd, KV: Stored, const G: usize, const NC: usize>(
    blk: &PvBlock<'_, KV>,
    p: *const f32,
    o: *mut f32,
) {
    const KB: usize = DECODE_KEY_BLOCK;
    let w = S::W;
    let dvfull = blk.dv / w * w;
    // SAFETY: every access stays within the extents of the contract; `dv2` is a multiple of
    // `2w` and NC is even when it is not 0, so pair passes take whole pairs.
    unsafe {
        let mut c = 0;
        if const { bf16_pairs::<S, KV>() && NC.is_multiple_of(2) } {
            while c < blk.dv2 {
                let nc = NC.min((blk.dv2 - c) / w);
                pv_chunks::<S, KV, G, NC, true>(blk, p, o, c, nc);
                c += nc * w;
            }
        }
        while c < dvfull {
            let nc = NC.min((dvfull - c) / w);
            pv_chunks::<S, KV, G, NC, false>(blk, p, o, c, nc);
            c += nc * w;
        }
        if dvfull < blk.dv {
            let mut pj = p;
            for &(v, n) in blk.segs {
                for jj in 0..n {
                    let vp = v.add(jj * blk.ldv);
                    for g in 0..G {
                        let pw = *pj.add(g * KB + jj);
                        for c in dvfull..blk.dv {
                            *o.add(g * blk.dvp + c) += pw * get(vp.add(c));
                        }
                    }
                }
                pj = pj.add(n);
            }
        }
    }
}

/// One pass of [`pv_rows`]: lane chunks `[c, c + nc·w)` of O, `nc ≤ NC`; with `PAIR`, V read as
/// bf16 pairs (chunks `2i`, `2i + 1` the even and odd values of `2w` columns; `nc` even).
///
/// # Safety
/// As [`pv_rows`]; the chunks lie inside `dvfull` (with `PAIR`, inside `blk.dv2`).
#[inline(always)]
unsafe fn pv_chunks<S: Simd, KV: Stored, const G: usize, const NC: usize, const PAIR: bool>(
    blk: &PvBlock<'_, KV>,
    p: *const f32,
    o: *mut f32,
    c: usize,
    nc: usize,
) {
    const KB: usize = DECODE_KEY_BLOCK;
    let w = S::W;
    let step = if PAIR { 2 } else { 1 };
    // SAFETY: every access stays within the extents of the contract.
    unsafe {
        let mut acc = [[S::splat(0.0); NC]; G];
        for g in 0..G {
            for (cb, x) in acc[g].iter_mut().enumerate().take(nc) {
                *x = S::load(o.add(g * blk.dvp + c + cb * w));
            }
        }
        // Full passes run a branch-free body; only the last pass of a row is shorter.
        let full_pass = nc == NC;
        let mut pj = p;
        for &(v, n) in blk.segs {
            for jj in 0..n {
                let vrow = v.add(jj * blk.ldv + c);
                let mut pr = [S::splat(0.0); G];
                for g in 0..G {
                    pr[g] = S::splat(*pj.add(g * KB + jj));
                }
                if full_pass {
                    for cb in (0..NC).step_by(step) {
                        pv_chunk::<S, KV, G, NC, PAIR>(&mut acc, &pr, vrow, cb);
                    }
                } else {
                    for cb in (0..nc).step_by(step) {
                        pv_chunk::<S, KV, G, NC, PAIR>(&mut acc, &pr, vrow, cb);
                    }
                }
            }
            pj = pj.add(n);
        }
        for g in 0..G {
            for (cb, x) in acc[g].iter().enumerate().take(nc) {
                S::store(o.add(g * blk.dvp + c + cb * w), *x);
            }
        }
    }
}

/// `acc[g][cb] += pr[g]·V[cb]` for lane chunk `cb` of the V row at `vrow` (with `PAIR`, chunks
/// `cb` and `cb + 1` from one bf16 pair load).
///
/// # Safety
/// As [`pv_chunks`]; the chunks are readable at `vrow`.
#[inline(always)]
unsafe fn pv_chunk<S: Simd, KV: Stored, const G: usize, const NC: usize, const PAIR: bool>(
    acc: &mut [[S::V; NC]; G],
    pr: &[S::V; G],
    vrow: *const KV,
    cb: usize,
) {
    let w = S::W;
    // SAFETY: forwarded contract.
    unsafe {
        if PAIR {
            let vv = S::load_bf16_pairs(vrow.add(cb * w).cast());
            for g in 0..G {
                acc[g][cb] = S::fma(pr[g], vv[0], acc[g][cb]);
                acc[g][cb + 1] = S::fma(pr[g], vv[1], acc[g][cb + 1]);
            }
        } else {
            let vv = S::load_as(vrow.add(cb * w));
            for g in 0..G {
                acc[g][cb] = S::fma(pr[g], vv, acc[g][cb]);
            }
        }
    }
}

/// One variant of [`decode_rows`], run out of line by [`Simd::isolate`].
struct Rows<
    's,
    'a,
    Q: Elem,
    KV: Stored,
    const R: usize,
    const KEYS: usize,
    const KM: bool,
    const RG: usize,
    const NC: usize,
    const PF: bool,
> {
    a: &'s DecodeArgs<'a, Q, KV>,
    partial: *mut f32,
    ldp: usize,
    scratch: &'s mut [f32],
}

impl<
        S: SimdDiv,
        Q: Elem,
        KV: Stored,
        const R: usize,
        const KEYS: usize,
        const KM: bool,
        const RG: usize,
        const NC: usize,
        const PF: bool,
    > Body<S> for Rows<'_, '_, Q, KV, R, KEYS, KM, RG, NC, PF>
{
    #[inline(always)]
    unsafe fn run(self) {
        // SAFETY: the contract of `decode_rows`, which `decode` vouches for.
        unsafe {
            decode_rows::<S, Q, KV, R, KEYS, KM, RG, NC, PF>(
                self.a,
                self.partial,
                self.ldp,
                self.scratch,
            )
        }
    }
}

/// Runs [`decode_rows`] for `args.rows.len()` rows, in passes of up to [`DECODE_MAX_ROWS`].
///
/// # Safety
/// As [`decode_rows`].
#[inline(always)]
pub(crate) unsafe fn decode<S: SimdDiv, Q: Elem, KV: Stored>(
    a: &DecodeArgs<Q, KV>,
    partial: *mut f32,
    ldp: usize,
    scratch: &mut [f32],
) {
    let mut r0 = 0;
    while r0 < a.rows.len() {
        let n = DECODE_MAX_ROWS.min(a.rows.len() - r0);
        let sub = DecodeArgs {
            rows: &a.rows[r0..r0 + n],
            walk: a.walk.resolve(),
            ..*a
        };
        // SAFETY: forwarded contract; the row subset and its partial rows stay in bounds.
        unsafe {
            let p = partial.add(r0 * ldp);
            // Pages end the streams the hardware prefetchers follow (every 8 KiB of f32 K at
            // page 16), so a paged cache takes the software-prefetch walk on every core (Zen 4,
            // f32, page 16: 0.49–0.67 of the contiguous cache on the key-major walk).
            let streams = sub.walk == DecodeWalk::Streams && sub.pages.is_contiguous();
            macro_rules! run {
                // The lane count in a `const` block: each ISA compiles only its own variants.
                ($r:literal, $s16:tt, $p16:tt, $s8:tt, $p8:tt) => {
                    if const { S::W == 16 } {
                        if streams {
                            run!(@ $r, $s16)
                        } else {
                            run!(@ $r, $p16)
                        }
                    } else if streams {
                        run!(@ $r, $s8)
                    } else {
                        run!(@ $r, $p8)
                    }
                };
                (@ $r:literal, ($k:literal, $km:literal, $rg:literal, $nc:literal, $pf:literal)) => {
                    S::isolate(Rows::<Q, KV, $r, $k, $km, $rg, $nc, $pf> {
                        a: &sub,
                        partial: p,
                        ldp,
                        scratch: &mut *scratch,
                    })
                };
            }
            // (KEYS, key-major walk, RG, NC, software prefetch) per walk, for W = 16 (32
            // registers) and W = 8 (16): KEYS keys per score group (R·KEYS ≤ W accumulators);
            // P·V in passes of RG rows × NC lane chunks (RG·NC accumulators).
            //
            // `Streams` (measured on Zen 4): one row reads K one key at a time as a single
            // sequential stream, no software prefetch; at W = 16 the key-major walk for R = 2,
            // 3, 4, 6, where the rows split into equal P·V passes that each take a whole V row
            // (R = 4: 14.7 → 19.2 GB/s), chunk-major with prefetch for R = 5, 7, 8 and at W = 8.
            // The key-major speed is fragile: it depends on code layout.
            //
            // `Prefetch` (measured on the Xeon): chunk-major with software prefetch for every
            // group. Figures for both: docs/tuning-log.md, "Decode walks".
            match n {
                // Narrow K and V (16 or 8 bits) make a one-row group compute-bound: groups of
                // 8 keys, so one reduction serves 8 scores and 8 FMA chains run side by side.
                // 16-bit rows at W = 16 under `Streams` walk them key-major (Zen 4, Hkv = Hq =
                // 32, Lk 8192, cold: bf16 9.5–9.8 → 5.9–6.7 ms, f16 8.9–11.0 → 6.2–9.6); int8
                // rows (128 bytes at D = 128) ran slower so (5.6–6.0 → 10.3).
                1 if const { narrow::<KV>() && !int8::<KV>() } => run!(
                    1,
                    (8, true, 1, 8, false),
                    (8, false, 1, 8, true),
                    (8, false, 1, 8, true),
                    (8, false, 1, 8, true)
                ),
                1 if const { int8::<KV>() } => run!(
                    1,
                    (8, false, 1, 8, true),
                    (8, false, 1, 8, true),
                    (8, false, 1, 8, true),
                    (8, false, 1, 8, true)
                ),
                1 => run!(
                    1,
                    (1, false, 1, 8, false),
                    (1, false, 1, 8, true),
                    (1, false, 1, 8, false),
                    (1, false, 1, 8, true)
                ),
                2 => run!(
                    2,
                    (8, true, 2, 8, false),
                    (4, false, 2, 8, true),
                    (4, false, 2, 6, true),
                    (4, false, 2, 6, true)
                ),
                3 => run!(
                    3,
                    (4, true, 3, 8, false),
                    (4, false, 3, 8, true),
                    (2, false, 3, 4, true),
                    (2, false, 3, 4, true)
                ),
                // Narrow V: all four rows in one P·V pass, so each V chunk is widened once.
                4 if const { narrow::<KV>() } => run!(
                    4,
                    (4, false, 4, 4, true),
                    (4, false, 4, 4, true),
                    (2, false, 4, 2, true),
                    (2, false, 4, 2, true)
                ),
                // A paged f32 cache under `Streams`: two keys a group, not the Xeon's four
                // (Zen 4, Hkv 8, Lk 8192, page 16: 5.18 → 4.75 ms, medians of 6; page 128
                // level).
                4 if const { S::W == 16 && !narrow::<KV>() }
                    && sub.walk == DecodeWalk::Streams
                    && !streams =>
                {
                    run!(@ 4, (2, false, 2, 8, true))
                }
                4 => run!(
                    4,
                    (4, true, 2, 8, false),
                    (4, false, 2, 8, true),
                    (2, false, 4, 2, true),
                    (2, false, 4, 2, true)
                ),
                5 => run!(
                    5,
                    (3, false, 5, 4, true),
                    (3, false, 5, 4, true),
                    (1, false, 5, 2, true),
                    (1, false, 5, 2, true)
                ),
                6 => run!(
                    6,
                    (2, true, 3, 8, false),
                    (2, false, 3, 8, true),
                    (1, false, 6, 1, true),
                    (1, false, 6, 1, true)
                ),
                7 => run!(
                    7,
                    (2, false, 7, 3, true),
                    (2, false, 7, 3, true),
                    (1, false, 7, 1, true),
                    (1, false, 7, 1, true)
                ),
                _ => run!(
                    8,
                    (2, false, 8, 2, true),
                    (2, false, 8, 2, true),
                    (1, false, 8, 1, true),
                    (1, false, 8, 1, true)
                ),
            }
        }
        r0 += n;
    }
}

/// Merges partial results `[m, l, o…]` (base-2 max, sum, unnormalised output) of one row over
/// disjoint key ranges, exactly: `m = max mᵢ`, `l = Σ lᵢ·2^(mᵢ−m)`, `o = Σ oᵢ·2^(mᵢ−m) / l`.
/// A `sink` logit (natural log) joins the denominator as one more part with no value. Part `i` is
/// `parts[i·stride ..][.. out.len() + 2]`. Writes the normalised output and returns the
/// natural-log logsumexp (sink included; −inf and a zero output if no part saw a key and there is
/// no sink). Parts are combined in order, so the result is deterministic.
///
/// # Panics
/// If `parts` is shorter than `(count − 1)·stride + out.len() + 2`.
pub fn merge_partials(
    parts: &[f32],
    stride: usize,
    count: usize,
    sink: Option<f32>,
    out: &mut [f32],
) -> f32 {
    let dv = out.len();
    if count > 0 {
        assert!(
            parts.len() >= (count - 1) * stride + dv + 2,
            "merge_partials: parts too short"
        );
    }
    let part = |i: usize| &parts[i * stride..i * stride + dv + 2];
    let s2 = sink.map_or(f32::NEG_INFINITY, |s| s * LOG2E);
    let mut mx = s2;
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
    let has_key = l != 0.0;
    if s2 != f32::NEG_INFINITY {
        l += (s2 - mx).exp2();
    }
    if !has_key {
        out.fill(0.0);
        if l == 0.0 {
            return f32::NEG_INFINITY;
        }
    }
    let inv = 1.0 / l;
    for o in out.iter_mut() {
        *o *= inv;
    }
    (mx + l.log2()) * core::f32::consts::LN_2
}
