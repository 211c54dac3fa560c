//! The fused attention forward pass for one block of query rows of one head.
//!
//! Streams the keys in blocks of `nb`. Tiles are transposed, queries along the SIMD axis:
//! `Sᵀ = K·Q̂ᵀ` (one GEMM into an `nb × m` tile, K read in place; 16-bit K and V widened per
//! block), mask, online softmax with
//! *vertical* reductions (running max `mᵢ` and sum `lᵢ` per query lane; `Oᵀ` rescaled by
//! `α = 2^(m_old − m_new)` only when some max rose), then `Oᵀ += Vᵀ·Pᵀ` (V read in place). Q̂ᵀ
//! is packed once per query block and `Oᵀ` transposed once at the end, so nothing is packed per
//! key block. When every visible key fits one block (short sequences) and `Dv` is a lane
//! multiple, `O = diag(1/l)·P·V` is written straight into the output rows instead (V as the
//! vector operand), with no `Oᵀ` and no transpose back. The `Lq × Lk` matrix exists only if the
//! caller asks for the weights.
//!
//! Scores are kept in base-2 units: Q̂ is Q pre-multiplied by `scale·log2(e)`, so the exponent is
//! a bare `exp2(s − m)` and the additive bias is multiplied by `log2(e)` once.
//!
//! The two products are a seam ([`Products`]): [`Widened`] is the f32 FMA tiles every ISA has
//! (16-bit operands widened exactly); `x86_64::bf16` multiplies bf16 pairs (`vdpbf16ps`),
//! applying the scale in f32 instead of pre-scaling Q. Masks, the softmax and the output are
//! shared.

use crate::elem::{get, Dtype, Elem, Stored};
use crate::gemm::{Accum, Epilogue, Plain, Softcap, Tiles};
use crate::pages::KvPages;
use crate::score::{finish, ScoreSpec};
use crate::simd::{aligned, exp2, ScaledTanh, Simd, SimdDiv, ALIGN_SLACK};
use half::{bf16, f16};

const LOG2E: f32 = core::f32::consts::LOG2_E;
const LN2: f32 = core::f32::consts::LN_2;

/// Everything the fused kernel needs for one (batch, head, query block). Pointers are raw
/// because the output rows of different blocks interleave in memory (BLHD layout). Q is read as
/// `Q` and K, V as `KV` (any [`Stored`] type, widened to f32 a key block at a time; `i8` rows
/// times their scales); everything computed is f32.
#[derive(Clone, Copy, Debug)]
pub struct FlashArgs<Q: Elem = f32, KV: Stored = f32> {
    /// Query rows in this block.
    pub m: usize,
    /// Keys in the sequence (the key/value row count).
    pub n: usize,
    /// Head dimension of Q and K.
    pub d: usize,
    /// Head dimension of V and O.
    pub dv: usize,
    /// Softmax scale applied to `q·k` (before the bias is added).
    pub scale: f32,
    /// Which keys each row sees and what is applied to its scores; `spec.row0` is this block's
    /// first row in the query sequence and its bias/mask pointers address that row.
    pub spec: ScoreSpec,
    /// Q rows: element `(r, p)` at `q + r*ldq + p`.
    pub q: *const Q,
    /// Row stride of Q.
    pub ldq: usize,
    /// K rows: element `(j, p)` at `k + j*ldk + p` (in a paged cache: see [`KvPages`]).
    pub k: *const KV,
    /// Row stride of K.
    pub ldk: usize,
    /// V rows: element `(j, c)` at `v + j*ldv + c` (as `k`).
    pub v: *const KV,
    /// Row stride of V.
    pub ldv: usize,
    /// `i8` K only: key row `j` is `k_scale[j]·K[j]` (`n` values; paged as `k`). Unused (may be
    /// null) for the float types.
    pub k_scale: *const f32,
    /// `i8` V only: value row `j` is `v_scale[j]·V[j]`, as `k_scale`.
    pub v_scale: *const f32,
    /// Output rows: element `(r, c)` at `o + r*ldo + c`; only `c < dv` is written.
    pub o: *mut f32,
    /// Row stride of O.
    pub ldo: usize,
    /// Per-row natural-log logsumexp output (`m` values), or null.
    pub lse: *mut f32,
    /// Attention weights `(r, j)` at `weights + r*ldw + j` (`j < n`), or null.
    pub weights: *mut f32,
    /// Row stride of the weights.
    pub ldw: usize,
    /// How K, V and the scales are addressed: [`KvPages::contiguous`] for `k + j·ldk`, or a page
    /// table. Paged rows are read in place where a key block lies in one page, else gathered
    /// (widened) a block at a time, never as a copy of the whole cache; they always take the
    /// f32 products ([`crate::FlashPath::Widened`]).
    pub pages: KvPages,
}

/// Products per FMA chain in a score (the rest are summed through the tile): one chain of 256 at
/// D = 256 with logits of std 8 gave 2.1e-5 of error against f64, chains of 64 gave 5.5e-6 (as
/// the decode kernel's lane-split sums); D ≤ 64 keeps one chain. P·V sums at most 128 weights
/// ≤ 1 and keeps one.
const SCORE_CHAIN: usize = 64;

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

/// f32 elements of scratch [`crate::flash_forward`] needs for these extents, with f32 operands
/// (enough for every ISA).
pub fn scratch_len(m: usize, d: usize, dv: usize) -> usize {
    scratch_len_as::<f32, f32>(m, d, dv)
}

