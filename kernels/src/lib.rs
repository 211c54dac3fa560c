//! Raw-slice SIMD kernels for attention, behind one run-time dispatch point.
//!
//! Every entry point takes an explicit [`Isa`]; [`Isa::detect`] picks the best one the CPU has
//! (or the one `ATTNKIT_ISA` forces). Each kernel has a naive f64 twin in [`mod@reference`], the spec
//! that tests compare every ISA against. Shapes are not validated here beyond `debug_assert!`s
//! and the checks each safe function documents: the `attnkit` crate validates user input first.
//!
//! The flash and decode kernels read their operands as any [`Elem`] (`f32`, [`bf16`],
//! [`f16`](struct@f16)), widened on load, and compute in f32; K and V may also be `i8` with an
//! f32 scale per row ([`Stored`]), the storage of quantised KV caches. The flash kernel is compiled once
//! for every type ([`flash_forward_as`]; [`flash_forward`] is its f32 form). The decode kernel
//! is generic: [`Operand`] holds its instances compiled here (Q, K and V of one type;
//! [`decode_partial`] is the f32 one), [`decode_partial_as`] is the generic entry point for
//! mixed types (compiled where it is used).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]
// Register tiles index several fixed-size arrays with one counter; iterator chains obscure them.
#![allow(clippy::needless_range_loop)]
// Kernel entry points take raw extents and strides by design.
#![allow(clippy::too_many_arguments)]

mod additive;
mod decode;
mod elem;
mod flash;
mod gemm;
mod gemv;
mod grad;
mod heads;
mod isa;
mod pages;
pub mod reference;
mod score;
mod simd;
#[cfg(target_arch = "x86_64")]
mod x86_64;

pub use decode::{
    decode_scratch_len, merge_partials, partial_len, DecodeArgs, DecodeRow, DecodeWalk,
    DECODE_KEY_BLOCK, DECODE_MAX_ROWS,
};
pub use elem::{Dtype, Elem, Stored};
pub use flash::{
    key_block, scratch_len, scratch_len_as, scratch_len_paged, scratch_len_with, FlashArgs,
    Precision,
};
pub use half::{bf16, f16};
pub use heads::{merge_heads, split_heads};
pub use isa::{Isa, IsaError};
pub use pages::KvPages;
pub use score::{visible_range, Alibi, CausalOffset, ScoreSpec};

use gemm::Accum;
use simd::Portable;

