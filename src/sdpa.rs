//! Scaled dot-product attention: the public entry points. Each validates its arguments into a
//! [`Plan`] and runs the driver the plan names (prefill or decode).

use crate::alloc::zeros_for;
use crate::error::Result;
use crate::options::{Extras, Kernel, Par, Returns, SdpaOptions, SdpaOutput};
use crate::plan::Plan;
use crate::view::{Tensor, TensorMut};
use attnkit_kernels::{Elem, Operand, Stored};

/// Scaled dot-product attention, `softmax(Q·Kᵀ·scale + mask)·V`, written into `out`.
///
/// Shapes (logical, any layout): `q (B, Hq, Lq, D)`, `k (B, Hkv, Lk, D)`, `v (B, Hkv, Lk, Dv)`,
/// `out (B, Hq, Lq, Dv)`, with `Hq` a multiple of `Hkv` (query head `h` reads KV head
/// `h / (Hq/Hkv)`, no copies). K and V may have `B = 1`: one batch of keys and values serves every
/// query batch (as a B stride of 0 does). Semantics follow PyTorch's `F.scaled_dot_product_attention`
/// (bool masks: `true` = attend). A row whose keys are all masked is written as zeros, as in
/// PyTorch 2.x. Zero-sized B, H or Lq do nothing; `Lk = 0` makes every row fully masked (zeros);
/// `D = 0` gives uniform weights; `Dv = 0` writes nothing. NaN in the inputs propagates to the rows
/// it touches.
///
/// Writes only the elements of `out` inside its view and allocates nothing (scratch is kept per
/// thread and reused).
///
/// **Element types.** K and V share one type, `f32`, [`bf16`](crate::bf16) or
/// [`f16`](struct@crate::f16) (fixed at compile time, so they cannot disagree); Q is any of the
/// three (f32 queries over a 16-bit cache are the usual decoding case); `out` is `f32` or any of
/// them. The kernels widen 16-bit inputs exactly on load and compute in f32 (scores, softmax,
/// running max and sum, the output accumulator), so a call on 16-bit operands returns in f32
/// what the f32 call returns on the widened values, bit for bit; a 16-bit `out` is that result
/// rounded once (to nearest even). `lse` and `weights` are always f32. The exceptions are Q, K
/// and V all bf16 on [`Isa::Amx`](crate::Isa::Amx) (chosen by default where the CPU and OS
/// allow it; `D` a multiple of 32) and on [`Isa::Avx512Bf16`](crate::Isa::Avx512Bf16) (the
/// default on AMD CPUs): they round the softmax weights to bf16 for `P·V`, as PyTorch's bf16
/// attention does (see [`FlashPath`](crate::kernels::FlashPath));
/// force `ATTNKIT_ISA=avx512` for the exact widening path.
///
/// # Errors
/// [`AttnError`](crate::AttnError) naming the argument and sizes for: a dimension that disagrees between q, k, v,
/// out and the mask; a buffer shorter than its view; an output view whose rows overlap; `Hq` not
/// a multiple of `Hkv`; a key length `> Lk`; sizes that overflow; a non-finite scale; an ISA the
/// CPU lacks; kernel scratch the allocator refuses (kept per thread, a few hundred times
/// `D + Dv` floats). A refused call writes nothing.
///
/// # Example
/// ```
/// use attnkit::{sdpa, SdpaOptions, Tensor, TensorMut};
/// let (b, h, l, d) = (1, 2, 4, 8);
/// let q = vec![0.1f32; b * h * l * d];
/// let (k, v) = (q.clone(), q.clone());
/// let mut out = vec![0.0f32; b * h * l * d];
/// sdpa(
///     &Tensor::bhld(&q, [b, h, l, d]),
///     &Tensor::bhld(&k, [b, h, l, d]),
///     &Tensor::bhld(&v, [b, h, l, d]),
///     &mut TensorMut::bhld(&mut out, [b, h, l, d]),
///     &SdpaOptions::new(),
/// )?;
/// assert!((out[0] - 0.1).abs() < 1e-6);
/// # Ok::<(), attnkit::AttnError>(())
/// ```
pub fn sdpa<Q: Elem, KV: Operand, O: Elem>(
    q: &Tensor<Q>,
    k: &Tensor<KV>,
    v: &Tensor<KV>,
    out: &mut TensorMut<O>,
    opts: &SdpaOptions,
) -> Result<()> {
    sdpa_ext(q, k, v, out, opts, Extras::default())
}

