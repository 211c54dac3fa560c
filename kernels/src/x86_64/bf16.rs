//! AVX-512 BF16: the fused kernel's products on bf16 pairs (`vdpbf16ps`: per f32 lane,
//! `c + a₀·b₀ + a₁·b₁` of two bf16 pairs; exact products, f32 sums, inputs and results below
//! 2⁻¹²⁶ flushed to zero).
//!
//! Each product reduces over pairs, so each operand holds the pair along its reduction axis in
//! one 32-bit unit:
//! * scores `Sᵀ = K·Q̂ᵀ` (reduction over `d`): K's pairs are adjacent in its rows, so K is read in
//!   place, a 32-bit broadcast per pair; Q is packed once per query block as the transpose of
//!   its rows viewed as 32-bit units (Q̂ᵀ in pairs, unscaled: the scale is applied in f32 as the
//!   tile stores, since a scaled bf16 Q would be rounded again);
//! * output `Oᵀ (+)= Vᵀ·Pᵀ` (reduction over keys): P is rounded to bf16 and packed as rows of
//!   (even key, odd key) pairs, V a key block at a time the same way (both ≈ 2 % of the
//!   block's instructions). That rounding is the path's one loss against the widening kernel:
//!   a relative 2⁻⁹ per weight, the bf16 rounding PyTorch's bf16 attention applies too.
//!
//! The rest of the kernel (masks, the online softmax in f32, the output) is the shared one.
//!
//! f32 operands ([`crate::Precision::Medium`]) are rounded to bf16 as they are packed: Q once
//! per query block, K and V a key block at a time (K into a buffer, since bf16 K is otherwise
//! read in place), so the result is bitwise that of bf16 inputs holding the rounded values.

use crate::flash::{forward_on, key_block, FlashArgs, Operands, PairLens, Products};
use crate::gemm::{gemm, Accum, Epilogue, Mac, Plain, Scaled};
use crate::x86_64::avx512::Avx512;
use crate::x86_64::transpose8_regs;
use core::arch::x86_64::*;
use half::bf16;

/// Products per chain in a score, as the f32 tiles (`SCORE_CHAIN` in flash.rs), in pairs.
const SCORE_PAIRS: usize = 32;
/// Tile shape: as the f32 AVX-512 tiles (8 rows, 3 vectors: 24 accumulators).
const MR: usize = 8;
const NV: usize = 3;

/// The fused kernel on bf16 pairs.
///
/// # Safety
/// As `flash::forward`; `ops.path` is `Bf16Pairs` for these operands (Q, K, V bf16, or f32 to
/// round; `d` even: K's pairs are then whole within its rows); the CPU has AVX-512 F, BW, VL
/// and BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn forward(a: &FlashArgs, ops: Operands, scratch: &mut [f32]) {
    debug_assert_eq!(
        ops.path(crate::Isa::Avx512Bf16, a.d),
        crate::FlashPath::Bf16Pairs
    );
    // SAFETY: forwarded contract; the features `Pairs` uses are enabled here.
    unsafe { forward_on::<Avx512, Pairs<'_>>(a, ops, scratch, Pairs::new) }
}

/// The pairwise product: A is read as a 32-bit unit (one bf16 pair) at any bf16 offset and
/// broadcast; B is a register of 16 pairs.
#[derive(Clone, Copy)]
struct PairDot;

impl Mac<Avx512> for PairDot {
    type A = bf16;
    type B = u32;
    #[inline(always)]
    unsafe fn load_b(b: *const u32) -> __m512 {
        // SAFETY: 16 units readable at `b` (the trait's contract); AVX-512F enabled.
        unsafe { _mm512_loadu_ps(b.cast()) }
    }
    #[inline(always)]
    unsafe fn bcast_a(a: *const bf16) -> __m512 {
        // SAFETY: the pair at `a` is readable (the trait's contract: both halves; unaligned).
        unsafe { _mm512_castsi512_ps(_mm512_set1_epi32(a.cast::<i32>().read_unaligned())) }
    }
    #[inline(always)]
    unsafe fn mac(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: register-only; AVX-512 BF16 enabled in every caller (`forward`). The casts
        // reinterpret 512 bits as 32 bf16.
        unsafe {
            let pairs = |x: __m512| core::mem::transmute::<__m512, __m512bh>(x);
            _mm512_dpbf16_ps(c, pairs(a), pairs(b))
        }
    }
}