/// f32 elements of scratch [`crate::flash_forward_as`] needs for these extents, Q of type `Q`
/// and K, V of type `KV` (enough for every ISA). Saturates rather than overflows, so an
/// absurd shape asks for an allocation that fails.
pub fn scratch_len_as<Q: Elem, KV: Stored>(m: usize, d: usize, dv: usize) -> usize {
    Layout::new(m, d, dv, Operands::of::<Q, KV>(false)).total()
}

/// [`scratch_len_as`] for K and V read through a page table ([`FlashArgs::pages`] not
/// contiguous): f32 blocks that straddle pages are gathered, so f32 needs the buffers 16-bit
/// operands have.
pub fn scratch_len_paged<Q: Elem, KV: Stored>(m: usize, d: usize, dv: usize) -> usize {
    Layout::new(m, d, dv, Operands::of::<Q, KV>(true)).total()
}

/// [`scratch_len_as`] for [`crate::flash_forward_with`] at `precision` (contiguous K and V).
pub fn scratch_len_with<Q: Elem, KV: Stored>(
    m: usize,
    d: usize,
    dv: usize,
    precision: Precision,
) -> usize {
    Layout::new(m, d, dv, Operands::of::<Q, KV>(false).at(precision)).total()
}

/// How the fused kernel multiplies f32 operands (PyTorch's `torch.set_float32_matmul_precision`).
/// 16-bit and int8 operands are not affected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Precision {
    /// f32 products: the f32 kernel, at its usual accuracy (the default).
    #[default]
    Highest,
    /// Q, K and V all f32 are rounded to bf16 (nearest even) a block at a time and multiplied
    /// as bf16 pairs ([`crate::FlashPath::Bf16Pairs`]: exact products, f32 sums, the softmax
    /// weights rounded to bf16 for `P·V`) on [`crate::Isa::Avx512Bf16`], `d` even and K and V
    /// contiguous; elsewhere f32 products. [`crate::Isa::Amx`] keeps the f32 products: its tile
    /// kernel does not round f32 operands, and the pair kernel runs at 0.57–0.69× the f32
    /// kernel on Intel cores (BENCHMARKS.md).
    /// The result is bitwise that of bf16 inputs holding the rounded values, about 2⁻⁹ relative
    /// error per operand: PyTorch's `"medium"`.
    Medium,
}

/// Lengths of the kernel's scratch buffers (see [`forward_with`]), each a lane multiple: the
/// state every path shares, then the larger of the two paths' own buffers (one at a time uses
/// them).
struct Layout {
    /// Sᵀ, Oᵀ; one row of `m` values (four of them).
    st: usize,
    ot: usize,
    row: usize,
    /// The widening path's buffers ([`Widened`]).
    widened: usize,
    /// The bf16 pair path's buffers (`x86_64::bf16`; zero unless Q, K and V are bf16).
    pairs: usize,
}

impl Layout {
    fn new(m: usize, d: usize, dv: usize, ops: Operands) -> Self {
        let mp = round_up(m, 16);
        // Enough for every ISA: the pair buffers wherever some ISA would run the pair path.
        let pairs = ops.path(crate::Isa::Avx512Bf16, d);
        let pairs = if pairs == crate::FlashPath::Bf16Pairs {
            PairLens::new(mp, d, dv, ops).total()
        } else {
            0
        };
        Layout {
            st: key_block(d) * mp,
            ot: round_up(dv, 16).saturating_mul(mp),
            row: mp,
            widened: WideLens::new(m, mp, d, dv, ops).total(),
            pairs,
        }
    }

    fn total(&self) -> usize {
        [
            self.st,
            self.ot,
            4 * self.row,
            self.widened.max(self.pairs),
            ALIGN_SLACK,
        ]
        .into_iter()
        .fold(0, usize::saturating_add)
    }
}

/// Buffer lengths of the widening path ([`Widened`]), in floats: Q̂ᵀ (`d × mp`), the widened K
/// and V key blocks and the widened Q (zero for f32 operands read in place; paged f32 K and V
/// need their blocks for the ones that straddle pages).
/// Saturating, so an absurd shape asks for an allocation that fails.
struct WideLens {
    qt: usize,
    kw: usize,
    vw: usize,
    qw: usize,
}

impl WideLens {
    fn new(m: usize, mp: usize, d: usize, dv: usize, ops: Operands) -> Self {
        let kb = key_block(d);
        let needs = |wide: bool, x: usize| if wide { x } else { 0 };
        let kv = ops.kv != Dtype::F32 || ops.paged;
        WideLens {
            qt: d.saturating_mul(mp),
            kw: needs(kv, d.saturating_mul(kb)),
            vw: needs(kv, dv.saturating_mul(kb)),
            qw: needs(ops.q != Dtype::F32, m.saturating_mul(d)),
        }
    }

    fn total(&self) -> usize {
        [self.qt, self.kw, self.vw, self.qw]
            .into_iter()
            .fold(0, usize::saturating_add)
    }
}

/// Buffer lengths of the bf16 pair path, in 32-bit units (one unit = one pair of bf16): Q̂ᵀ
/// (`⌈d/2⌉ × mp`), Pᵀ (`⌈nb/2⌉ × mp`) and V (`⌈nb/2⌉ × dv`) in pairs along their reduction; for
/// f32 operands rounded to bf16 ([`Precision::Medium`]) the rounded Q rows (`mp × d`) and K
/// block (`nb × d`); and for the tile path (`x86_64::amx`, which shares them) one key tile of
/// 16 rows of `d` bf16.
#[derive(Clone, Copy)]
pub(crate) struct PairLens {
    pub(crate) qp: usize,
    pub(crate) pp: usize,
    pub(crate) vp: usize,
    pub(crate) qr: usize,
    pub(crate) kr: usize,
    pub(crate) kt: usize,
}

