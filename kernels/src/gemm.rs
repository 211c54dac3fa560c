//! Register-tiled micro-kernel `C (+)= A·B` and the loop that covers a block with it.
//!
//! The fused kernel works on *transposed* tiles, queries along the SIMD axis, so that K and V are
//! read in place as the broadcast operand (no per-block packing) and the softmax reductions over
//! keys are vertical (no shuffles):
//! * scores  `Sᵀ[nb × m] = K[nb × d] · Q̂ᵀ[d × m]` (Q̂ᵀ packed once per query block);
//! * output  `Oᵀ[dv × m] += Vᵀ[dv × nb] · Pᵀ[nb × m]` (Vᵀ is V read with swapped strides).
//!
//! Register layout of one tile (AVX-512, MR = 8, NV = 3, W = 16): 24 accumulators `c[i][v]`
//! (8 rows × 48 columns), 3 loads of B per step of the reduction and one broadcast of A:
//! ```text
//!            b0    b1    b2          <- B[p, 0..48] (3 zmm)
//!   a0 ->  c00   c01   c02
//!   ...                              (8 rows, A[i, p] broadcast)
//!   a7 ->  c70   c71   c72
//! ```
//! AVX2 and the portable path use MR = 6 / 4, NV = 2 (12 / 8 accumulators of 16 ymm).

use crate::elem::{get, Elem};
use crate::simd::{ScaledTanh, SimdDiv};

/// How a tile treats the existing contents of C.
#[derive(Clone, Copy)]
pub(crate) enum Accum {
    /// `C = A·B`; C is not read (it may hold garbage or NaN).
    Replace,
    /// `C = C + A·B`.
    Add,
}

/// What a tile does to each finished register of C before it stores it: nothing, or a
/// transform that would otherwise be a pass over C (the softcap of the score tile).
pub(crate) trait Epilogue: Copy {
    /// The stored value of a finished register `v`.
    ///
    /// # Safety
    /// The ISA of `S` is enabled.
    unsafe fn apply<S: SimdDiv>(&self, v: S::V) -> S::V;
}

/// Stores C as computed.
#[derive(Clone, Copy)]
pub(crate) struct Plain;

impl Epilogue for Plain {
    #[inline(always)]
    unsafe fn apply<S: SimdDiv>(&self, v: S::V) -> S::V {
        v
    }
}

/// Stores `k·tanh(c)`: the softcap of scores computed already divided by the cap.
#[derive(Clone, Copy)]
pub(crate) struct Softcap(pub(crate) ScaledTanh);

impl Epilogue for Softcap {
    #[inline(always)]
    unsafe fn apply<S: SimdDiv>(&self, v: S::V) -> S::V {
        // SAFETY: forwarded contract.
        unsafe { self.0.eval::<S>(v) }
    }
}

/// Stores `e(k·c)`: the softmax scale applied to a score tile whose operands could not carry it
/// (bf16 Q, multiplied exactly as the caller gave it), then the epilogue `e`.
#[derive(Clone, Copy)]
pub(crate) struct Scaled<F>(pub(crate) f32, pub(crate) F);

impl<F: Epilogue> Epilogue for Scaled<F> {
    #[inline(always)]
    unsafe fn apply<S: SimdDiv>(&self, v: S::V) -> S::V {
        // SAFETY: forwarded contract.
        unsafe { self.1.apply::<S>(S::mul(v, S::splat(self.0))) }
    }
}

/// One step of a tile's reduction: what A and B point at, how a register of B and a broadcast
/// of A are read, and how they are multiplied into an accumulator. [`Fma`] is the f32 product;
/// `x86_64::bf16` has a pairwise bf16 one. The tile loops are written once over it.
pub(crate) trait Mac<S: SimdDiv>: Copy {
    /// What A points at.
    type A;
    /// What B points at.
    type B;
    /// The register of B at `b` (`W` lanes of its unit).
    ///
    /// # Safety
    /// Readable; the ISA of `S` is enabled.
    unsafe fn load_b(b: *const Self::B) -> S::V;
    /// The element of A at `a`, broadcast.
    ///
    /// # Safety
    /// Readable; the ISA of `S` is enabled.
    unsafe fn bcast_a(a: *const Self::A) -> S::V;
    /// `c + a·b`.
    ///
    /// # Safety
    /// The ISA of `S` is enabled.
    unsafe fn mac(a: S::V, b: S::V, c: S::V) -> S::V;
}

/// The f32 product: A and B of any [`Elem`], widened as they are read, one FMA per step.
pub(crate) struct Fma<A, B>(core::marker::PhantomData<(A, B)>);