/// Defines `$name(isa, args…)`, which runs the generic kernel `$gm::$gf::<S, G…>(args…)` with `S`
/// the vector token of `isa` and `G…` the function's own type parameters (the operand element
/// types), inside a function compiled for that ISA (`#[target_feature]` on the per-ISA entry
/// only; everything below it is `#[inline(always)]`).
macro_rules! isa_fn {
    ($name:ident $(<$($g:ident : $gb:ident),*>)? ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? => $gm:ident :: $gf:ident) => {
        /// # Safety
        /// `isa.is_supported()` and the contract of the generic kernel.
        unsafe fn $name$(<$($g: $gb),*>)?(isa: Isa, $($arg: $ty),*) $(-> $ret)? {
            debug_assert!(isa.is_supported(), "{isa} is not supported on this CPU");
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn avx2$(<$($g: $gb),*>)?($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: forwarded contract; AVX2+FMA+F16C enabled by the caller's check.
                unsafe { $gm::$gf::<x86_64::avx2::Avx2 $($(, $g)*)?>($($arg),*) }
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512$(<$($g: $gb),*>)?($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: forwarded contract; AVX-512F enabled by the caller's check.
                unsafe { $gm::$gf::<x86_64::avx512::Avx512 $($(, $g)*)?>($($arg),*) }
            }
            match isa {
                // SAFETY: the portable path needs no CPU feature; forwarded contract.
                Isa::Scalar => unsafe { $gm::$gf::<Portable $($(, $g)*)?>($($arg),*) },
                // SAFETY: forwarded contract (`isa.is_supported()`).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2($($arg),*) },
                // SAFETY: forwarded contract (`isa.is_supported()`).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => unsafe { avx512($($arg),*) },
                #[cfg(not(target_arch = "x86_64"))]
                _ => panic!("{isa} is not available on this target"),
            }
        }
    };
}

isa_fn!(flash_widened(args: &FlashArgs, ops: flash::Operands, scratch: &mut [f32]) => flash::forward);

/// The fused kernel on `isa`: the bf16 pair products where the ISA has them and the operands
/// suit them, else the widening kernel.
///
/// # Safety
/// `isa.is_supported()` and the contract of `flash::forward`.
unsafe fn flash_isa(isa: Isa, args: &FlashArgs, ops: flash::Operands, scratch: &mut [f32]) {
    // Paged K and V take the widening path (the pair and tile paths read rows in place, it
    // through the table).
    #[cfg(target_arch = "x86_64")]
    match ops.path(isa, args.d) {
        // SAFETY: forwarded contract; `Amx` is supported (AVX-512 BF16 too, and the tiles).
        FlashPath::AmxTiles => return unsafe { x86_64::amx::forward(args, ops, scratch) },
        // SAFETY: forwarded contract; `Avx512Bf16` is supported (AVX-512 F, BW, VL, BF16).
        FlashPath::Bf16Pairs => return unsafe { x86_64::bf16::forward(args, ops, scratch) },
        FlashPath::Widened => {}
    }
    // SAFETY: forwarded contract.
    unsafe { flash_widened(isa, args, ops, scratch) }
}
isa_fn!(decode_isa<Q: Elem, KV: Stored>(args: &DecodeArgs<Q, KV>, partial: *mut f32, ldp: usize, scratch: &mut [f32]) => decode::decode);
isa_fn!(softmax_isa(x: &mut [f32], sink: f32) => flash::softmax);
isa_fn!(apply_row_isa(spec: &ScoreSpec, r: usize, j0: usize, x: &mut [f32], u: f32) => score::apply_row);
isa_fn!(exp_scale_isa(x: &mut [f32], m: f32, k: f32) => flash::exp_scale);
isa_fn!(probs_and_ds_isa(spec: &ScoreSpec, r: usize, j0: usize, scale: f32, lse: f32, delta: f32, s: &mut [f32],
    dp: &mut [f32], deriv: bool) => grad::probs_and_ds);
isa_fn!(block_isa<A: Elem, B: Elem>(m: usize, nvec: usize, kc: usize, chain: usize, a: *const A, rsa: usize, csa: usize, b: *const B,
    ldb: usize, c: *mut f32, ldc: usize, acc: Accum) => gemm::block);

/// Fused attention forward for one block of query rows of one head (see [`FlashArgs`]).
///
/// Output row `r` is `softmax_j(scale·q_r·k_j + bias_rj | mask) · V`; a row whose keys are all
/// masked is written as zeros and its logsumexp as −inf.
///
/// # Safety
/// * `isa.is_supported()`;
/// * every pointer in `args` is valid for the extents it describes (rows `< m` of Q, O, bias,
///   mask, lse, weights; rows `< n` of K and V and, for `i8` K and V, of their scales, addressed
///   through `pages`, whose table has an entry for every page a key `< n` falls in; `d`/`dv`
///   columns, `n` columns of bias, mask and weights) and the written ranges (O, lse, weights)
///   overlap nothing else that is read or written concurrently;
/// * `key_len ≤ n`; `scratch.len() ≥ scratch_len(m, d, dv)`.
pub unsafe fn flash_forward(isa: Isa, args: &FlashArgs, scratch: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { flash_forward_as(isa, args, scratch) }
}

/// [`flash_forward`] with Q read as `Q` and K, V as `KV` (widened to f32 block by block; the
/// rest is the same kernel, compiled here once for every type).
///
/// # Safety
/// As [`flash_forward`], with `scratch.len() ≥ scratch_len_as::<Q, KV>(m, d, dv)`
/// ([`scratch_len_paged`] when `args.pages` is a page table).
pub unsafe fn flash_forward_as<Q: Elem, KV: Stored>(
    isa: Isa,
    args: &FlashArgs<Q, KV>,
    scratch: &mut [f32],
) {
    // SAFETY: forwarded contract.
    unsafe { flash_forward_with(isa, args, scratch, Precision::Highest) }
}

/// [`flash_forward_as`] at `precision`: with [`Precision::Medium`], f32 Q, K and V take the bf16
/// pair products where `isa` has them (see [`flash_path_with`]).
///
/// # Safety
/// As [`flash_forward_as`], with `scratch.len() ≥ scratch_len_with::<Q, KV>(m, d, dv,
/// precision)` for contiguous K and V.
pub unsafe fn flash_forward_with<Q: Elem, KV: Stored>(
    isa: Isa,
    args: &FlashArgs<Q, KV>,
    scratch: &mut [f32],
    precision: Precision,
) {
    let need = if args.pages.is_contiguous() {
        scratch_len_with::<Q, KV>(args.m, args.d, args.dv, precision)
    } else {
        scratch_len_paged::<Q, KV>(args.m, args.d, args.dv)
    };
    assert!(scratch.len() >= need, "flash scratch too short");
    let (args, ops) = flash::erase(args);
    // SAFETY: forwarded contract; `ops` names the types behind the erased pointers.
    unsafe { flash_isa(isa, &args, ops.at(precision), scratch) }
}

/// How the fused kernel forms its products for an ISA and operand types (see [`flash_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FlashPath {
    /// f32 FMA tiles; 16-bit operands widened exactly, so the result is bitwise the f32
    /// kernel's on the widened values.
    Widened,
    /// bf16 pairs multiplied by `vdpbf16ps` ([`Isa::Avx512Bf16`], Q, K, V in bf16, `d` even;
    /// f32 Q, K, V rounded to bf16 at [`Precision::Medium`]):
    /// exact products and f32 sums as in f32, but the softmax weights are rounded to bf16 for
    /// `P·V`, so each output differs from the f32 result by at most `2⁻⁸·Σⱼ pⱼ·|vⱼ|` (plus f32
    /// rounding), the rounding PyTorch's bf16 attention applies too. The logsumexp and the
    /// weights are the f32 ones.
    Bf16Pairs,
    /// AMX-BF16 tile multiplies ([`Isa::Amx`], Q, K, V in bf16, `d` a multiple of 32): the
    /// products and the rounding of [`FlashPath::Bf16Pairs`], on tiles (≈ 5× its multiply rate).
    AmxTiles,
}