impl PairLens {
    pub(crate) fn new(mp: usize, d: usize, dv: usize, ops: Operands) -> Self {
        let kb2 = key_block(d).div_ceil(2);
        let d2 = d.div_ceil(2);
        PairLens {
            qp: d2.saturating_mul(mp),
            pp: kb2 * mp,
            vp: round_up(dv, 16).saturating_mul(kb2),
            qr: if ops.rounded {
                d2.saturating_mul(mp)
            } else {
                0
            },
            kr: if ops.rounded { d2 * key_block(d) } else { 0 },
            kt: d.saturating_mul(8),
        }
    }

    fn total(&self) -> usize {
        [self.qp, self.pp, self.vp, self.qr, self.kr, self.kt]
            .into_iter()
            .fold(0, usize::saturating_add)
    }
}

/// Rows `< rows` of `src` (stride `lds`, `cols` wide) widened into `dst` (dense, stride `cols`),
/// row `r` times `scale[r]` when `SCALED`.
///
/// # Safety
/// `src` readable and `dst` writable at those extents, `scale` readable for `rows` values when
/// `SCALED`; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn widen_rows<S: Simd, E: Stored, const SCALED: bool>(
    src: *const E,
    lds: usize,
    rows: usize,
    cols: usize,
    dst: *mut f32,
    scale: *const f32,
) {
    // SAFETY: every index is `< rows` rows × `< cols` columns of the extents promised.
    unsafe {
        for r in 0..rows {
            let (s, d) = (src.add(r * lds), dst.add(r * cols));
            let k = if SCALED { *scale.add(r) } else { 1.0 };
            let kv = S::splat(k);
            let mut c = 0;
            while c + S::W <= cols {
                let x = S::load_as(s.add(c));
                S::store(d.add(c), if SCALED { S::mul(x, kv) } else { x });
                c += S::W;
            }
            for c in c..cols {
                let x = get(s.add(c));
                *d.add(c) = if SCALED { x * k } else { x };
            }
        }
    }
}

/// [`widen_rows`] from elements of type `dt` (f32 rows are copied); `i8` rows are multiplied by
/// their `scale`.
///
/// # Safety
/// As [`widen_rows`], `src` pointing at `dt` elements, `scale` readable for `rows` values when
/// `dt` is `i8`.
#[inline(always)]
unsafe fn widen_any<S: Simd>(
    dt: Dtype,
    src: *const u8,
    lds: usize,
    rows: usize,
    cols: usize,
    dst: *mut f32,
    scale: *const f32,
) {
    // SAFETY: forwarded contract.
    unsafe {
        match dt {
            Dtype::Bf16 => widen_rows::<S, bf16, false>(src.cast(), lds, rows, cols, dst, scale),
            Dtype::F16 => widen_rows::<S, f16, false>(src.cast(), lds, rows, cols, dst, scale),
            Dtype::I8 => widen_rows::<S, i8, true>(src.cast(), lds, rows, cols, dst, scale),
            Dtype::F32 => widen_rows::<S, f32, false>(src.cast(), lds, rows, cols, dst, scale),
        }
    }
}

/// `a` with its operand pointers cast to f32, and their real types: the form the kernel runs
/// on, so that one instance per ISA and epilogue serves every element type (a typed instance
/// per type cost minutes of build each) and only the widening knows the types.
pub(crate) fn erase<Q: Elem, KV: Stored>(a: &FlashArgs<Q, KV>) -> (FlashArgs, Operands) {
    let FlashArgs {
        m,
        n,
        d,
        dv,
        scale,
        spec,
        q,
        ldq,
        k,
        ldk,
        v,
        ldv,
        k_scale,
        v_scale,
        o,
        ldo,
        lse,
        weights,
        ldw,
        pages,
    } = *a;
    let erased = FlashArgs {
        m,
        n,
        d,
        dv,
        scale,
        spec,
        q: q.cast(),
        ldq,
        k: k.cast(),
        ldk,
        v: v.cast(),
        ldv,
        k_scale,
        v_scale,
        o,
        ldo,
        lse,
        weights,
        ldw,
        pages,
    };
    (erased, Operands::of::<Q, KV>(!pages.is_contiguous()))
}

/// The element types behind an [`erase`]d argument set's `q` and its `k`, `v`, whether K and V
/// are read through a page table, and whether f32 operands may be rounded to bf16.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operands {
    pub(crate) q: Dtype,
    pub(crate) kv: Dtype,
    pub(crate) paged: bool,
    /// f32 Q, K and V (contiguous) rounded to bf16 for the pair products where an ISA has them
    /// ([`Precision::Medium`]).
    pub(crate) rounded: bool,
}

impl Operands {
    pub(crate) fn of<Q: Elem, KV: Stored>(paged: bool) -> Self {
        Operands {
            q: Q::DTYPE,
            kv: KV::DTYPE,
            paged,
            rounded: false,
        }
    }

    /// At `precision`: [`Precision::Medium`] rounds f32 operands read in place.
    pub(crate) fn at(self, precision: Precision) -> Self {
        let f32s = self.q == Dtype::F32 && self.kv == Dtype::F32;
        Operands {
            rounded: precision == Precision::Medium && f32s && !self.paged,
            ..self
        }
    }

    /// The products the kernel uses on `isa` for these operands and head dimension.
    pub(crate) fn path(self, isa: crate::Isa, d: usize) -> crate::FlashPath {
        use crate::{FlashPath, Isa};
        if self.paged {
            FlashPath::Widened
        } else if self.rounded {
            // Not on `Amx` (see `Precision::Medium`).
            match isa {
                Isa::Avx512Bf16 if d.is_multiple_of(2) => FlashPath::Bf16Pairs,
                _ => FlashPath::Widened,
            }
        } else {
            crate::flash_path(isa, self.q, self.kv, d)
        }
    }
}