/// [`sdpa`] returning a new dense `(B, Hq, Lq, Dv)` f32 buffer.
///
/// # Errors
/// As [`sdpa`].
pub fn sdpa_vec<Q: Elem, KV: Operand>(
    q: &Tensor<Q>,
    k: &Tensor<KV>,
    v: &Tensor<KV>,
    opts: &SdpaOptions,
) -> Result<Vec<f32>> {
    let [b, hq, lq, _] = q.shape;
    let shape = [b, hq, lq, v.shape[3]];
    // Validate before allocating: a bad argument is reported as such, not as a failed allocation.
    Plan::<Q, KV, f32>::validate(q, k, v, shape, opts, &mut Extras::default())?;
    let mut buf = zeros_for("out", &shape)?;
    sdpa(q, k, v, &mut TensorMut::bhld(&mut buf, shape), opts)?;
    Ok(buf)
}

/// [`sdpa_ext`] returning new buffers: the dense `(B, Hq, Lq, Dv)` output and the extras
/// `want` names (`lse` `(B, Hq, Lq)`, `weights` `(B, Hq, Lq, Lk)`), all f32.
///
/// ```
/// use attnkit::{sdpa_ext_vec, Returns, SdpaOptions, Tensor};
/// let x = vec![0.5f32; 3 * 4];
/// let t = Tensor::bhld(&x, [1, 1, 3, 4]);
/// let r = sdpa_ext_vec(&t, &t, &t, &SdpaOptions::new(), Returns { lse: true, weights: true })?;
/// assert_eq!((r.out.len(), r.lse.map(|l| l.len()), r.weights.map(|w| w.len())), (12, Some(3), Some(9)));
/// # Ok::<(), attnkit::AttnError>(())
/// ```
///
/// # Errors
/// As [`sdpa`]; [`AttnError::Alloc`](crate::AttnError::Alloc) when a buffer cannot be allocated.
pub fn sdpa_ext_vec<Q: Elem, KV: Operand>(
    q: &Tensor<Q>,
    k: &Tensor<KV>,
    v: &Tensor<KV>,
    opts: &SdpaOptions,
    want: Returns,
) -> Result<SdpaOutput> {
    let [b, hq, lq, _] = q.shape;
    let lk = k.shape[2];
    let shape = [b, hq, lq, v.shape[3]];
    Plan::<Q, KV, f32>::validate(q, k, v, shape, opts, &mut Extras::default())?;
    let mut out = zeros_for("out", &shape)?;
    let mut lse = want
        .lse
        .then(|| zeros_for("lse", &[b, hq, lq]))
        .transpose()?;
    let mut weights = want
        .weights
        .then(|| zeros_for("weights", &[b, hq, lq, lk]))
        .transpose()?;
    let extras = Extras {
        lse: lse.as_deref_mut(),
        weights: weights.as_deref_mut(),
    };
    sdpa_ext(q, k, v, &mut TensorMut::bhld(&mut out, shape), opts, extras)?;
    Ok(SdpaOutput { out, lse, weights })
}

/// [`sdpa`] that also writes the per-row logsumexp and/or the attention weights.
///
/// # Errors
/// As [`sdpa`], plus a wrong length of `extras.lse` (`B·Hq·Lq`) or `extras.weights`
/// (`B·Hq·Lq·Lk`).
pub fn sdpa_ext<Q: Elem, KV: Operand, O: Elem>(
    q: &Tensor<Q>,
    k: &Tensor<KV>,
    v: &Tensor<KV>,
    out: &mut TensorMut<O>,
    opts: &SdpaOptions,
    extras: Extras,
) -> Result<()> {
    sdpa_scaled(q, k, v, None, out, opts, extras)
}