impl FlashPath {
    /// Whether the softmax weights are rounded to bf16 for `P·V` (every path but
    /// [`FlashPath::Widened`]).
    pub fn rounds_weights(self) -> bool {
        self != FlashPath::Widened
    }
}

/// [`flash_path`] at `precision` (contiguous K and V): [`Precision::Medium`] gives
/// [`FlashPath::Bf16Pairs`] for f32 Q, K and V on [`Isa::Avx512Bf16`] when `d` is even.
pub fn flash_path_with(isa: Isa, q: Dtype, kv: Dtype, d: usize, precision: Precision) -> FlashPath {
    let ops = flash::Operands {
        q,
        kv,
        paged: false,
        rounded: false,
    };
    ops.at(precision).path(isa, d)
}

/// The products [`flash_forward_as`] uses on `isa` for Q of type `q`, K and V of type `kv`, and
/// head dimension `d`, with contiguous K and V (paged K and V always take
/// [`FlashPath::Widened`]).
pub fn flash_path(isa: Isa, q: Dtype, kv: Dtype, d: usize) -> FlashPath {
    let bf16 = q == Dtype::Bf16 && kv == Dtype::Bf16;
    match isa {
        Isa::Amx if bf16 && d.is_multiple_of(32) => FlashPath::AmxTiles,
        // Widening beats `vdpbf16ps` on the Intel cores that have AMX (see `Isa::Avx512Bf16`).
        Isa::Avx512Bf16 if bf16 && d.is_multiple_of(2) => FlashPath::Bf16Pairs,
        _ => FlashPath::Widened,
    }
}

