//! The validated form of one attention call: every check of the arguments, the ISA, the kernel
//! choice, the masks' broadcast strides, and the score spec of any (batch, head, row). The
//! drivers (`prefill`, `decode`, `unfused`) run over a [`Plan`] and validate nothing themselves.

use crate::alloc::checked_len;
use crate::error::{AttnError, Result};
use crate::exec::resolve_isa;
use crate::options::{Causal, Extras, Kernel, KeyLengths, MaskRef, SdpaOptions};
use crate::view::{check_disjoint, check_len, Tensor, TensorMut};
use attnkit_kernels::{
    visible_range, Alibi, Dtype, Elem, Isa, KvPages, Precision, ScoreSpec, Stored,
};

/// Whether [`Kernel::Auto`] picks the decode kernel for `lq` queries against `lk` keys. The
/// decode kernel reads K and V once per GQA group but pays a reduction per (row, key); the tiled
/// kernel reads them once per query head and wastes lanes below 16 rows. Crossover measured with
/// attnbench (`fused-prefill` vs `fused-decode`, D = 64 and 128, 1 and 2 threads, group sizes
/// 1–32; docs/tuning-log.md, "Kernel choice"):
/// - up to Lq = 4, decode wins at every Lk tried (16 to 32768);
/// - at Lq = 8 it wins from Lk ≈ 512 on (1.0–2.2×) but can lose below (Lk = 8–64: up to 2.9×
///   slower, the split and merge cost more than the short rows);
/// - from Lq = 16 prefill wins or ties.
fn decode_suits(lq: usize, lk: usize) -> bool {
    (lq <= 4 || (lq <= 8 && lk >= 512)) && lk >= lq
}

/// The kernel [`crate::sdpa`] will run for these logical shapes (`q (B, Hq, Lq, D)`,
/// `k (B, Hkv, Lk, D)`) and options, without weights asked for: `opts.kernel` when forced, else
/// the choice of [`Kernel::Auto`]. Benchmarks report it.
pub fn choose_kernel(q_shape: [usize; 4], k_shape: [usize; 4], opts: &SdpaOptions) -> Kernel {
    let (lq, hkv, lk) = (q_shape[2], k_shape[1], k_shape[2]);
    match opts.kernel {
        Kernel::Auto if hkv > 0 && decode_suits(lq, lk) => Kernel::Decode,
        Kernel::Auto => Kernel::Prefill,
        p => p,
    }
}

/// Mask buffer with its broadcast strides for (b, h, row); keys are contiguous.
#[derive(Clone, Copy)]
pub(crate) struct MaskPlan<T> {
    pub(crate) ptr: *const T,
    pub(crate) strides: [usize; 3],
}

/// Validated key lengths (`B` entries in `0..=Lk`), read in the caller's integer type.
#[derive(Clone, Copy, Debug)]
pub(crate) enum LensPlan {
    Usize(*const usize),
    U32(*const u32),
    I32(*const i32),
    I64(*const i64),
}

impl LensPlan {
    /// Checks `lens` (one per batch, each in `0..=lk`) and keeps a pointer to it.
    fn new(lens: &KeyLengths, b: usize, lk: usize) -> Result<Self> {
        mismatch("key_lengths", "B", b, lens.len())?;
        for batch in 0..b {
            let len = lens.get(batch).unwrap_or(0);
            if len < 0 {
                return Err(AttnError::BadParam {
                    arg: "key_lengths",
                    reason: "a key length is negative",
                });
            }
            if len > lk as i128 {
                return Err(AttnError::KeyLength {
                    batch,
                    len: usize::try_from(len).unwrap_or(usize::MAX),
                    lk,
                });
            }
        }
        Ok(match lens {
            KeyLengths::Usize(x) => LensPlan::Usize(x.as_ptr()),
            KeyLengths::U32(x) => LensPlan::U32(x.as_ptr()),
            KeyLengths::I32(x) => LensPlan::I32(x.as_ptr()),
            KeyLengths::I64(x) => LensPlan::I64(x.as_ptr()),
        })
    }