/// [`sdpa`] over int8 keys and values with an f32 scale per row: key row `(b, h, j)` is
/// `k_scales(b, h, j, 0)·k(b, h, j, ·)`, values likewise — the layout of an int8
/// [`KvCache`](crate::KvCache) (`KvCache::<i8>::attend` calls this), and of caches quantised
/// per token and head elsewhere. `k (B, Hkv, Lk, D)`, `v (B, Hkv, Lk, Dv)`; `k_scales`,
/// `v_scales` are `(B, Hkv, Lk, 1)` views, contiguous along `Lk`. The kernels widen each int8
/// row, apply its scale in f32 and compute as [`sdpa`] does, so the result is the f32 attention
/// of the dequantised values (within f32 rounding: the scale is applied to the row's dot
/// product in decode, to the widened values in prefill). Non-finite scales propagate NaN to the
/// rows that see them.
///
/// # Errors
/// As [`sdpa`], plus scales whose shape differs from the rows' or whose buffer is too short
/// (`k_scales`/`v_scales`), or that are not contiguous along `Lk`.
pub fn sdpa_int8<Q: Elem, O: Elem>(
    q: &Tensor<Q>,
    k: &Tensor<i8>,
    k_scales: &Tensor<f32>,
    v: &Tensor<i8>,
    v_scales: &Tensor<f32>,
    out: &mut TensorMut<O>,
    opts: &SdpaOptions,
) -> Result<()> {
    let scales = Some([k_scales, v_scales]);
    sdpa_scaled(q, k, v, scales, out, opts, Extras::default())
}

/// [`sdpa_ext`] with the row scales `i8` K and V need.
pub(crate) fn sdpa_scaled<Q: Elem, KV: Operand, O: Elem>(
    q: &Tensor<Q>,
    k: &Tensor<KV>,
    v: &Tensor<KV>,
    scales: Option<[&Tensor<f32>; 2]>,
    out: &mut TensorMut<O>,
    opts: &SdpaOptions,
    mut extras: Extras,
) -> Result<()> {
    let plan = Plan::new(q, k, v, out, opts, &mut extras, scales)?;
    execute(&plan, opts.par)
}

/// Runs a validated plan: the cases with nothing to compute, then the driver of its kernel.
pub(crate) fn execute<Q: Elem, KV: Operand, O: Elem>(p: &Plan<Q, KV, O>, par: Par) -> Result<()> {
    let s = &p.shape;
    if s.b == 0 || s.hq == 0 || s.lq == 0 {
        return Ok(());
    }
    // Nothing to write: then every buffer may be empty, and nothing bounds B·Hq·Lq.
    if s.dv == 0 && p.lse.is_null() && (p.weights.is_null() || s.lk == 0) {
        return Ok(());
    }
    let unmasked = p.bias.is_none()
        && p.mask.is_none()
        && p.weights.is_null()
        && p.alibi.is_none()
        && p.sinks.is_none();
    if s.d == 0 && s.dv == 0 && unmasked {
        run_lse_only(p);
        return Ok(());
    }
    match p.kernel {
        Kernel::Decode => crate::decode::run(p, par),
        _ => crate::prefill::run(p, par),
    }
}

/// The logsumexp of rows with `D = Dv = 0` and no mask: every visible score is 0, so it is
/// the log of the visible key count, found without walking the keys (the views are empty,
/// so nothing else bounds `Lk`).
fn run_lse_only<Q: Elem, KV: Stored, O: Elem>(p: &Plan<Q, KV, O>) {
    let s = &p.shape;
    for b in 0..s.b {
        for h in 0..s.hq {
            for i in 0..s.lq {
                let (lo, hi) = p.key_range(b, i);
                let lse = if hi > lo {
                    ((hi - lo) as f64).ln() as f32
                } else {
                    f32::NEG_INFINITY
                };
                // SAFETY: `lse` holds `B·Hq·Lq` values (validated) and is not null here.
                unsafe { *p.lse.add((b * s.hq + h) * s.lq + i) = lse };
            }
        }
    }
}