/// Decode attention over one key range for a group of rows sharing K and V (see
/// [`DecodeArgs`]): writes each row's partial `[m, l, o…]` (base-2 max, sum, unnormalised output;
/// [`partial_len`] floats) at `partial + r*ldp`. Combine partials with [`merge_partials`].
///
/// # Safety
/// * `isa.is_supported()`;
/// * K and V rows `< j_end` and every row's `q` (`d` values), `bias`/`mask` (indices `< j_end`)
///   and, for `i8` K and V, `k_scale`/`v_scale` (indices `< j_end`) are readable; `partial` is writable at `r*ldp + [0, dv+2)` for every row and overlaps no
///   input; `scratch.len() ≥ decode_scratch_len(d, dv)`.
pub unsafe fn decode_partial(
    isa: Isa,
    args: &DecodeArgs,
    partial: *mut f32,
    ldp: usize,
    scratch: &mut [f32],
) {
    // SAFETY: forwarded contract.
    unsafe { <f32 as Operand>::decode_partial(isa, args, partial, ldp, scratch) }
}

/// [`decode_partial`] with the queries read as `Q` and K, V as `KV` (widened to f32 on load).
/// Generic, so each pair of types is compiled in the crate that uses it; the [`Operand`]
/// instances are compiled here once.
///
/// # Safety
/// As [`decode_partial`].
pub unsafe fn decode_partial_as<Q: Elem, KV: Stored>(
    isa: Isa,
    args: &DecodeArgs<Q, KV>,
    partial: *mut f32,
    ldp: usize,
    scratch: &mut [f32],
) {
    assert!(
        scratch.len() >= decode_scratch_len(args.d, args.dv),
        "decode scratch too short"
    );
    // SAFETY: forwarded contract.
    unsafe { decode_isa(isa, args, partial, ldp, scratch) }
}

/// A storage type whose decode kernel, with f32 queries and K, V of that type, is compiled once
/// in this crate: `f32`, [`bf16`], [`f16`](struct@f16) and `i8` (with its row scales). Callers
/// generic over the cache's type dispatch through it rather than instantiating
/// [`decode_partial_as`] themselves (each instance compiles some 15 kernel variants per ISA);
/// queries of another type are widened to f32 first (exact, and a few rows of `d` values per
/// call). The flash kernel needs no such trait: it is compiled once for every type
/// ([`flash_forward_as`] only erases the types).
pub trait Operand: Stored {
    /// [`decode_partial`] for f32 queries over K and V of this type.
    ///
    /// # Safety
    /// As [`decode_partial`].
    unsafe fn decode_partial(
        isa: Isa,
        args: &DecodeArgs<f32, Self>,
        partial: *mut f32,
        ldp: usize,
        scratch: &mut [f32],
    );
}

macro_rules! operand {
    ($($t:ty),*) => {$(
        impl Operand for $t {
            #[inline(never)]
            unsafe fn decode_partial(
                isa: Isa,
                args: &DecodeArgs<f32, Self>,
                partial: *mut f32,
                ldp: usize,
                scratch: &mut [f32],
            ) {
                // SAFETY: forwarded contract.
                unsafe { decode_partial_as(isa, args, partial, ldp, scratch) }
            }
        }
    )*};
}
operand!(f32, bf16, f16, i8);