    /// Entry `b`.
    ///
    /// # Safety
    /// `b < B` of the validated slice, which is still borrowed.
    unsafe fn get(self, b: usize) -> usize {
        // SAFETY: per the contract; the values were checked to lie in `0..=Lk`.
        unsafe {
            match self {
                LensPlan::Usize(p) => *p.add(b),
                LensPlan::U32(p) => *p.add(b) as usize,
                LensPlan::I32(p) => *p.add(b) as usize,
                LensPlan::I64(p) => *p.add(b) as usize,
            }
        }
    }
}

/// The validated row scales of `i8` keys and values: row `j` of KV head `h` of batch `b` is
/// `k[b·ks[0] + h·ks[1] + j]` times its int8 values (V likewise).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScalesPlan {
    k: *const f32,
    ks: [usize; 2],
    v: *const f32,
    vs: [usize; 2],
}

/// Checks the scales `x` of `arg`'s rows against its shape `(B, Hkv, Lk, ·)`: shape
/// `(B, Hkv, Lk, 1)`, covered by the buffer, contiguous along Lk.
fn scales_plan(
    arg: &'static str,
    x: &Tensor<f32>,
    rows: [usize; 4],
) -> Result<(*const f32, [usize; 2])> {
    for (i, dim) in ["B", "Hkv", "Lk"].into_iter().enumerate() {
        mismatch(arg, dim, rows[i], x.shape[i])?;
    }
    mismatch(arg, "1", 1, x.shape[3])?;
    check_len(arg, x.data.len(), x.shape, x.strides)?;
    if x.shape[2] > 1 && x.strides[2] != 1 {
        return Err(AttnError::BadStride {
            arg,
            dim: "Lk",
            stride: x.strides[2],
            min: 1,
        });
    }
    let st = used_strides(1, x.shape, x.strides);
    Ok((x.data.as_ptr(), [st[0], st[1]]))
}

/// Everything validated, as raw parts the tasks can share: Q of element type `Q`, K and V of
/// `KV`, the output of `O`.
/// A paged cache's keys and values for [`Plan::new_paged`]: one pool of `(pages, Hkv, P·D K
/// values | P·Dv V values)`, `P = 2^shift` tokens a page, with `k` its start and `v` the
/// start of the first block's V rows (`P·D` later), and for int8 one of `(pages, Hkv, P K
/// scales | P V scales)` likewise (`v_scales` `P` into it); sequence `b`'s key `j` in page
/// `table[b·per_seq + j/P]`. The owner guarantees every table entry names a page of the pools
/// and every sequence has `per_seq` entries (padded).
pub(crate) struct PagedKv<'a, KV> {
    pub(crate) k: &'a [KV],
    pub(crate) v: &'a [KV],
    pub(crate) k_scales: &'a [f32],
    pub(crate) v_scales: &'a [f32],
    pub(crate) hkv: usize,
    pub(crate) d: usize,
    pub(crate) dv: usize,
    /// Keys of the longest sequence.
    pub(crate) lk: usize,
    pub(crate) shift: u32,
    pub(crate) table: &'a [u32],
    pub(crate) per_seq: usize,
}

/// The page table part of a plan over a paged cache (see [`PagedKv`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PagesPlan {
    table: *const u32,
    per_seq: usize,
    shift: u32,
    k_stride: usize,
    v_stride: usize,
    scale_stride: usize,
}