/// How the kernel forms its two products, `Sᵀ = K·Q̂ᵀ` and `Oᵀ (+)= Vᵀ·Pᵀ` (or the direct
/// `O = P·V`): everything else (masks, the online softmax, the output) is shared. [`Widened`] is
/// the f32 form every ISA has; `x86_64::bf16` multiplies bf16 pairs.
pub(crate) trait Products<S: Tiles + SimdDiv> {
    /// Whether [`Products::direct`] exists (else a single key block goes through Oᵀ too).
    const DIRECT: bool = true;
    /// Prepares the query block; `qscale` is the factor of the scores (base-2 units, divided by
    /// the softcap if there is one).
    ///
    /// # Safety
    /// As [`forward`]; the scratch this value holds has the block's extents.
    unsafe fn queries(&mut self, a: &FlashArgs, qscale: f32, mp: usize);
    /// `s[j·mp + lane] = epi(score)` for keys `j0 + j`, `j < nb`, and the `nv` lane vectors from
    /// `lanes`; makes V of these keys the current block of [`Products::values`].
    ///
    /// # Safety
    /// As [`Products::queries`], after it; `j0 + nb ≤ n`, `nb ≤ key_block(d)`.
    unsafe fn scores<F: Epilogue>(
        &mut self,
        a: &FlashArgs,
        j0: usize,
        nb: usize,
        lanes: usize,
        nv: usize,
        s: &mut [f32],
        mp: usize,
        epi: F,
    );
    /// `Oᵀ (+)= Vᵀ·Pᵀ` on the same lanes, P the `nb` rows of `s`, V the current block.
    ///
    /// # Safety
    /// As [`Products::scores`], after it, with the same `nb`, `lanes`, `nv`.
    unsafe fn values(
        &mut self,
        a: &FlashArgs,
        nb: usize,
        lanes: usize,
        nv: usize,
        s: &mut [f32],
        ot: &mut [f32],
        mp: usize,
        acc: Accum,
    );
    /// `O = diag(k)·P·V` straight into the output rows (`Dv` a lane multiple), P the `nb` rows
    /// of `s` and `k` the per-row normalisers (`mp` long).
    ///
    /// # Safety
    /// As [`Products::values`].
    unsafe fn direct(&mut self, a: &FlashArgs, nb: usize, s: &mut [f32], mp: usize, k: &[f32]);
}

/// The f32 products: Q̂ᵀ packed in f32, K and V read in place (f32) or widened a key block at a
/// time into dense f32 rows, so the tiles, which broadcast K and V element by element, always
/// read f32: broadcasting 16-bit elements in place cost a scalar conversion per element (bf16
/// prefill ran at 0.65× f32, f16 at 0.3×).
pub(crate) struct Widened<'s> {
    ops: Operands,
    /// Q̂ᵀ, `d × mp`.
    qt: &'s mut [f32],
    /// The widened K and V blocks, and Q (empty for f32 operands).
    kw: &'s mut [f32],
    vw: &'s mut [f32],
    qw: &'s mut [f32],
    /// The current block of V and its row stride.
    vb: *const f32,
    ldv: usize,
}

impl<'s> Widened<'s> {
    /// The buffers from `rest`, the scratch past the shared state.
    fn new(a: &FlashArgs, ops: Operands, mp: usize, rest: &'s mut [f32]) -> Self {
        // 16-bit Q is widened once per call, for the shuffle transpose (element by element, it
        // cost f16 inputs 10-15 % of small calls).
        let lens = WideLens::new(a.m, mp, a.d, a.dv, ops);
        let (qt, rest) = rest.split_at_mut(lens.qt);
        let (kw, rest) = rest.split_at_mut(lens.kw);
        let (vw, rest) = rest.split_at_mut(lens.vw);
        let qw = &mut rest[..lens.qw];
        Widened {
            ops,
            qt,
            kw,
            vw,
            qw,
            vb: a.v,
            ldv: a.ldv,
        }
    }
}