/// Vectorised `x ← 2^x` (see the accuracy note on [`reference::exp2`]): ≤ 3 ulp on
/// [-126, 127], flush to +0 below -126.5 (so `-inf → 0`), NaN propagates.
///
/// # Panics
/// If `isa` is not supported by this CPU.
pub fn exp2_slice(isa: Isa, x: &mut [f32]) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    // SAFETY: `exp_scale` handles any length; the ISA is supported (asserted).
    unsafe { exp_scale_isa(isa, x, 0.0, 1.0) }
}

/// Numerically stable softmax of one row in place: `x ← exp(x − max) / Σ exp(x − max)`.
/// A row of all `-inf` (fully masked) becomes all zeros. NaN propagates.
///
/// # Panics
/// If `isa` is not supported by this CPU.
pub fn softmax_row(isa: Isa, x: &mut [f32]) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    // SAFETY: `softmax` handles any length; the ISA is supported (asserted).
    unsafe { softmax_isa(isa, x, f32::NEG_INFINITY) }
}

/// [`softmax_row`] with an attention-sink logit that joins the max and the denominator and gets
/// no output: `x ← exp(x − m) / (Σ exp(x − m) + exp(sink − m))`, `m = max(max x, sink)`.
/// `sink = −inf` is [`softmax_row`].
///
/// # Panics
/// If `isa` is not supported by this CPU.
pub fn softmax_row_with_sink(isa: Isa, x: &mut [f32], sink: f32) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    // SAFETY: `softmax` handles any length; the ISA is supported (asserted).
    unsafe { softmax_isa(isa, x, sink) }
}

/// Applies `spec` to the natural-log scores `x` of its local row `r` for keys `j0 + [0,
/// x.len())`: softcap, ALiBi, bias, mask, and −inf outside the row's visible keys (see
/// [`ScoreSpec`]; the sink is not applied here). What the unfused path does between its GEMMs.
///
/// # Panics
/// If `isa` is not supported by this CPU.
///
/// # Safety
/// The bias and mask of row `r` are readable at columns `< j0 + x.len()` (nothing is read through
/// a null pointer).
pub unsafe fn apply_scores(isa: Isa, spec: &ScoreSpec, r: usize, j0: usize, x: &mut [f32]) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    // SAFETY: forwarded contract; the ISA is supported (asserted).
    unsafe { apply_row_isa(isa, spec, r, j0, x, 1.0) }
}

/// The backward pass's element-wise step for row `r` of a score tile, keys `j0 + [0, s.len())`:
/// the raw scores `s` (`q·k`) become the forward's weights `p = exp(spec(scale·s) − lse)`, and
/// `dp` (`dO·vᵀ`) becomes `dS = p·(dp − delta)` (`delta = rowsum(dO ∘ O)`), times the softcap's
/// derivative `1 − tanh²(scale·s/cap)` when `deriv` (without it, the gradient by the logit, what
/// a bias gets). A key the spec hides gets `p = 0` and `dS = 0` (for finite `dp`).
///
/// # Panics
/// If `isa` is not supported by this CPU, or `dp` is shorter than `s`.
///
/// # Safety
/// The bias and mask of row `r` are readable at columns `< j0 + s.len()`.
pub unsafe fn probs_and_ds(
    isa: Isa,
    spec: &ScoreSpec,
    r: usize,
    j0: usize,
    (scale, lse, delta): (f32, f32, f32),
    s: &mut [f32],
    dp: &mut [f32],
    deriv: bool,
) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    assert!(dp.len() >= s.len(), "dp shorter than s");
    // SAFETY: forwarded contract; the ISA is supported and `dp` long enough (asserted).
    unsafe { probs_and_ds_isa(isa, spec, r, j0, scale, lse, delta, s, dp, deriv) }
}