pub(crate) struct Plan<Q = f32, KV = f32, O = f32> {
    pub(crate) isa: Isa,
    /// Of the prefill kernel's products (see [`SdpaOptions::precision`]).
    pub(crate) precision: Precision,
    pub(crate) shape: Shape,
    pub(crate) scale: f32,
    pub(crate) causal: Option<Causal>,
    pub(crate) window: Option<usize>,
    pub(crate) kernel: Kernel,
    pub(crate) q: *const Q,
    pub(crate) qs: [usize; 3],
    pub(crate) k: *const KV,
    pub(crate) ks: [usize; 3],
    pub(crate) v: *const KV,
    pub(crate) vs: [usize; 3],
    /// Present exactly when K and V are `i8`.
    pub(crate) scales: Option<ScalesPlan>,
    pub(crate) o: *mut O,
    pub(crate) os: [usize; 3],
    pub(crate) bias: Option<MaskPlan<f32>>,
    pub(crate) mask: Option<MaskPlan<u8>>,
    pub(crate) key_lengths: Option<LensPlan>,
    /// ALiBi slopes and sinks, `Hq` values each (validated).
    pub(crate) alibi: Option<*const f32>,
    pub(crate) softcap: Option<f32>,
    pub(crate) sinks: Option<*const f32>,
    pub(crate) lse: *mut f32,
    pub(crate) weights: *mut f32,
    /// K and V in the pages of a paged cache: `k`, `v` and the scales address page 0 (strides
    /// `[0, P·D, D]`), the table the rest.
    pub(crate) pages: Option<PagesPlan>,
}

// SAFETY: the pointers come from borrows that outlive the `Plan` (it lives inside `sdpa_ext`),
// inputs are only read, and every task writes a disjoint set of output rows (checked by
// `check_disjoint` for `out`; `lse` and `weights` are dense and indexed by the task's rows).
unsafe impl<Q: Elem, KV: Stored, O: Elem> Sync for Plan<Q, KV, O> {}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) b: usize,
    pub(crate) hq: usize,
    pub(crate) hkv: usize,
    pub(crate) lq: usize,
    pub(crate) lk: usize,
    pub(crate) d: usize,
    pub(crate) dv: usize,
}

fn mismatch(arg: &'static str, dim: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(AttnError::ShapeMismatch {
            arg,
            dim,
            expected,
            got,
        })
    }
}

/// The strides the kernels step by for rows `width` wide: none for empty rows or views with a
/// zero-sized dimension (nothing is dereferenced, so no pointer steps past an empty buffer;
/// validation bounds no stride of such a view, and `b·s₀ + h·s₁` overflowed), and 0 for size-1
/// dimensions (never stepped; a huge one there would pass validation, then overflow the
/// kernels' signed strides).
pub(crate) fn used_strides(width: usize, shape: [usize; 4], strides: [usize; 3]) -> [usize; 3] {
    let empty = width == 0 || shape.contains(&0);
    core::array::from_fn(|i| {
        if empty || shape[i] == 1 {
            0
        } else {
            strides[i]
        }
    })
}

fn mask_plan<T>(m: &MaskRef<T>, arg: &'static str, s: &Shape) -> Result<MaskPlan<T>> {
    const NAMES: [&str; 4] = ["B", "H", "Lq", "Lk"];
    let full = [s.b, s.hq, s.lq, s.lk];
    for i in 0..3 {
        if m.shape[i] != 1 {
            mismatch(arg, NAMES[i], full[i], m.shape[i])?;
        }
    }
    mismatch(arg, "Lk", s.lk, m.shape[3])?;
    let needed = checked_len(arg, &m.shape)?;
    if m.data.len() != needed {
        return Err(AttnError::BufferLength {
            arg,
            needed,
            got: m.data.len(),
        });
    }
    // Row-major strides, 0 where the mask broadcasts. Saturating: with a zero-sized dimension
    // the others' products may overflow, and then no element is ever addressed.
    let [mb, mh, mq, lk] = m.shape;
    let st = |n: usize, s: usize| if n == 1 { 0 } else { s };
    let (row, head) = (lk, mq.saturating_mul(lk));
    Ok(MaskPlan {
        ptr: m.data.as_ptr(),
        strides: [st(mb, mh.saturating_mul(head)), st(mh, head), st(mq, row)],
    })
}