impl<S: Tiles + SimdDiv> Products<S> for Widened<'_> {
    #[inline(always)]
    unsafe fn queries(&mut self, a: &FlashArgs, qscale: f32, mp: usize) {
        let (m, d) = (a.m, a.d);
        // SAFETY: Q's extents per `forward`'s contract; the buffers were split for them.
        unsafe {
            // Q̂ᵀ (d × mp), pre-scaled. Padding lanes must be zero. The transpose writes zeros up
            // to the next multiple of 8; with 16 lanes, rows may have 8 more (cheaper than a
            // memset of all of Q̂ᵀ per call).
            let m8 = round_up(m, 8);
            if m8 < mp {
                for row in self.qt.chunks_exact_mut(mp) {
                    row[m8..].fill(0.0);
                }
            }
            let (q, ldq) = match self.ops.q {
                Dtype::F32 => (a.q, a.ldq),
                dt => {
                    let qw = self.qw.as_mut_ptr();
                    widen_any::<S>(dt, a.q.cast(), a.ldq, m, d, qw, core::ptr::null());
                    (self.qw.as_ptr(), d)
                }
            };
            transpose_scaled::<S, false, true>(q, ldq, m, d, self.qt.as_mut_ptr(), mp, |_| qscale);
        }
    }

    #[inline(always)]
    unsafe fn scores<F: Epilogue>(
        &mut self,
        a: &FlashArgs,
        j0: usize,
        nb: usize,
        lanes: usize,
        nv: usize,
        s: &mut [f32],
        mp: usize,
        epi: F,
    ) {
        let d = a.d;
        // SAFETY: keys `< j0 + nb ≤ n` of K and V (and their scales), through the page table,
        // which covers keys `< n`; the buffers hold a key block (widened or gathered when paged).
        unsafe {
            let pg = &a.pages;
            let (kb, ldk) = if self.ops.kv == Dtype::F32 && pg.page_end(j0) >= j0 + nb {
                // In place: contiguous rows, or a block inside one page.
                let v = a.v.add(pg.at(j0, pg.v_stride, a.ldv));
                (self.vb, self.ldv) = (v, a.ldv);
                (a.k.add(pg.at(j0, pg.k_stride, a.ldk)), a.ldk)
            } else {
                // Widened (or, for f32 straddling pages, gathered) one page's run at a time.
                // Element offsets of the real type: step the typed pointers.
                let dt = self.ops.kv;
                let size = dt.size();
                let (k, v) = (a.k.cast::<u8>(), a.v.cast::<u8>());
                let (kw, vw) = (self.kw.as_mut_ptr(), self.vw.as_mut_ptr());
                let mut j = j0;
                while j < j0 + nb {
                    let (e, r) = (pg.page_end(j).min(j0 + nb), j - j0);
                    let so = pg.at(j, pg.scale_stride, 1);
                    let (ks, vs) = (a.k_scale.wrapping_add(so), a.v_scale.wrapping_add(so));
                    let ko = pg.at(j, pg.k_stride, a.ldk) * size;
                    let vo = pg.at(j, pg.v_stride, a.ldv) * size;
                    widen_any::<S>(dt, k.add(ko), a.ldk, e - j, d, kw.add(r * d), ks);
                    widen_any::<S>(dt, v.add(vo), a.ldv, e - j, a.dv, vw.add(r * a.dv), vs);
                    j = e;
                }
                (self.vb, self.ldv) = (vw, a.dv);
                (kw.cast_const(), d)
            };
            S::block(
                nb,
                nv,
                d,
                SCORE_CHAIN,
                kb,
                ldk,
                1,
                self.qt.as_ptr().add(lanes),
                mp,
                s.as_mut_ptr().add(lanes),
                mp,
                Accum::Replace,
                epi,
            );
        }
    }

    #[inline(always)]
    unsafe fn values(
        &mut self,
        a: &FlashArgs,
        nb: usize,
        lanes: usize,
        nv: usize,
        s: &mut [f32],
        ot: &mut [f32],
        mp: usize,
        acc: Accum,
    ) {
        // SAFETY: the current V block has `nb` rows of `dv`; `s` and `ot` cover the lanes.
        unsafe {
            S::block(
                a.dv,
                nv,
                nb,
                usize::MAX,
                self.vb,
                1,
                self.ldv,
                s.as_ptr().add(lanes),
                mp,
                ot.as_mut_ptr().add(lanes),
                mp,
                acc,
                Plain,
            );
        }
    }

    #[inline(always)]
    unsafe fn direct(&mut self, a: &FlashArgs, nb: usize, s: &mut [f32], mp: usize, k: &[f32]) {
        // SAFETY: as `values`; O's rows `< m` per `forward`'s contract, `dv` a lane multiple.
        unsafe {
            // P normalised first (a pass over `nb × mp`, not over the output).
            for j in 0..nb {
                scale_row::<S>(&mut s[j * mp..(j + 1) * mp], k);
            }
            S::block(
                a.m,
                a.dv / S::W,
                nb,
                usize::MAX,
                s.as_ptr(),
                1,
                mp,
                self.vb,
                self.ldv,
                a.o,
                a.ldo,
                Accum::Replace,
                Plain,
            );
        }
    }
}

/// The fused kernel on the f32 products ([`Widened`]), generic over the vector type.
///
/// # Safety
/// Every pointer in `args` is valid for the extents it describes, `q` holding `ops.q` elements
/// and `k`, `v` `ops.kv` ones (an [`erase`]d argument set); `o`, `lse` and `weights` do not
/// overlap each other or any input; `scratch.len() ≥ scratch_len_as::<Q, KV>(m, d, dv)`; the
/// ISA of `S` is enabled on this CPU.
#[inline(always)]
pub(crate) unsafe fn forward<S: Tiles + SimdDiv>(
    a: &FlashArgs,
    ops: Operands,
    scratch: &mut [f32],
) {
    // SAFETY: forwarded contract.
    unsafe { forward_on::<S, Widened<'_>>(a, ops, scratch, Widened::new) }
}

/// The fused kernel on the products `P` that `make` builds from the scratch past the shared
/// state (`make(a, ops, mp, rest)`).
///
/// # Safety
/// As [`forward`], with products that `make` can build for these operands.
#[inline(always)]
pub(crate) unsafe fn forward_on<'s, S: Tiles + SimdDiv, P: Products<S>>(
    a: &FlashArgs,
    ops: Operands,
    scratch: &'s mut [f32],
    make: impl FnOnce(&FlashArgs, Operands, usize, &'s mut [f32]) -> P,
) {
    let FlashArgs { m, d, dv, .. } = *a;
    if m == 0 {
        return;
    }
    let mp = round_up(m, S::W);
    debug_assert!(
        scratch.len() >= Layout::new(m, d, dv, ops).total(),
        "flash scratch too short"
    );
    // Every sub-buffer is a lane multiple long, so each starts on a vector boundary too.
    let (st, rest) = aligned(scratch).split_at_mut(key_block(d) * mp);
    // Oᵀ's rows are rounded up to 16: the tile path stores whole 16-row tiles.
    let (ot, rest) = rest.split_at_mut(round_up(dv, 16) * mp);
    let (mrow, rest) = rest.split_at_mut(mp);
    let (lrow, rest) = rest.split_at_mut(mp);
    let (alpha, rest) = rest.split_at_mut(mp);
    let (tmp, rest) = rest.split_at_mut(mp);
    let state = State {
        st,
        ot,
        mrow,
        lrow,
        alpha,
        tmp,
    };
    let products = make(a, ops, mp, rest);
    // SAFETY: forwarded contract. One instance per epilogue, so the plain kernel's loop is
    // exactly what it was without one (a branch per key block cost 0.7 % of its instructions).
    unsafe {
        match a.spec.softcap {
            Some(c) => {
                forward_with::<S, _, _>(a, state, products, Softcap(ScaledTanh::new(c * LOG2E)))
            }
            None => forward_with::<S, _, _>(a, state, products, Plain),
        }
    }
}

/// The kernel's shared state: Sᵀ (`key_block(d) × mp`), Oᵀ (`dv × mp`), and per query lane the
/// running max, the running sum, the rescale factors and one row of temporaries.
struct State<'s> {
    st: &'s mut [f32],
    ot: &'s mut [f32],
    mrow: &'s mut [f32],
    lrow: &'s mut [f32],
    alpha: &'s mut [f32],
    tmp: &'s mut [f32],
}