/// `C[m × n] = A[m × k] · B[k × n]` (row-major, leading dimensions `lda`, `ldb`, `ldc`) through
/// the attention micro-kernel: B is packed to a lane multiple, A is read in place by broadcast.
/// With `accumulate`, computes `C += A·B` instead.
///
/// In the fused kernel this is the score tile `Sᵀ = K·Q̂ᵀ` (A = K) and the output tile
/// `Oᵀ += Vᵀ·Pᵀ` (A = Vᵀ); exposed for tests and benches.
///
/// # Panics
/// If `isa` is unsupported or a slice is too short for the extents.
pub fn matmul(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    let need =
        |rows: usize, ld: usize, cols: usize| if rows == 0 { 0 } else { (rows - 1) * ld + cols };
    assert!(
        a.len() >= need(m, lda, k) && (m < 2 || lda >= k),
        "A too short"
    );
    assert!(
        b.len() >= need(k, ldb, n) && (k < 2 || ldb >= n),
        "B too short"
    );
    assert!(
        c.len() >= need(m, ldc, n) && (m < 2 || ldc >= n),
        "C too short"
    );
    if m == 0 || n == 0 {
        return;
    }
    let w = isa.lanes();
    let np = n.div_ceil(w) * w;
    let mut bp = vec![0.0f32; k * np];
    for p in 0..k {
        bp[p * np..p * np + n].copy_from_slice(&b[p * ldb..p * ldb + n]);
    }
    let mut cp = vec![0.0f32; m * np];
    if accumulate {
        for i in 0..m {
            cp[i * np..i * np + n].copy_from_slice(&c[i * ldc..i * ldc + n]);
        }
    }
    let acc = if accumulate {
        Accum::Add
    } else {
        Accum::Replace
    };
    // An empty A still needs a valid pointer for the (skipped) reduction loop.
    let a_ptr = if a.is_empty() {
        [0.0f32].as_ptr()
    } else {
        a.as_ptr()
    };
    // SAFETY: A, the packed B and the padded C cover the extents asserted above; the ISA is
    // supported (asserted).
    unsafe {
        block_isa(
            isa,
            m,
            np / w,
            k,
            usize::MAX,
            a_ptr,
            lda,
            1,
            bp.as_ptr(),
            np,
            cp.as_mut_ptr(),
            np,
            acc,
        )
    };
    for i in 0..m {
        c[i * ldc..i * ldc + n].copy_from_slice(&cp[i * np..i * np + n]);
    }
}

/// `C[m × nvec·W] = A[m × k]·B[k × nvec·W]` (or `+=` with `accumulate`), `W = isa.lanes()`: the
/// fused kernel's micro-kernel on operands in place, nothing packed. A is read by broadcast at
/// `a[i·rsa + p·csa]` (any strides, so a transposed tile is read as it lies); B and C are
/// row-major (`ldb`, `ldc`) and whole vectors wide: the caller pads them. The backward pass's
/// tile products run on it.
///
/// # Panics
/// If `isa` is not supported by this CPU.
///
/// # Safety
/// `a` is readable at `i·rsa + p·csa` for `i < m`, `p < k`; `b` at `p·ldb + [0, nvec·W)`; `c`
/// writable (and readable with `accumulate`) at `i·ldc + [0, nvec·W)`, overlapping neither `a`,
/// `b`, nor anything another thread touches meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn tile_gemm(
    isa: Isa,
    m: usize,
    nvec: usize,
    k: usize,
    a: *const f32,
    rsa: usize,
    csa: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    let acc = if accumulate {
        Accum::Add
    } else {
        Accum::Replace
    };
    // SAFETY: forwarded contract (one chain over the whole reduction); the ISA is supported.
    unsafe {
        block_isa::<f32, f32>(
            isa,
            m,
            nvec,
            k,
            usize::MAX,
            a,
            rsa,
            csa,
            b,
            ldb,
            c,
            ldc,
            acc,
        )
    }
}

isa_fn!(rows_dot_isa(m: usize, k: usize, n: usize, x: *const f32, ldx: usize, w: *const f32, ldw: usize, y: *mut f32, ldy: usize, accumulate: bool) => gemv::rows_dot);

/// The most rows of X for which [`rows_dot`] beats a packing GEMM (measured: a decode step's
/// projections, one to four tokens).
pub const SKINNY_ROWS: usize = 4;