impl<A, B> Clone for Fma<A, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<A, B> Copy for Fma<A, B> {}

impl<S: SimdDiv, A: Elem, B: Elem> Mac<S> for Fma<A, B> {
    type A = A;
    type B = B;
    #[inline(always)]
    unsafe fn load_b(b: *const B) -> S::V {
        // SAFETY: forwarded contract.
        unsafe { S::load_as(b) }
    }
    #[inline(always)]
    unsafe fn bcast_a(a: *const A) -> S::V {
        // SAFETY: forwarded contract.
        unsafe { S::splat(get(a)) }
    }
    #[inline(always)]
    unsafe fn mac(a: S::V, b: S::V, c: S::V) -> S::V {
        // SAFETY: forwarded contract.
        unsafe { S::fma(a, b, c) }
    }
}

/// One MR × (NV·W) tile, reducing over `kc` in chains of at most `chain` steps. Offsets count
/// units of `M::A` and `M::B`.
///
/// # Safety
/// `a` is readable at `i*rsa + p*csa` and `b` at `p*ldb + [0, NV·W)` for `i < MR`, `p < kc`; `c` is
/// readable (for `Add`) and writable at `i*ldc + [0, NV·W)`; the ISA of `S` is enabled.
#[inline(always)]
unsafe fn tile<S: SimdDiv, M: Mac<S>, F: Epilogue, const MR: usize, const NV: usize>(
    kc: usize,
    chain: usize,
    a: *const M::A,
    rsa: usize,
    csa: usize,
    b: *const M::B,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    acc: Accum,
    epi: F,
) {
    // SAFETY: pointer ranges as promised by the caller (see `# Safety`).
    unsafe {
        let mut r = [[S::splat(0.0); NV]; MR];
        if let Accum::Add = acc {
            for i in 0..MR {
                for v in 0..NV {
                    r[i][v] = S::load(c.add(i * ldc + v * S::W));
                }
            }
        }
        // The reduction runs in chunks of `chain` steps, each its own FMA chain, the chunks
        // summed through C (see `SCORE_CHAIN` in flash.rs).
        let mut p0 = 0usize;
        loop {
            let p1 = kc.min(p0.saturating_add(chain.max(1)));
            for p in p0..p1 {
                let mut bv = [S::splat(0.0); NV];
                for v in 0..NV {
                    bv[v] = M::load_b(b.add(p * ldb + v * S::W));
                }
                for i in 0..MR {
                    let ai = M::bcast_a(a.add(i * rsa + p * csa));
                    for v in 0..NV {
                        r[i][v] = M::mac(ai, bv[v], r[i][v]);
                    }
                }
            }
            for i in 0..MR {
                for v in 0..NV {
                    let cp = c.add(i * ldc + v * S::W);
                    let x = if p0 == 0 {
                        r[i][v]
                    } else {
                        S::add(S::load(cp), r[i][v])
                    };
                    let x = if p1 == kc { epi.apply::<S>(x) } else { x };
                    S::store(cp, x);
                }
            }
            if p1 == kc {
                break;
            }
            r = [[S::splat(0.0); NV]; MR];
            p0 = p1;
        }
    }
}

/// One column panel (NV vectors wide) over all `m` rows: full MR-row tiles, then one shorter
/// tile. The panel of B (`kc × NV·W`) stays in L1 while the rows of A stream past it.
#[inline(always)]
unsafe fn panel<S: SimdDiv, M: Mac<S>, F: Epilogue, const MR: usize, const NV: usize>(
    m: usize,
    kc: usize,
    chain: usize,
    a: *const M::A,
    rsa: usize,
    csa: usize,
    b: *const M::B,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    acc: Accum,
    epi: F,
) {
    let mut i = 0;
    // SAFETY: each tile stays inside the `m` rows the caller vouched for.
    unsafe {
        while i + MR <= m {
            tile::<S, M, F, MR, NV>(
                kc,
                chain,
                a.add(i * rsa),
                rsa,
                csa,
                b,
                ldb,
                c.add(i * ldc),
                ldc,
                acc,
                epi,
            );
            i += MR;
        }
        let (a, c) = (a.add(i * rsa), c.add(i * ldc));
        match m - i {
            0 => {}
            1 => tile::<S, M, F, 1, NV>(kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi),
            2 if const { MR > 2 } => {
                tile::<S, M, F, 2, NV>(kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi)
            }
            3 if const { MR > 3 } => {
                tile::<S, M, F, 3, NV>(kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi)
            }
            4 if const { MR > 4 } => {
                tile::<S, M, F, 4, NV>(kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi)
            }
            5 if const { MR > 5 } => {
                tile::<S, M, F, 5, NV>(kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi)
            }
            6 if const { MR > 6 } => {
                tile::<S, M, F, 6, NV>(kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi)
            }
            7 if const { MR > 7 } => {
                tile::<S, M, F, 7, NV>(kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi)
            }
            // Fewer than MR rows are left; the `const` guards compile only those tiles.
            _ => unreachable!("fewer than MR ≤ 8 rows are left"),
        }
    }
}