/// [`gemm`] on pairs with the AVX-512 tile shape: `C[m × nvec·16] (+)= A·B` over `kp` pairs, A
/// a bf16 pointer (`rsa`, `csa` in bf16 elements), B rows of `ldb` units.
///
/// # Safety
/// As [`gemm`]; AVX-512 BF16 enabled.
#[inline(always)]
unsafe fn pair_gemm<F: Epilogue>(
    m: usize,
    nvec: usize,
    kp: usize,
    chain: usize,
    a: *const bf16,
    rsa: usize,
    csa: usize,
    b: *const u32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    acc: Accum,
    epi: F,
) {
    // SAFETY: forwarded contract.
    unsafe {
        gemm::<Avx512, PairDot, F, MR, NV>(
            m, nvec, kp, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi,
        )
    }
}

/// What V's pairs are packed from: 16 values at a time as 16 bf16 words.
trait Bf16Source {
    /// The values of lanes set in `k` at `p` as bf16 (f32 rounded to nearest even), the others
    /// zero.
    ///
    /// # Safety
    /// AVX-512 F, BW, BF16 enabled; the lanes set in `k` readable at `p`.
    unsafe fn load16(k: u16, p: *const Self) -> __m256i;
}

impl Bf16Source for bf16 {
    #[inline(always)]
    unsafe fn load16(k: u16, p: *const bf16) -> __m256i {
        // SAFETY: forwarded contract.
        unsafe { _mm256_maskz_loadu_epi16(k, p.cast()) }
    }
}

impl Bf16Source for f32 {
    #[inline(always)]
    unsafe fn load16(k: u16, p: *const f32) -> __m256i {
        // SAFETY: forwarded contract; the conversion is register-only (masked-off lanes are
        // +0.0, which rounds to the bf16 zero).
        unsafe {
            let x = _mm512_maskz_loadu_ps(k, p);
            core::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x))
        }
    }
}

/// The pair buffers (see the module docs), carved from the kernel's scratch.
pub(crate) struct Pairs<'s> {
    /// Q̂ᵀ in pairs: `d/2` rows of `mp` units.
    pub(crate) qp: &'s mut [f32],
    /// Pᵀ in pairs: `⌈nb/2⌉` rows of `mp` units.
    pub(crate) pp: &'s mut [f32],
    /// The current V block in pairs: `⌈nb/2⌉` rows of `dvp` units (the tile path keeps Vᵀ
    /// here, the same size).
    pub(crate) vp: &'s mut [f32],
    /// Row length of `vp`: `dv` rounded up to a vector.
    dvp: usize,
    /// The scores' factor (see [`Products::queries`]).
    pub(crate) qscale: f32,
    /// f32 Q, K and V, rounded to bf16 here: Q's rows (`m × d`) and the current K block
    /// (`nb × d`) in bf16; empty for bf16 operands.
    rounded: bool,
    qr: &'s mut [f32],
    kr: &'s mut [f32],
}

impl<'s> Pairs<'s> {
    fn new(a: &FlashArgs, ops: Operands, mp: usize, rest: &'s mut [f32]) -> Self {
        Self::new_with_tail(a, ops, mp, rest).0
    }

    /// The buffers, and the one the tile path pads a key tile in (`PairLens::kt`).
    pub(crate) fn new_with_tail(
        a: &FlashArgs,
        ops: Operands,
        mp: usize,
        rest: &'s mut [f32],
    ) -> (Self, &'s mut [f32]) {
        let lens = PairLens::new(mp, a.d, a.dv, ops);
        let (qp, rest) = rest.split_at_mut(lens.qp);
        let (pp, rest) = rest.split_at_mut(lens.pp);
        let (vp, rest) = rest.split_at_mut(lens.vp);
        let (qr, rest) = rest.split_at_mut(lens.qr);
        let (kr, rest) = rest.split_at_mut(lens.kr);
        let kt = &mut rest[..lens.kt];
        let pairs = Pairs {
            qp,
            pp,
            vp,
            dvp: a.dv.div_ceil(16) * 16,
            qscale: 1.0,
            rounded: ops.rounded,
            qr,
            kr,
        };
        (pairs, kt)
    }