/// `(b, h, row)` offset into a `(B, H, L, ·)` view with strides `st`.
pub(crate) fn off(st: [usize; 3], b: usize, h: usize, r: usize) -> usize {
    b * st[0] + h * st[1] + r * st[2]
}

impl<Q: Elem, KV: Stored, O: Elem> Plan<Q, KV, O> {
    /// Validates everything and binds `out` as the destination. `scales`: the row scales of
    /// `i8` K and V, `(B, Hkv, Lk, 1)` each (required for `i8`, ignored otherwise).
    pub(crate) fn new(
        q: &Tensor<Q>,
        k: &Tensor<KV>,
        v: &Tensor<KV>,
        out: &mut TensorMut<O>,
        opts: &SdpaOptions,
        extras: &mut Extras,
        scales: Option<[&Tensor<f32>; 2]>,
    ) -> Result<Self> {
        let mut plan = Plan::validate(q, k, v, out.shape, opts, extras)?;
        if KV::DTYPE == Dtype::I8 {
            let [ksc, vsc] = scales.ok_or(AttnError::BadParam {
                arg: "k",
                reason: "int8 keys and values need their row scales (sdpa_int8)",
            })?;
            let (k, ks) = scales_plan("k_scales", ksc, k.shape)?;
            let (v, vs) = scales_plan("v_scales", vsc, v.shape)?;
            plan.scales = Some(ScalesPlan { k, ks, v, vs });
        }
        plan.bind_out(out)?;
        Ok(plan)
    }