/// [`forward_on`] with the score tile's epilogue `epi` (the softcap, or nothing).
///
/// # Safety
/// As [`forward_on`].
#[inline(always)]
unsafe fn forward_with<S: Tiles + SimdDiv, P: Products<S>, F: Epilogue>(
    a: &FlashArgs,
    state: State<'_>,
    mut products: P,
    epi: F,
) {
    let FlashArgs { m, d, dv, .. } = *a;
    let w = S::W;
    let nb_max = key_block(d);
    let mp = round_up(m, w);
    let State {
        st,
        ot,
        mrow,
        lrow,
        alpha,
        tmp,
    } = state;

    // Both ends of the visible range grow with r: the last row bounds the key loop above, the
    // first below.
    let spec = &a.spec;
    // A softcap is applied by the score tile as it stores each register (no pass over Sᵀ), to
    // scores computed already divided by the cap; the rest of the spec is applied after it.
    let rest_spec = ScoreSpec {
        softcap: None,
        ..*spec
    };
    let kmax = spec.visible_range(m - 1).1.min(a.n);
    let kmin = spec.visible_range(0).0.min(kmax);
    let sink2 = spec.sink_in(LOG2E);

    // SAFETY: (whole body) reads and writes stay inside the extents `args` describes and the
    // scratch slices split above; the ISA is enabled per this function's contract.
    unsafe {
        // Scores in base-2 units (with a softcap, divided by the cap).
        let qscale = match spec.softcap {
            Some(cap) => a.scale / cap,
            None => a.scale * LOG2E,
        };
        products.queries(a, qscale, mp);
        mrow.fill(f32::NEG_INFINITY);
        lrow.fill(0.0);

        // Keys before `jd` are visible to every row the causal mask allows; from `jd` on (the
        // diagonal) key j is hidden from the first `j − jd + 1` rows. Below the diagonal the key
        // loop runs in blocks of `nb_max` over all lanes; on it, in steps of W keys, each step
        // skipping the lane vectors its keys are hidden from (≈ half the diagonal's work).
        // With a single lane vector nothing can be skipped: one block as without a mask.
        let nvec = mp / w;
        let jd = match spec.causal {
            Some(off) if nvec > 1 => ((spec.row0 as isize)
                .saturating_add(off)
                .saturating_add(1)
                .max(0) as usize)
                .clamp(kmin, kmax),
            _ => kmax,
        };
        let mut j0 = kmin;
        let mut first = true;
        // Whether O was written directly (one key block), with `tmp` = 1/l.
        let mut direct = false;
        while j0 < kmax {
            let (nb, u) = if j0 < jd {
                (nb_max.min(jd - j0), 0)
            } else {
                // Lanes < u·W are hidden from keys [j0, j0 + W): at least j0 − jd + 1 rows.
                // The first block writes every lane of Oᵀ, so it skips none.
                let u = if first {
                    0
                } else {
                    ((j0 - jd) / w).min(nvec - 1)
                };
                (w.min(kmax - j0), u)
            };
            let lanes = u * w;
            let s = &mut st[..nb * mp];
            products.scores(a, j0, nb, lanes, nvec - u, s, mp, epi);
            // Lanes < u·W of `s` are stale; the causal fill of `mask_block` sets them to −inf.
            mask_block::<S>(a, &rest_spec, j0, nb, mp, s);
            let rescale = online_softmax::<S>(s, nb, mp, mrow, lrow, alpha);
            if P::DIRECT && first && j0 + nb == kmax && dv % w == 0 {
                // The only key block (short sequences): O = diag(1/l)·P·V straight into the
                // output rows, V as the vector operand, so no Oᵀ and no transpose back (the
                // transpose was a sixth of the time at (2, 8, 10, 16)). Dv must fill whole
                // vectors: the tiles store W-wide along it.
                normalisers::<S>(mrow, lrow, sink2, tmp);
                products.direct(a, nb, s, mp, tmp);
                direct = true;
                break;
            }
            if rescale && !first {
                for c in 0..dv {
                    scale_row::<S>(&mut ot[c * mp..(c + 1) * mp], alpha);
                }
            }
            let acc = if first { Accum::Replace } else { Accum::Add };
            // P is exactly 0 on the skipped lanes, so Oᵀ there is unchanged.
            products.values(a, nb, lanes, nvec - u, s, ot, mp, acc);
            first = false;
            j0 += nb;
        }

        // Oᵀ → O, each row scaled by 1/l, computed a register at a time. A row that saw no key
        // (l = 0; every row when no key block ran, and then Oᵀ was never written) gives zeros
        // and lse = −inf (the sink's logit with a sink): its 1/l is inf here and its output row
        // is overwritten below.
        if !first && !direct {
            normalisers::<S>(mrow, lrow, sink2, tmp);
            transpose_scaled::<S, true, false>(ot.as_ptr(), mp, dv, m, a.o, a.ldo, |r| tmp[r]);
        }
        for (r, &l) in lrow[..m].iter().enumerate() {
            if l == 0.0 {
                // Exactly zero even if V held inf/NaN (0·NaN would not be).
                core::slice::from_raw_parts_mut(a.o.add(r * a.ldo), dv).fill(0.0);
            }
        }
        if !a.lse.is_null() {
            for r in 0..m {
                let l = lrow[r];
                *a.lse.add(r) = if l == 0.0 {
                    sink2 * LN2
                } else {
                    finish(mrow[r], l, sink2).1
                };
            }
        }
        if !a.weights.is_null() {
            for r in 0..m {
                let wrow = core::slice::from_raw_parts_mut(a.weights.add(r * a.ldw), a.n);
                // Keys outside the loop bounds were never written: they are masked for this row.
                let (head, rest) = wrow.split_at_mut(kmax);
                rest.fill(0.0);
                let (before, done) = head.split_at_mut(kmin);
                before.fill(0.0);
                if lrow[r] == 0.0 {
                    done.fill(0.0);
                } else {
                    exp_scale::<S>(done, mrow[r], tmp[r]);
                }
            }
        }
    }
}