/// `Y = X·Wᵀ` for a few rows of X, without packing: `y[r·ldy + c] = Σ_{p<k} x[r·ldx + p]·
/// w[c·ldw + p]` for `r < m`, `c < n` (plus the old `y` with `accumulate`). Row-major X and W,
/// as `nn.Linear` stores its weight. Any `m` works; past [`SKINNY_ROWS`] a GEMM is faster.
///
/// # Panics
/// If `isa` is not supported by this CPU.
///
/// # Safety
/// `x` is readable for `m` rows of `k` (stride `ldx`), `w` for `n` rows of `k` (stride `ldw`),
/// `y` writable (and readable with `accumulate`) at every `r·ldy + c`, and `y`'s elements overlap
/// neither `x`, `w`, nor anything another thread touches meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows_dot(
    isa: Isa,
    m: usize,
    k: usize,
    n: usize,
    x: *const f32,
    ldx: usize,
    w: *const f32,
    ldw: usize,
    y: *mut f32,
    ldy: usize,
    accumulate: bool,
) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    // SAFETY: forwarded contract; the ISA is supported (asserted).
    unsafe { rows_dot_isa(isa, m, k, n, x, ldx, w, ldw, y, ldy, accumulate) }
}

// ---------------------------------------------------------------------------------------------
// Additive (Bahdanau) attention and the vectorised tanh.

pub use additive::{
    additive_scratch_len, reference_additive_score, AdditiveArgs, ADDITIVE_KEY_BLOCK,
    ADDITIVE_KEY_PAD,
};

isa_fn!(additive_isa(args: &AdditiveArgs, scratch: &mut [f32]) => additive::forward);
isa_fn!(tanh_isa(x: &mut [f32]) => additive::tanh_inplace);

/// Fused additive attention for one block of query rows of one batch element (see
/// [`AdditiveArgs`]): output row `r` is `softmax_j(Σ_a w_a·tanh(q′_ra + k′_ja) + bias_rj | mask)·V`,
/// streamed over key blocks with an online softmax. A row whose keys are all masked is written as
/// zeros (weights zero, scores −inf).
///
/// # Safety
/// * `isa.is_supported()`;
/// * every pointer in `args` is valid for the extents it describes (rows `< m` of `qp`, `o`,
///   bias, mask, scores, weights; `a` rows of `kpt`, each readable for
///   `round_up(n, ADDITIVE_KEY_PAD)` columns; `a` entries of `wv`; rows `< key_len` of `v`) and
///   the written ranges (`o`, scores, weights) overlap nothing else read or written concurrently;
/// * `key_len ≤ n`; `scratch.len() ≥ additive_scratch_len(dv)`.
pub unsafe fn additive_forward(isa: Isa, args: &AdditiveArgs, scratch: &mut [f32]) {
    assert!(
        scratch.len() >= additive_scratch_len(args.dv),
        "additive scratch too short"
    );
    // SAFETY: forwarded contract.
    unsafe { additive_isa(isa, args, scratch) }
}

/// Vectorised `x ← tanh(x)`: at most 5.4 ulp (3.2e-7 absolute) from the exact value over every
/// finite f32 on the FMA paths (6.7 ulp and 4.0e-7 on the portable one; measured exhaustively,
/// see the ignored test `tanh_exhaustive`), ≤ 2 ulp for tiny and subnormal
/// inputs, `tanh(±0) = ±0`, `tanh(±inf) = ±1`, NaN propagates. The same function the additive
/// kernel evaluates.
///
/// # Panics
/// If `isa` is not supported by this CPU.
pub fn tanh_slice(isa: Isa, x: &mut [f32]) {
    assert!(isa.is_supported(), "{isa} is not supported on this CPU");
    // SAFETY: `tanh_inplace` handles any length; the ISA is supported (asserted).
    unsafe { tanh_isa(isa, x) }
}