    /// Rows `2·jp`, `2·jp + 1` of `s` (`nb` rows of `mp`; a missing odd row is zero), lanes
    /// `[lanes, mp)`, rounded to bf16 and interleaved into row `jp` of `pp`.
    ///
    /// # Safety
    /// AVX-512 BF16 and BW enabled; `nb ≤ key_block(d)`, `lanes` a multiple of 16.
    #[inline(always)]
    pub(crate) unsafe fn pack_p(&mut self, s: &[f32], nb: usize, lanes: usize, mp: usize) {
        // SAFETY: every access is inside `s` (`nb·mp`) or `pp` (`⌈nb/2⌉·mp`).
        unsafe {
            // Word 2i of the result is word i of the conversion (even key, lane i), word 2i+1
            // word 16 + i (odd key).
            let idx = _mm512_set_epi16(
                31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                20, 4, 19, 3, 18, 2, 17, 1, 16, 0,
            );
            let sp = s.as_ptr();
            let pp = self.pp.as_mut_ptr();
            for jp in 0..nb.div_ceil(2) {
                let (even, odd) = (sp.add(2 * jp * mp), sp.add((2 * jp + 1) * mp));
                let has_odd = 2 * jp + 1 < nb;
                for c in (lanes..mp).step_by(16) {
                    let lo = _mm512_loadu_ps(even.add(c));
                    let hi = if has_odd {
                        _mm512_loadu_ps(odd.add(c))
                    } else {
                        _mm512_setzero_ps()
                    };
                    let words = _mm512_castsi512_ps(_mm512_permutexvar_epi16(
                        idx,
                        core::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)),
                    ));
                    _mm512_storeu_ps(pp.add(jp * mp + c), words);
                }
            }
        }
    }

    /// Keys `[j0, j0 + nb)` of V into `vp` as (even key, odd key) pairs per column; a missing
    /// odd key and the columns past `dv` are zero.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL enabled; V rows `< j0 + nb` readable at `dv` columns.
    #[inline(always)]
    unsafe fn pack_v(&mut self, a: &FlashArgs, j0: usize, nb: usize) {
        if self.rounded {
            // SAFETY: forwarded contract; V is f32 here.
            unsafe { self.pack_v_from::<f32>(a, j0, nb) }
        } else {
            // SAFETY: forwarded contract; V is bf16 here.
            unsafe { self.pack_v_from::<bf16>(a, j0, nb) }
        }
    }

    /// [`Pairs::pack_v`] from V of type `E` (bf16, or f32 rounded to bf16).
    ///
    /// # Safety
    /// As [`Pairs::pack_v`]; V holds `E`.
    #[inline(always)]
    unsafe fn pack_v_from<E: Bf16Source>(&mut self, a: &FlashArgs, j0: usize, nb: usize) {
        let v = a.v.cast::<E>();
        let vp = self.vp.as_mut_ptr().cast::<i32>();
        // SAFETY: loads are masked to the `dv` columns of rows `< j0 + nb`; stores stay inside
        // `vp` (`⌈nb/2⌉` rows of `dvp`).
        unsafe {
            for jp in 0..nb.div_ceil(2) {
                let even = v.add((j0 + 2 * jp) * a.ldv);
                let odd = (2 * jp + 1 < nb).then(|| even.add(a.ldv));
                for c in (0..a.dv).step_by(16) {
                    let k = (1u32 << (a.dv - c).min(16)).wrapping_sub(1) as u16;
                    let lo = _mm512_cvtepu16_epi32(E::load16(k, even.add(c)));
                    let pair = match odd {
                        Some(o) => {
                            let hi = E::load16(k, o.add(c));
                            _mm512_or_si512(lo, _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)))
                        }
                        None => lo,
                    };
                    _mm512_storeu_si512(vp.add(jp * self.dvp + c).cast(), pair);
                }
            }
        }
    }

    /// Rows `< rows` of f32 at `src` (stride `lds`, `cols` wide) rounded into dense rows of
    /// `cols` bf16 at `dst`.
    ///
    /// # Safety
    /// AVX-512 F, BW, BF16 enabled; `src` readable and `dst` writable at those extents.
    #[inline(always)]
    unsafe fn round_rows(src: *const f32, lds: usize, rows: usize, cols: usize, dst: *mut bf16) {
        // SAFETY: masked loads and stores stay within each row's `cols` elements.
        unsafe {
            for r in 0..rows {
                let (s, t) = (src.add(r * lds), dst.add(r * cols));
                for c in (0..cols).step_by(16) {
                    let k = (1u32 << (cols - c).min(16)).wrapping_sub(1) as u16;
                    _mm256_mask_storeu_epi16(t.add(c).cast(), k, f32::load16(k, s.add(c)));
                }
            }
        }
    }
}