    /// Validates a call on a paged cache as [`Plan::new`] does, with `kv` in place of K, V and
    /// their scales. Both kernels walk page tables, chosen as for contiguous K and V.
    pub(crate) fn new_paged(
        q: &Tensor<Q>,
        kv: &PagedKv<KV>,
        out: &mut TensorMut<O>,
        opts: &SdpaOptions,
        extras: &mut Extras,
    ) -> Result<Self> {
        // Shape-only stand-ins for K and V (stride 0 everywhere, so any non-empty pool covers
        // them): `validate` checks everything else against them.
        let b = q.shape[0];
        fn stand_in<'a, KV: Stored>(x: &'a [KV], shape: [usize; 4]) -> Option<Tensor<'a, KV>> {
            let need = if shape.contains(&0) { 0 } else { shape[3] };
            Some(Tensor::strided(x.get(..need)?, shape, [0; 3]))
        }
        let k = stand_in(kv.k, [b, kv.hkv, kv.lk, kv.d]);
        let v = stand_in(kv.v, [b, kv.hkv, kv.lk, kv.dv]);
        let (Some(k), Some(v)) = (k, v) else {
            // Rows to read but no page in the pool: the owner broke its contract.
            return Err(AttnError::BadParam {
                arg: "cache",
                reason: "paged cache pool smaller than a page",
            });
        };
        let mut plan = Plan::validate(q, &k, &v, out.shape, opts, extras)?;
        let page = 1usize << kv.shift;
        // One block per page and head: K rows, then V rows (the owner sized the pool, so
        // these products do not overflow).
        let blk = page * (kv.d + kv.dv);
        plan.k = kv.k.as_ptr();
        plan.ks = [0, blk, kv.d];
        plan.v = kv.v.as_ptr();
        plan.vs = [0, blk, kv.dv];
        if KV::DTYPE == Dtype::I8 {
            plan.scales = Some(ScalesPlan {
                k: kv.k_scales.as_ptr(),
                ks: [0, 2 * page],
                v: kv.v_scales.as_ptr(),
                vs: [0, 2 * page],
            });
        }
        plan.pages = Some(PagesPlan {
            table: kv.table.as_ptr(),
            per_seq: kv.per_seq,
            shift: kv.shift,
            k_stride: kv.hkv * blk,
            v_stride: kv.hkv * blk,
            scale_stride: kv.hkv * 2 * page,
        });
        plan.bind_out(out)?;
        Ok(plan)
    }

    /// Checks `out` and makes it the destination.
    fn bind_out(&mut self, out: &mut TensorMut<O>) -> Result<()> {
        check_len("out", out.data.len(), out.shape, out.strides)?;
        check_disjoint("out", out.shape, out.strides)?;
        self.o = out.data.as_mut_ptr();
        self.os = used_strides(self.shape.dv, out.shape, out.strides);
        Ok(())
    }

    /// How the kernels address batch `b`'s K and V rows.
    pub(crate) fn pages_at(&self, b: usize) -> KvPages {
        match self.pages {
            Some(p) => KvPages {
                // SAFETY: (offset) the table holds `per_seq` entries for every batch.
                table: unsafe { p.table.add(b * p.per_seq) },
                shift: p.shift,
                k_stride: p.k_stride,
                v_stride: p.v_stride,
                scale_stride: p.scale_stride,
            },
            None => KvPages::contiguous(),
        }
    }

    /// Validates the inputs, options and extras against an output of shape `out_shape`; the
    /// returned plan has no destination yet (null `o`).
    pub(crate) fn validate(
        q: &Tensor<Q>,
        k: &Tensor<KV>,
        v: &Tensor<KV>,
        out_shape: [usize; 4],
        opts: &SdpaOptions,
        extras: &mut Extras,
    ) -> Result<Self> {
        let extras_weights = extras.weights.is_some();
        let isa = resolve_isa(opts.isa)?;
        let f32s = Q::DTYPE == Dtype::F32 && KV::DTYPE == Dtype::F32;
        if opts.precision == Precision::Medium
            && f32s
            && opts.isa.is_some()
            && !matches!(isa, Isa::Avx512Bf16 | Isa::Amx)
        {
            return Err(AttnError::BadParam {
                arg: "precision",
                reason: "Precision::Medium needs bf16 products (Isa::Avx512Bf16 or Isa::Amx); \
                         the ISA forced in `isa` has none",
            });
        }
        let [b, hq, lq, d] = q.shape;
        let [_, hkv, lk, _] = k.shape;
        let dv = v.shape[3];
        // K and V of one batch serve every query batch (one encoder output, or a shared prefix,
        // attended by a batch of queries): a size-1 dimension steps by 0 (`used_strides`).
        for (arg, x) in [("k", k.shape[0]), ("v", v.shape[0])] {
            if x != 1 {
                mismatch(arg, "B", b, x)?;
            }
        }
        mismatch("k", "D", d, k.shape[3])?;
        mismatch("v", "H", hkv, v.shape[1])?;
        mismatch("v", "Lk", lk, v.shape[2])?;
        mismatch("out", "B", b, out_shape[0])?;
        mismatch("out", "H", hq, out_shape[1])?;
        mismatch("out", "Lq", lq, out_shape[2])?;
        mismatch("out", "Dv", dv, out_shape[3])?;
        if hkv == 0 && hq != 0 || hkv != 0 && hq % hkv != 0 {
            return Err(AttnError::HeadRatio { hq, hkv });
        }
        // Task counts and loop bounds multiply these; with empty rows (D = Dv = 0) the buffers
        // cannot bound them, so check them here.
        checked_len("q", &[b, hq])?;
        checked_len("q", &[b, hq, lq])?;
        checked_len("k", &[b, hkv, lk])?;
        checked_len("weights", &[lq, lk])?;
        check_len("q", q.data.len(), q.shape, q.strides)?;
        check_len("k", k.data.len(), k.shape, k.strides)?;
        check_len("v", v.data.len(), v.shape, v.strides)?;
        let shape = Shape {
            b,
            hq,
            hkv,
            lq,
            lk,
            d,
            dv,
        };

        let scale = opts.scale.unwrap_or(1.0 / (d.max(1) as f32).sqrt());
        if !scale.is_finite() {
            return Err(AttnError::BadParam {
                arg: "scale",
                reason: "must be finite",
            });
        }
        if opts.window.is_some() && opts.causal.is_none() {
            return Err(AttnError::BadParam {
                arg: "window",
                reason: "a sliding window needs causal masking",
            });
        }
        if opts.window == Some(0) {
            return Err(AttnError::BadParam {
                arg: "window",
                reason: "must be at least 1",
            });
        }
        // A window of max(Lq, Lk) keys or more hides nothing: every diagonal `i + offset + 1`
        // is at most Lq (top-left) or the key length ≤ Lk (bottom-right). Dropping it keeps
        // `usize::MAX` ("unbounded") and other huge values out of the index arithmetic.
        let window = opts.window.filter(|&w| w < lq.max(lk));
        // The decode kernel cannot produce weights.
        let kernel = match choose_kernel(q.shape, k.shape, opts) {
            Kernel::Decode if !extras_weights => Kernel::Decode,
            _ => Kernel::Prefill,
        };
        let mask = opts
            .bool_mask
            .as_ref()
            .map(|m| mask_plan(m, "bool_mask", &shape))
            .transpose()?;
        let bias = opts
            .bias
            .as_ref()
            .map(|m| mask_plan(m, "bias", &shape))
            .transpose()?;
        let key_lengths = opts
            .key_lengths
            .as_ref()
            .map(|l| LensPlan::new(l, b, lk))
            .transpose()?;
        let per_head = |arg: &'static str, x: Option<&[f32]>| -> Result<Option<*const f32>> {
            let Some(x) = x else { return Ok(None) };
            mismatch(arg, "Hq", hq, x.len())?;
            Ok(Some(x.as_ptr()))
        };
        let alibi = per_head("alibi", opts.alibi)?;
        if opts.alibi.is_some_and(|a| a.iter().any(|s| !s.is_finite())) {
            return Err(AttnError::BadParam {
                arg: "alibi",
                reason: "slopes must be finite",
            });
        }
        let sinks = per_head("sinks", opts.sinks)?;
        if opts
            .sinks
            .is_some_and(|a| a.iter().any(|s| s.is_nan() || *s == f32::INFINITY))
        {
            return Err(AttnError::BadParam {
                arg: "sinks",
                reason: "must be finite or -inf",
            });
        }
        if opts.softcap.is_some_and(|c| !(c > 0.0 && c.is_finite())) {
            return Err(AttnError::BadParam {
                arg: "softcap",
                reason: "must be positive and finite",
            });
        }
        let mut lse = core::ptr::null_mut();
        if let Some(buf) = extras.lse.as_deref_mut() {
            let needed = checked_len("lse", &[b, hq, lq])?;
            if buf.len() != needed {
                return Err(AttnError::BufferLength {
                    arg: "lse",
                    needed,
                    got: buf.len(),
                });
            }
            lse = buf.as_mut_ptr();
        }
        let mut weights = core::ptr::null_mut();
        if let Some(buf) = extras.weights.as_deref_mut() {
            let needed = checked_len("weights", &[b, hq, lq, lk])?;
            if buf.len() != needed {
                return Err(AttnError::BufferLength {
                    arg: "weights",
                    needed,
                    got: buf.len(),
                });
            }
            weights = buf.as_mut_ptr();
        }
        Ok(Plan {
            isa,
            precision: opts.precision,
            shape,
            scale,
            causal: opts.causal,
            window,
            kernel,
            q: q.data.as_ptr(),
            qs: used_strides(d, q.shape, q.strides),
            k: k.data.as_ptr(),
            ks: used_strides(d, k.shape, k.strides),
            v: v.data.as_ptr(),
            vs: used_strides(dv, v.shape, v.strides),
            scales: None,
            o: core::ptr::null_mut(),
            os: [0; 3],
            bias,
            mask,
            key_lengths,
            alibi,
            softcap: opts.softcap,
            sinks,
            lse,
            weights,
            pages: None,
        })
    }

    /// The K and V row scales of KV head `hk` of batch `b` (null unless K and V are `i8`).
    pub(crate) fn scales_at(&self, b: usize, hk: usize) -> (*const f32, *const f32) {
        match self.scales {
            // SAFETY: (offsets) the scales cover every (batch, KV head) of the views.
            Some(s) => unsafe {
                (
                    s.k.add(b * s.ks[0] + hk * s.ks[1]),
                    s.v.add(b * s.vs[0] + hk * s.vs[1]),
                )
            },
            None => (core::ptr::null(), core::ptr::null()),
        }
    }

    /// Multiply-adds of the whole call (for the sequential/parallel decision).
    pub(crate) fn work(&self) -> usize {
        let s = &self.shape;
        [
            s.b,
            s.hq,
            s.lq,
            s.lk.max(1),
            s.d.saturating_add(s.dv).max(1),
        ]
        .iter()
        .fold(1usize, |a, &x| a.saturating_mul(x))
    }

    /// Causal offset of batch `b`: key `j` visible to query `i` iff `j ≤ i + offset`.
    pub(crate) fn causal_off(&self, b: usize) -> Option<isize> {
        self.causal.map(|c| self.offset(b, c))
    }

    /// Position of query 0 in key coordinates under alignment `c` for batch `b`.
    fn offset(&self, b: usize, c: Causal) -> isize {
        match c {
            Causal::TopLeft => 0,
            Causal::BottomRight => self.key_len(b) as isize - self.shape.lq as isize,
            Causal::BottomRightAtLk => self.shape.lk as isize - self.shape.lq as isize,
        }
    }

    /// Visible key range `[lo, hi)` of query row `i` of batch `b` (key length, causality, window).
    pub(crate) fn key_range(&self, b: usize, i: usize) -> (usize, usize) {
        visible_range(self.key_len(b), self.causal_off(b), self.window, i)
    }

    /// The score rule of rows `row0…` of head `h` of batch `b`: visibility, masks (addressed at
    /// row `row0`), ALiBi (aligned as the causal mask is, bottom-right without one), softcap and
    /// sink.
    pub(crate) fn spec(&self, b: usize, h: usize, row0: usize) -> ScoreSpec {
        let at = |st: [usize; 3]| off(st, b, h, row0);
        // SAFETY: (pointer offsets) rows `< Lq` of validated, in-bounds masks; `h < Hq` entries
        // of the per-head slopes and sinks.
        unsafe {
            ScoreSpec {
                row0,
                key_len: self.key_len(b),
                causal: self.causal_off(b),
                window: self.window,
                softcap: self.softcap,
                alibi: self.alibi.map(|p| Alibi {
                    slope: *p.add(h),
                    offset: self.offset(b, self.causal.unwrap_or(Causal::BottomRight)),
                }),
                sink: self
                    .sinks
                    .map(|p| *p.add(h))
                    .filter(|s| *s != f32::NEG_INFINITY),
                bias: self
                    .bias
                    .map_or(core::ptr::null(), |m| m.ptr.add(at(m.strides))),
                ldbias: self.bias.map_or(0, |m| m.strides[2]),
                mask: self
                    .mask
                    .map_or(core::ptr::null(), |m| m.ptr.add(at(m.strides))),
                ldmask: self.mask.map_or(0, |m| m.strides[2]),
            }
        }
    }

    /// Valid key count of batch `b`.
    pub(crate) fn key_len(&self, b: usize) -> usize {
        match self.key_lengths {
            // SAFETY: validated to hold `B` entries.
            Some(p) => unsafe { p.get(b) },
            None => self.shape.lk,
        }
    }
}