/// `C[m × nvec·W] (+)= A[m × kc] · B[kc × nvec·W]`, covered by NV-wide column panels. A is read by
/// broadcast at `a[i·rsa + p·csa]` (any strides: K or Vᵀ in place); B and C are row-major. What
/// A and B hold and how a step multiplies them is `M` ([`Fma`]: any [`Elem`], widened as read);
/// C is f32.
///
/// # Safety
/// As [`tile`], for all `m` rows and `nvec·W` columns; `NV ≤ 4`, `MR ≤ 8`.
#[inline(always)]
pub(crate) unsafe fn gemm<S: SimdDiv, M: Mac<S>, F: Epilogue, const MR: usize, const NV: usize>(
    m: usize,
    nvec: usize,
    kc: usize,
    chain: usize,
    a: *const M::A,
    rsa: usize,
    csa: usize,
    b: *const M::B,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    acc: Accum,
    epi: F,
) {
    let mut v0 = 0;
    // SAFETY: each panel stays inside the `nvec·W` columns the caller vouched for.
    unsafe {
        while v0 + NV <= nvec {
            let off = v0 * S::W;
            panel::<S, M, F, MR, NV>(
                m,
                kc,
                chain,
                a,
                rsa,
                csa,
                b.add(off),
                ldb,
                c.add(off),
                ldc,
                acc,
                epi,
            );
            v0 += NV;
        }
        let off = v0 * S::W;
        let (b, c) = (b.add(off), c.add(off));
        match nvec - v0 {
            0 => {}
            1 => panel::<S, M, F, MR, 1>(m, kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi),
            2 if const { NV > 2 } => {
                panel::<S, M, F, MR, 2>(m, kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi)
            }
            3 if const { NV > 3 } => {
                panel::<S, M, F, MR, 3>(m, kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi)
            }
            _ => unreachable!("fewer than NV ≤ 4 vectors are left"),
        }
    }
}

/// Per-ISA choice of tile shape (the one place where MR and NV are fixed).
pub(crate) trait Tiles: SimdDiv {
    /// [`gemm`] with this ISA's tile shape.
    ///
    /// # Safety
    /// As [`gemm`].
    unsafe fn block<A: Elem, B: Elem, F: Epilogue>(
        m: usize,
        nvec: usize,
        kc: usize,
        chain: usize,
        a: *const A,
        rsa: usize,
        csa: usize,
        b: *const B,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        acc: Accum,
        epi: F,
    );
}

macro_rules! tiles {
    ($t:ty, $mr:literal, $nv:literal) => {
        impl Tiles for $t {
            #[inline(always)]
            unsafe fn block<A: Elem, B: Elem, F: Epilogue>(
                m: usize,
                nvec: usize,
                kc: usize,
                chain: usize,
                a: *const A,
                rsa: usize,
                csa: usize,
                b: *const B,
                ldb: usize,
                c: *mut f32,
                ldc: usize,
                acc: Accum,
                epi: F,
            ) {
                // SAFETY: forwarded contract.
                unsafe {
                    gemm::<$t, Fma<A, B>, F, $mr, $nv>(
                        m, nvec, kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, epi,
                    )
                }
            }
        }
    };
}

tiles!(crate::simd::Portable, 4, 2);
#[cfg(target_arch = "x86_64")]
tiles!(crate::x86_64::avx2::Avx2, 6, 2);
#[cfg(target_arch = "x86_64")]
tiles!(crate::x86_64::avx512::Avx512, 8, 3);

/// [`Tiles::block`] without an epilogue as a free generic function, the form the ISA dispatch
/// instantiates.
///
/// # Safety
/// As [`gemm`].
#[inline(always)]
pub(crate) unsafe fn block<S: Tiles, A: Elem, B: Elem>(
    m: usize,
    nvec: usize,
    kc: usize,
    chain: usize,
    a: *const A,
    rsa: usize,
    csa: usize,
    b: *const B,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    acc: Accum,
) {
    // SAFETY: forwarded contract.
    unsafe { S::block(m, nvec, kc, chain, a, rsa, csa, b, ldb, c, ldc, acc, Plain) }
}