/// `dst[c·ldd + r] = src[r·lds + c] · k(c)` for `r < rows`, `c < cols`: the two transposes of the
/// kernel (Q into Q̂ᵀ, Oᵀ into O), in 8×8 blocks of shuffles ([`Simd::transpose8`]); the ragged
/// edges through masked moves ([`Simd::transpose8_part`]), plain ones on the side that is padded
/// to a multiple of 8 (`WIDE_SRC`: columns of `src`; `WIDE_DST`: rows of `dst`, written with
/// zeros past `rows`). Element by element, the transposes were ≈ 30 % of small calls' time, and
/// the scalar edges alone still 15–18 % at (2, 8, 10, 16).
///
/// # Safety
/// `src` readable and `dst` writable at the given extents and strides, rounded up to a multiple
/// of 8 on the wide sides; no overlap.
#[inline(always)]
unsafe fn transpose_scaled<S: Simd, const WIDE_SRC: bool, const WIDE_DST: bool>(
    src: *const f32,
    lds: usize,
    rows: usize,
    cols: usize,
    dst: *mut f32,
    ldd: usize,
    k: impl Fn(usize) -> f32,
) {
    // SAFETY: per the contract above; every block is clipped to `rows × cols`.
    unsafe {
        for c0 in (0..cols).step_by(8) {
            let nc = (cols - c0).min(8);
            let kc: [f32; 8] = core::array::from_fn(|i| if i < nc { k(c0 + i) } else { 0.0 });
            for r0 in (0..rows).step_by(8) {
                let nr = (rows - r0).min(8);
                let (s, d) = (src.add(r0 * lds + c0), dst.add(c0 * ldd + r0));
                if nr == 8 && nc == 8 {
                    S::transpose8(s, lds, d, ldd, &kc);
                } else {
                    S::transpose8_part::<WIDE_SRC, WIDE_DST>(s, lds, nr, nc, d, ldd, &kc);
                }
            }
        }
    }
}

/// Applies `spec` (the kernel's spec without its softcap, which the score tile applied) to a
/// score block `Sᵀ[nb × mp]` starting at key `j0`, and copies the resulting base-2 logits to the
/// weights if asked.
///
/// # Safety
/// As [`forward`].
#[inline(always)]
unsafe fn mask_block<S: SimdDiv>(
    a: &FlashArgs,
    spec: &ScoreSpec,
    j0: usize,
    nb: usize,
    mp: usize,
    s: &mut [f32],
) {
    if spec.is_bare() && a.weights.is_null() {
        // Visibility alone: a loop over the keys doing nothing was 5 % of small calls, and a
        // per-key check 12 % of small causal calls, so only the causal fills remain.
        // SAFETY: forwarded contract.
        unsafe { spec.hide_t::<S>(a.m, j0, nb, mp, s) };
        return;
    }
    // Masks, modifiers and weights: kept off the hot path's code layout.
    cold_path();
    // SAFETY: bias/mask/weights rows < m and columns < n are in bounds per `forward`'s contract.
    unsafe {
        spec.apply_t::<S>(a.m, j0, nb, mp, s, LOG2E);
        if !a.weights.is_null() {
            // Raw base-2 logits now; normalised once each row's final max and sum are known.
            for j in 0..nb {
                for (r, &x) in s[j * mp..j * mp + a.m].iter().enumerate() {
                    *a.weights.add(r * a.ldw + j0 + j) = x;
                }
            }
        }
    }
}

/// Marks the branch that calls it as unlikely, so that the compiler lays it out of line.
#[cold]
#[inline(never)]
fn cold_path() {}