impl Products<Avx512> for Pairs<'_> {
    #[inline(always)]
    unsafe fn queries(&mut self, a: &FlashArgs, qscale: f32, mp: usize) {
        self.qscale = qscale;
        let (m, dp) = (a.m, a.d / 2);
        // Q's rows as 32-bit units (pairs), transposed into `qp` (`dp × mp`): 8×8 blocks of
        // shuffles (bit moves only, so every pattern survives), the edges one unit at a time,
        // the padding lanes zero. f32 Q is rounded into `qr` first (rows of `d`).
        let (q, ldq) = if self.rounded {
            let qr = self.qr.as_mut_ptr().cast::<bf16>();
            // SAFETY: Q rows `< m` of `d` f32; `qr` holds `mp × d` bf16.
            unsafe { Self::round_rows(a.q, a.ldq, m, a.d, qr) };
            (qr.cast_const(), a.d)
        } else {
            (a.q.cast::<bf16>(), a.ldq)
        };
        let qp = self.qp.as_mut_ptr();
        // SAFETY: Q rows `< m` hold `d = 2·dp` elements at stride `ldq`; `qp` holds `dp × mp`.
        unsafe {
            let unit = |r: usize, p: usize| q.add(r * ldq + 2 * p).cast::<f32>();
            let (m8, p8) = (m / 8 * 8, dp / 8 * 8);
            for r0 in (0..m8).step_by(8) {
                for p0 in (0..p8).step_by(8) {
                    let rows: [__m256; 8] =
                        core::array::from_fn(|i| _mm256_loadu_ps(unit(r0 + i, p0)));
                    for (i, col) in transpose8_regs(&rows).iter().enumerate() {
                        _mm256_storeu_ps(qp.add((p0 + i) * mp + r0), *col);
                    }
                }
            }
            for p in 0..dp {
                let row = qp.add(p * mp);
                let start = if p < p8 { m8 } else { 0 };
                for r in start..m {
                    *row.add(r) = unit(r, p).read_unaligned();
                }
                core::slice::from_raw_parts_mut(row.add(m), mp - m).fill(0.0);
            }
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
        debug_assert!(nb <= key_block(a.d));
        // SAFETY: keys `< j0 + nb ≤ n` of K (pairs whole: `d` even) and V; the buffers hold
        // the block; the features are enabled (`forward`).
        unsafe {
            // f32 K is rounded a key block at a time (each call has its own block).
            let (k, ldk) = if self.rounded {
                let kr = self.kr.as_mut_ptr().cast::<bf16>();
                Self::round_rows(a.k.add(j0 * a.ldk), a.ldk, nb, a.d, kr);
                (kr.cast_const(), a.d)
            } else {
                (a.k.cast::<bf16>().add(j0 * a.ldk), a.ldk)
            };
            pair_gemm(
                nb,
                nv,
                a.d / 2,
                SCORE_PAIRS,
                k,
                ldk,
                2,
                self.qp.as_ptr().cast::<u32>().add(lanes),
                mp,
                s.as_mut_ptr().add(lanes),
                mp,
                Accum::Replace,
                Scaled(self.qscale, epi),
            );
            self.pack_v(a, j0, nb);
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
        // SAFETY: `pack_v` wrote this block; `s`, `pp` and `ot` cover the lanes.
        unsafe {
            self.pack_p(s, nb, lanes, mp);
            pair_gemm(
                a.dv,
                nv,
                nb.div_ceil(2),
                usize::MAX,
                self.vp.as_ptr().cast::<bf16>(),
                2,
                2 * self.dvp,
                self.pp.as_ptr().cast::<u32>().add(lanes),
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
        // P is rounded before it is normalised, as in the Oᵀ path: the largest weight of a row
        // is then 1, exact in bf16. Normalised first, it is rounded too; on peaked rows that
        // weighs (the 64-key bf16 golden: f32 output max error 3.8e-3 that way, 1.2e-3 this).
        // SAFETY: as `values`; O's rows `< m`, `dv` a multiple of 16 (so `dvp = dv`).
        unsafe {
            self.pack_p(s, nb, 0, mp);
            pair_gemm(
                a.m,
                a.dv / 16,
                nb.div_ceil(2),
                usize::MAX,
                self.pp.as_ptr().cast::<bf16>(),
                2,
                2 * mp,
                self.vp.as_ptr().cast::<u32>(),
                self.dvp,
                a.o,
                a.ldo,
                Accum::Replace,
                Plain,
            );
            for r in 0..a.m {
                let (row, kr) = (a.o.add(r * a.ldo), _mm512_set1_ps(k[r]));
                for c in (0..a.dv).step_by(16) {
                    _mm512_storeu_ps(row.add(c), _mm512_mul_ps(_mm512_loadu_ps(row.add(c)), kr));
                }
            }
        }
    }
}