/// One online-softmax step on `Sᵀ[nb × mp]`, per query lane: new max, `α = 2^(m_old − m_new)`,
/// `Sᵀ ← 2^(Sᵀ − m_new)` in place, `l ← α·l + Σ`. Returns whether any `α` differs from 1.
#[inline(always)]
unsafe fn online_softmax<S: Simd>(
    s: &mut [f32],
    nb: usize,
    mp: usize,
    mrow: &mut [f32],
    lrow: &mut [f32],
    alpha: &mut [f32],
) -> bool {
    let mut rescale = false;
    // SAFETY: `mp` is a multiple of W and every access is `< nb·mp` or `< mp`.
    unsafe {
        for c in (0..mp).step_by(S::W) {
            let mut mx = S::load(mrow.as_ptr().add(c));
            let m_old = mx;
            for j in 0..nb {
                // Operand order lets NaN scores win, so they propagate.
                mx = S::max(mx, S::load(s.as_ptr().add(j * mp + c)));
            }
            // A lane that has seen only −inf keeps max −inf; exponentiate against a finite
            // stand-in so that −inf − (−inf) never makes NaN: its p and α are then 0.
            let m_use = S::max(S::splat(-f32::MAX), mx);
            let al = exp2::<S>(S::sub(m_old, m_use));
            let mut sum = S::splat(0.0);
            for j in 0..nb {
                let ptr = s.as_mut_ptr().add(j * mp + c);
                let e = exp2::<S>(S::sub(S::load(ptr), m_use));
                S::store(ptr, e);
                sum = S::add(sum, e);
            }
            S::store(mrow.as_mut_ptr().add(c), mx);
            let l = S::load(lrow.as_ptr().add(c));
            S::store(lrow.as_mut_ptr().add(c), S::fma(l, al, sum));
            S::store(alpha.as_mut_ptr().add(c), al);
        }
    }
    for &x in alpha.iter() {
        rescale |= x != 1.0;
    }
    rescale
}

/// `y ← 1/l` per lane (lane-multiple length, a register at a time), or with a sink `s2` (base
/// 2) the factor that also counts the sink in the denominator (see [`finish`]).
#[inline(always)]
unsafe fn normalisers<S: SimdDiv>(m: &[f32], l: &[f32], s2: f32, y: &mut [f32]) {
    if s2 != f32::NEG_INFINITY {
        for ((y, &m), &l) in y.iter_mut().zip(m).zip(l) {
            *y = if l == 0.0 {
                f32::INFINITY
            } else {
                finish(m, l, s2).0
            };
        }
        return;
    }
    // SAFETY: both slices are lane multiples of equal length.
    unsafe {
        let one = S::splat(1.0);
        for (yc, xc) in y.chunks_exact_mut(S::W).zip(l.chunks_exact(S::W)) {
            S::store(yc.as_mut_ptr(), S::div(one, S::load(xc.as_ptr())));
        }
    }
}

/// `x ← x ⊙ k`, lane-multiple length.
#[inline(always)]
unsafe fn scale_row<S: Simd>(x: &mut [f32], k: &[f32]) {
    // SAFETY: both slices are lane multiples of equal length.
    unsafe {
        for (c, kc) in x.chunks_exact_mut(S::W).zip(k.chunks_exact(S::W)) {
            S::store(
                c.as_mut_ptr(),
                S::mul(S::load(c.as_ptr()), S::load(kc.as_ptr())),
            );
        }
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

/// Numerically stable softmax of a row in place (the unfused baseline's kernel): one pass for
/// the max, one for `e = 2^((x − max)·log2 e)` and its sum, one to normalise. A `sink` logit
/// (−inf for none) joins the max and the sum but gets no output. A row of all −inf becomes
/// zeros; NaN propagates.
#[inline(always)]
pub(crate) unsafe fn softmax<S: Simd>(x: &mut [f32], sink: f32) {
    let w = S::W;
    let n = x.len();
    let full = n / w * w;
    // Every access goes through `p`, one raw pointer taken once: re-borrowing `x` for the
    // scalar tail while `p` is live would invalidate `p` (Stacked and Tree Borrows).
    let p = x.as_mut_ptr();
    // SAFETY: vector accesses stay below `full`, a lane multiple ≤ n; scalar ones below n.
    unsafe {
        let mut mv = S::splat(f32::NEG_INFINITY);
        for c in (0..full).step_by(w) {
            mv = S::max(mv, S::load(p.add(c)));
        }
        let mut mx = S::hmax(mv);
        for i in full..n {
            let v = *p.add(i);
            if v > mx || v.is_nan() {
                mx = v;
            }
        }
        if sink > mx {
            mx = sink;
        }
        if mx == f32::NEG_INFINITY {
            core::ptr::write_bytes(p, 0, n);
            return;
        }
        // Subtract before converting to base 2: exact near the max, where it matters.
        let (mxv, l2e) = (S::splat(mx), S::splat(LOG2E));
        let mut sv = S::splat(0.0);
        for c in (0..full).step_by(w) {
            let e = exp2::<S>(S::mul(S::sub(S::load(p.add(c)), mxv), l2e));
            S::store(p.add(c), e);
            sv = S::add(sv, e);
        }
        let mut sum = S::hsum(sv);
        if sink != f32::NEG_INFINITY {
            sum += ((sink - mx) * LOG2E).exp2();
        }
        for i in full..n {
            let e = ((*p.add(i) - mx) * LOG2E).exp2();
            *p.add(i) = e;
            sum += e;
        }
        let inv = S::splat(1.0 / sum);
        for c in (0..full).step_by(w) {
            S::store(p.add(c), S::mul(S::load(p.add(c)), inv));
        }
        for i in full..n {
            *p.add(i) /= sum;
        }
    }
}
