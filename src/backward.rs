//! The backward pass of [`crate::sdpa`]: dQ, dK and dV from the forward's inputs, its output and
//! logsumexp, and the upstream gradient dO (FlashAttention-2's formulas, scores recomputed a
//! tile at a time).
//!
//! With `P = exp(logit − lse)`, `D = rowsum(dO ∘ O)`:
//! `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)` (times the softcap's derivative),
//! `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`.
//!
//! **Determinism.** Every task owns the gradients it writes. With enough (batch, KV head) pairs
//! for the threads, one task per pair computes dK, dV and the dQ of its query heads in one pass
//! (5 tile products per tile). With fewer (one long sequence on many threads), two passes: one
//! task per (batch, KV head, key block) accumulates that block's dK and dV over the group's query
//! heads and query blocks in a fixed order; then one task per (batch, query head, query block)
//! accumulates its dQ over the key blocks, recomputing the scores and dP (7 products per tile).
//! Both ways add the same tiles in the same order, so results are bitwise the same for any
//! thread count. The alternative to the second pass, per-key-block partial dQ, costs memory
//! proportional to `Lk/block · Lq · D` per head.
//!
//! **Memory.** Besides the gradients: `D` (one f32 per query row), lane-padded copies of K, Q
//! and dO when `D` or `Dv` is not a multiple of the vector width, and per task two `128 × 128`
//! tiles, `128 × (2D + Dv)` accumulators and the Kᵀ and Vᵀ of its key block (`128 × (D + Dv)`);
//! at `D = Dv = 128`, 320 KiB a task. Never `Lq × Lk`.

use crate::alloc::{checked_len, try_zeros};
use crate::error::{AttnError, Result};
use crate::exec::{run_tasks, threads, SendPtr};
use crate::options::{Extras, SdpaOptions};
use crate::plan::{off, used_strides, Plan};
use crate::view::{check_disjoint, check_len, Tensor, TensorMut};
use attnkit_kernels::{probs_and_ds, tile_gemm, Dtype, Elem, ScoreSpec};
use std::cell::RefCell;
use std::sync::Mutex;

/// Query rows and keys per tile. 128 and 64 measured level on the unpacked tile products
/// (`examples/backward_bench.rs`, two builds alternated); 128 halves the per-tile bookkeeping and
/// the number of Kᵀ/Vᵀ blocks.
const BLOCK: usize = 128;

/// Query rows per part of a tile that the causal diagonal cuts ([`Bwd::parts`]). 32 measured
/// level with 64 (`examples/backward_bench`, two builds alternated, causal rows).
const SUB: usize = 64;

/// The parts of one tile ([`Bwd::parts`]).
struct Parts {
    list: [(usize, usize, usize); BLOCK / SUB],
    len: usize,
}

impl Parts {
    fn iter(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.list[..self.len].iter().copied()
    }
}

/// Whether one task per (batch, KV head) pair computes all three gradients in one pass (5 tile
/// products per tile), or keys are split across tasks too and dQ takes a second pass (7). Both
/// ways add the same tiles in the same order, so they agree bit for bit and the choice may follow
/// the thread count. One pass wins unless it leaves threads idle: its span, `⌈pairs/threads⌉`
/// pair-units of 5 products, against two passes spread evenly, `pairs/threads` units of 7.
fn one_pass_wins(pairs: usize, threads: usize) -> bool {
    5 * threads * pairs.div_ceil(threads) <= 7 * pairs
}

/// What the forward pass leaves for the backward: its inputs, its output `out (B, Hq, Lq, Dv)`
/// and the natural-log logsumexp of every row, `lse (B, Hq, Lq)` dense (from
/// [`crate::sdpa_ext`] or [`crate::sdpa_ext_vec`]).
///
/// `E` is the element type of Q, K, V and the output (`f32`, [`crate::bf16`] or
/// [`struct@crate::f16`]); the backward's `dout` has it too. The gradients are f32 whatever `E` is.
#[derive(Clone, Copy, Debug)]
pub struct Saved<'a, E = f32> {
    /// Queries `(B, Hq, Lq, D)`.
    pub q: Tensor<'a, E>,
    /// Keys `(B, Hkv, Lk, D)`.
    pub k: Tensor<'a, E>,
    /// Values `(B, Hkv, Lk, Dv)`.
    pub v: Tensor<'a, E>,
    /// The forward's output (rounded to `E` if the forward wrote `E`).
    pub out: Tensor<'a, E>,
    /// The forward's logsumexp.
    pub lse: &'a [f32],
}

/// The gradients [`sdpa_backward_vec`] returns, dense `(B, H, L, ·)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gradients {
    /// Of the sink logits, one per query head, when the options have sinks
    /// ([`sinks_gradient`]).
    pub dsinks: Option<Vec<f32>>,
    /// `(B, Hq, Lq, D)`.
    pub dq: Vec<f32>,
    /// `(B, Hkv, Lk, D)`, summed over each KV head's query heads.
    pub dk: Vec<f32>,
    /// `(B, Hkv, Lk, Dv)`, likewise.
    pub dv: Vec<f32>,
}

/// The gradients of [`crate::sdpa`]'s output with respect to Q, K and V, given the upstream
/// gradient `dout (B, Hq, Lq, Dv)`, written into `dq`, `dk` and `dv` (shaped as Q, K and V; any
/// strides, rows disjoint). `opts` must be the forward's: scale, causal alignment, window, key
/// lengths, bool mask, bias, ALiBi, softcap and sinks all enter the recomputed scores (the
/// softcap through its derivative). GQA: dK and dV of a KV head are summed over its query heads.
///
/// The sink logits' gradient is [`sinks_gradient`], the float mask's (a learned bias)
/// [`bias_gradient`].
/// bf16 and f16 inputs are widened to f32 once (exactly), into dense copies of Q, K, V, O and
/// dO; every product and the gradients are then f32, as for f32 inputs. The copies' buffer is
/// kept by the calling thread for its next call (the largest so far: five times the inputs in
/// f32), as the forward keeps its scratch; a fresh one cost the bf16 backward 17 % at
/// (1, 16, 1024, 64), reused it costs 4 %.
///
/// # Errors
/// As [`crate::sdpa`] for `q`, `k`, `v` and the options; [`AttnError::ShapeMismatch`] when
/// `out`, `dout`, `dq`, `dk` or `dv` does not have its input's shape, [`AttnError::BufferLength`]
/// for `lse`, [`AttnError::BadParam`] for an `lse` entry that is NaN or +inf, or −inf on a row
/// that sees a key (a fully masked row's is −inf, and its gradients are zero); overlapping rows
/// of a gradient ([`AttnError::BadStride`]); [`AttnError::Alloc`] when the per-task scratch or
/// the widened copies of 16-bit inputs cannot be allocated (the gradients are then
/// unspecified).
pub fn sdpa_backward<E: Elem>(
    saved: &Saved<E>,
    dout: &Tensor<E>,
    dq: &mut TensorMut,
    dk: &mut TensorMut,
    dv: &mut TensorMut,
    opts: &SdpaOptions,
) -> Result<()> {
    on_f32(saved, dout, opts, |s, d| {
        backward_f32(s, d, dq, dk, dv, opts)
    })
}

fn backward_f32(
    saved: &Saved,
    dout: &Tensor,
    dq: &mut TensorMut,
    dk: &mut TensorMut,
    dv: &mut TensorMut,
    opts: &SdpaOptions,
) -> Result<()> {
    let plan = validate_saved(saved, dout, opts)?;
    let s = plan.shape;
    let Saved { q, k, v, .. } = saved;
    same_shape("dq", q.shape, dq.shape)?;
    same_shape("dk", k.shape, dk.shape)?;
    same_shape("dv", v.shape, dv.shape)?;
    for (arg, g) in [("dq", &*dq), ("dk", &*dk), ("dv", &*dv)] {
        check_len(arg, g.data.len(), g.shape, g.strides)?;
        check_disjoint(arg, g.shape, g.strides)?;
    }
    let b = Bwd::new(&plan, saved, dout)?;
    let failed = Mutex::new(None);
    let fail = |e: AttnError| {
        let mut f = failed.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert(e);
    };
    let delta = b.deltas(opts.par)?;
    let heads = s.b * s.hq;

    let kblocks = s.lk.div_ceil(BLOCK);
    let dq_p = (
        SendPtr(dq.data.as_mut_ptr()),
        used_strides(s.d, dq.shape, dq.strides),
    );
    let dk_p = (
        SendPtr(dk.data.as_mut_ptr()),
        used_strides(s.d, dk.shape, dk.strides),
    );
    let dv_p = (
        SendPtr(dv.data.as_mut_ptr()),
        used_strides(s.dv, dv.shape, dv.strides),
    );
    let work = plan.work().saturating_mul(2);
    if one_pass_wins(s.b * s.hkv, threads(opts.par, work)) {
        // Enough (batch, KV head) pairs to keep the threads busy: one task per pair owns the dK
        // and dV of its keys and the dQ of its query heads, and computes every tile once.
        run_tasks(opts.par, s.b * s.hkv, work, |t| {
            // SAFETY: the task writes the rows of KV head `t % Hkv` of batch `t / Hkv` in dk and
            // dv and the rows of its query heads in dq, disjoint from every other task's.
            let r = unsafe { b.one_pass(t / s.hkv, t % s.hkv, &delta, dq_p, dk_p, dv_p) };
            if let Err(e) = r {
                fail(e);
            }
        });
        return match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        };
    }
    // Few pairs (one long sequence): split the keys too. dK, dV: one task per (batch, KV head,
    // key block); then dQ: one task per (batch, query head, query block), recomputing the tiles.
    run_tasks(opts.par, s.b * s.hkv * kblocks, work, |t| {
        let (bh, kb) = (t / kblocks, t % kblocks);
        let r = Scratch::new(b.dp, b.dvp).map(|mut sc| {
            // SAFETY: the task writes key rows of block `kb` of KV head `bh % Hkv` of batch
            // `bh / Hkv` in dk and dv, disjoint from every other task's (checked disjoint views).
            unsafe {
                b.dk_dv(
                    bh / s.hkv,
                    bh % s.hkv,
                    kb,
                    &delta,
                    dk_p,
                    dv_p,
                    None,
                    &mut sc,
                )
            }
        });
        if let Err(e) = r {
            fail(e);
        }
    });

    let qblocks = s.lq.div_ceil(BLOCK);
    run_tasks(opts.par, heads * qblocks, work, |t| {
        let (bh, qb) = (t / qblocks, t % qblocks);
        // SAFETY: the task writes the rows of query block `qb` of head `bh % Hq` of batch
        // `bh / Hq` in dq only.
        let r = unsafe { b.dq(bh / s.hq, bh % s.hq, qb, &delta, dq_p) };
        if let Err(e) = r {
            fail(e);
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A call's inputs as f32 views: the caller's own views when `E` is f32, else dense f32 copies
/// `(B, H, L, ·)` of Q, K, V, O and dO, validated first (the values widen exactly, so the
/// gradients are those of the same values given in f32).
enum Wide<'a> {
    Same(Saved<'a>, Tensor<'a>),
    Copied {
        /// The five copies back to back, from [`WIDE`].
        buf: Vec<f32>,
        shapes: [[usize; 4]; 5],
        lse: &'a [f32],
    },
}

thread_local! {
    /// The buffer of a 16-bit call's widened copies, kept for this thread's next call: a fresh
    /// allocation's first touch made the bf16 backward 17 % (1 thread) and 28 % (2 threads)
    /// slower than the f32 one at (1, 16, 1024, 64); reused, it is the conversion alone.
    static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl<'a> Wide<'a> {
    fn new<E: Elem>(
        saved: &Saved<'a, E>,
        dout: &Tensor<'a, E>,
        opts: &SdpaOptions,
    ) -> Result<Self> {
        if E::DTYPE == Dtype::F32 {
            let same = |t: &Tensor<'a, E>| Tensor {
                // SAFETY: `Stored` is sealed and f32 is its only type with `DTYPE == F32`, so
                // `E` is f32 here: the same slice, reinterpreted as its own type.
                data: unsafe {
                    core::slice::from_raw_parts(t.data.as_ptr().cast::<f32>(), t.data.len())
                },
                shape: t.shape,
                strides: t.strides,
            };
            let s = Saved {
                q: same(&saved.q),
                k: same(&saved.k),
                v: same(&saved.v),
                out: same(&saved.out),
                lse: saved.lse,
            };
            return Ok(Wide::Same(s, same(dout)));
        }
        validate_saved(saved, dout, opts)?;
        let Saved { q, k, v, out, lse } = saved;
        let args = [("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)];
        let mut total = 0usize;
        for (arg, t) in args {
            total = total
                .checked_add(checked_len(arg, &t.shape)?)
                .ok_or(AttnError::Overflow { arg })?;
        }
        let mut buf = WIDE.with(|w| core::mem::take(&mut *w.borrow_mut()));
        if buf.len() < total {
            // Free the old one first, so the peak is the new size only.
            drop(buf);
            buf = try_zeros("saved", total)?;
        }
        let mut rest = &mut buf[..];
        for (arg, t) in args {
            let (part, tail) = rest.split_at_mut(checked_len(arg, &t.shape)?);
            widen(t, part);
            rest = tail;
        }
        Ok(Wide::Copied {
            buf,
            shapes: args.map(|(_, t)| t.shape),
            lse,
        })
    }

    fn views(&self) -> (Saved<'_>, Tensor<'_>) {
        match self {
            Wide::Same(s, d) => (*s, *d),
            Wide::Copied { buf, shapes, lse } => {
                let len = |s: &[usize; 4]| s.iter().product::<usize>();
                let t = |i: usize| {
                    let start: usize = shapes[..i].iter().map(len).sum();
                    Tensor::bhld(&buf[start..start + len(&shapes[i])], shapes[i])
                };
                let s = Saved {
                    q: t(0),
                    k: t(1),
                    v: t(2),
                    out: t(3),
                    lse,
                };
                (s, t(4))
            }
        }
    }

    /// Returns a copies' buffer to [`WIDE`] for the thread's next call (the larger one stays).
    fn recycle(self) {
        if let Wide::Copied { buf, .. } = self {
            WIDE.with(|w| {
                let mut w = w.borrow_mut();
                if buf.len() > w.len() {
                    *w = buf;
                }
            });
        }
    }
}

/// Runs `f` on the call's inputs as f32 views ([`Wide`]).
fn on_f32<E: Elem, R>(
    saved: &Saved<E>,
    dout: &Tensor<E>,
    opts: &SdpaOptions,
    f: impl FnOnce(&Saved, &Tensor) -> Result<R>,
) -> Result<R> {
    let wide = Wide::new(saved, dout, opts)?;
    let (saved, dout) = wide.views();
    let r = f(&saved, &dout);
    wide.recycle();
    r
}

/// `dst` = the validated view `t` widened to f32, dense `(B, H, L, W)` (`check_len` has
/// bounded every offset; `dst` holds exactly its elements). One task per head measured level
/// with this loop on 2 threads.
fn widen<E: Elem>(t: &Tensor<E>, dst: &mut [f32]) {
    let [_, h, l, w] = t.shape;
    if w == 0 {
        return;
    }
    let [sb, sh, sl] = t.strides;
    for (r, row) in dst.chunks_exact_mut(w).enumerate() {
        let (bi, hi, li) = (r / (h * l), r / l % h, r % l);
        let src = &t.data[bi * sb + hi * sh + li * sl..][..w];
        for (d, x) in row.iter_mut().zip(src) {
            *d = x.to_f32();
        }
    }
}

/// `got` must be `want`, else the first differing dimension is named.
fn same_shape(arg: &'static str, want: [usize; 4], got: [usize; 4]) -> Result<()> {
    const DIMS: [&str; 4] = ["B", "H", "L", "D"];
    match (0..4).find(|&i| want[i] != got[i]) {
        Some(i) => Err(AttnError::ShapeMismatch {
            arg,
            dim: DIMS[i],
            expected: want[i],
            got: got[i],
        }),
        None => Ok(()),
    }
}

/// Validates what every backward entry point reads: the forward's inputs and options, `out`,
/// `dout` and `lse`.
fn validate_saved<E: Elem>(
    saved: &Saved<E>,
    dout: &Tensor<E>,
    opts: &SdpaOptions,
) -> Result<Plan<E, E, E>> {
    let Saved { q, k, v, out, lse } = saved;
    let plan = Plan::<E, E, E>::validate(q, k, v, out.shape, opts, &mut Extras::default())?;
    let s = plan.shape;
    let o_shape = [s.b, s.hq, s.lq, s.dv];
    same_shape("out", o_shape, out.shape)?;
    same_shape("dout", o_shape, dout.shape)?;
    check_len("out", out.data.len(), out.shape, out.strides)?;
    check_len("dout", dout.data.len(), dout.shape, dout.strides)?;
    let rows = checked_len("lse", &[s.b, s.hq, s.lq])?;
    if lse.len() != rows {
        return Err(AttnError::BufferLength {
            arg: "lse",
            needed: rows,
            got: lse.len(),
        });
    }
    // A fully masked row's lse is −inf (its gradients are zero); NaN or +inf is no forward's.
    if lse.iter().any(|l| l.is_nan() || *l == f32::INFINITY) {
        return Err(AttnError::BadParam {
            arg: "lse",
            reason: "must be finite, or -inf for a fully masked row",
        });
    }
    // −inf on a row that sees a key would silently give it zero gradients (a forward gives
    // one only when every logit overflows to −inf: its gradients do not exist either).
    for (t, _) in lse
        .iter()
        .enumerate()
        .filter(|(_, l)| **l == f32::NEG_INFINITY)
    {
        let (b, h, i) = (t / (s.hq * s.lq), t / s.lq % s.hq, t % s.lq);
        if sees_a_key(&plan.spec(b, h, i)) {
            return Err(AttnError::BadParam {
                arg: "lse",
                reason: "is -inf for a row that sees a key (only a fully masked row's is)",
            });
        }
    }
    // K and V of a batch of one serve every query batch: their gradients would then be sums
    // over batches, which the per-batch tasks do not form. (A zero B stride over B batches is
    // fine: dK and dV have their own rows per batch, for the caller to sum.)
    for (arg, x, width) in [("k", &saved.k, s.d), ("v", &saved.v, s.dv)] {
        if x.shape[0] == 1 && s.b > 1 && width > 0 && s.lk > 0 {
            return Err(AttnError::BadParam {
                arg,
                reason: "the backward pass needs K and V of every batch (no batch of one)",
            });
        }
    }
    Ok(plan)
}

/// The gradient of the additive mask ([`SdpaOptions::bias`], a learned bias such as T5's
/// relative positions), dense in the bias's own broadcast shape `(mb, mh, mq, Lk)`: `dS` before
/// the scale (the bias is added after it, and after the softcap), summed over the dimensions the
/// bias broadcasts over, in a fixed order (bitwise independent of the thread count). Masked and
/// padded keys get 0. It recomputes the score tiles, so it costs about a forward pass.
///
/// # Errors
/// As [`sdpa_backward`] (no gradient buffers); [`AttnError::BadParam`] if `opts` has no bias.
pub fn bias_gradient<E: Elem>(
    saved: &Saved<E>,
    dout: &Tensor<E>,
    opts: &SdpaOptions,
) -> Result<Vec<f32>> {
    on_f32(saved, dout, opts, |s, d| bias_gradient_f32(s, d, opts))
}

fn bias_gradient_f32(saved: &Saved, dout: &Tensor, opts: &SdpaOptions) -> Result<Vec<f32>> {
    let Some(bias) = opts.bias else {
        return Err(AttnError::BadParam {
            arg: "bias",
            reason: "the options have no bias",
        });
    };
    let plan = validate_saved(saved, dout, opts)?;
    let s = plan.shape;
    let [mb, mh, mq, _] = bias.shape;
    let mut grad = try_zeros::<f32>("dbias", checked_len("dbias", &bias.shape)?)?;
    let b = Bwd::new(&plan, saved, dout)?;
    let delta = b.deltas(opts.par)?;
    let qblocks = s.lq.div_ceil(BLOCK);
    // One task per (bias batch, bias head, query block) — all query blocks when the bias has
    // one row — owning those rows of the gradient.
    let per = if mq == 1 { 1 } else { qblocks };
    let gp = SendPtr(grad.as_mut_ptr());
    let failed = Mutex::new(None);
    run_tasks(opts.par, mb * mh * per, plan.work(), |t| {
        let (ib, ih, qb) = (t / (mh * per), t / per % mh, t % per);
        // SAFETY: the task writes rows of bias batch `ib`, head `ih`, query block `qb` (or the
        // single row) of `grad`, which no other task writes.
        let r = unsafe { b.dbias(ib, ih, qb, [mb, mh, mq], &delta, gp) };
        if let Err(e) = r {
            failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(grad),
    }
}

/// [`sdpa_backward`] returning new dense gradients.
///
/// # Errors
/// As [`sdpa_backward`].
pub fn sdpa_backward_vec<E: Elem>(
    saved: &Saved<E>,
    dout: &Tensor<E>,
    opts: &SdpaOptions,
) -> Result<Gradients> {
    on_f32(saved, dout, opts, |saved, dout| {
        let (q, k, v) = (saved.q.shape, saved.k.shape, saved.v.shape);
        let mut g = Gradients {
            dsinks: None,
            dq: try_zeros("dq", checked_len("dq", &q)?)?,
            dk: try_zeros("dk", checked_len("dk", &k)?)?,
            dv: try_zeros("dv", checked_len("dv", &v)?)?,
        };
        backward_f32(
            saved,
            dout,
            &mut TensorMut::bhld(&mut g.dq, q),
            &mut TensorMut::bhld(&mut g.dk, k),
            &mut TensorMut::bhld(&mut g.dv, v),
            opts,
        )?;
        if opts.sinks.is_some() {
            g.dsinks = Some(sinks_gradient_f32(saved, dout, opts)?);
        }
        Ok(g)
    })
}

/// The gradient of the attention-sink logits ([`SdpaOptions::sinks`]), one per query head: a
/// sink only enlarges its rows' softmax denominators, so
/// `∂L/∂sink_h = −Σ_{b,i} exp(sink_h − lse_{b,h,i}) · rowsum(dO ∘ O)_{b,h,i}` over the rows with
/// a finite logsumexp, summed in a fixed order. A head whose sink is `-inf` gets 0.
///
/// # Errors
/// As [`sdpa_backward`] (no gradient buffers); [`AttnError::BadParam`] if `opts` has no sinks.
pub fn sinks_gradient<E: Elem>(
    saved: &Saved<E>,
    dout: &Tensor<E>,
    opts: &SdpaOptions,
) -> Result<Vec<f32>> {
    on_f32(saved, dout, opts, |s, d| sinks_gradient_f32(s, d, opts))
}

fn sinks_gradient_f32(saved: &Saved, dout: &Tensor, opts: &SdpaOptions) -> Result<Vec<f32>> {
    let Some(sinks) = opts.sinks else {
        return Err(AttnError::BadParam {
            arg: "sinks",
            reason: "the options have no sinks",
        });
    };
    let plan = validate_saved(saved, dout, opts)?;
    let s = plan.shape;
    let Saved { out, lse, .. } = saved;
    let (os, gs) = (
        used_strides(s.dv, out.shape, out.strides),
        used_strides(s.dv, dout.shape, dout.strides),
    );
    let mut grad = vec![0.0f32; s.hq];
    for (h, g) in grad.iter_mut().enumerate() {
        let sink = sinks[h];
        if sink == f32::NEG_INFINITY {
            continue;
        }
        let mut acc = 0.0f64;
        for b in 0..s.b {
            for i in 0..s.lq {
                let l = lse[(b * s.hq + h) * s.lq + i];
                if !l.is_finite() {
                    continue;
                }
                let (o, d) = (
                    &out.data[off(os, b, h, i)..],
                    &dout.data[off(gs, b, h, i)..],
                );
                let delta: f32 = (0..s.dv).map(|c| o[c] * d[c]).sum();
                acc += f64::from((sink - l).exp() * delta);
            }
        }
        *g = -acc as f32;
    }
    Ok(grad)
}

/// A task's scratch: the probabilities and dP/dS tiles (`BLOCK²` each, row stride `BLOCK`), the
/// dK and dV accumulators (`BLOCK × Dp`, `BLOCK × Dvp`: widths rounded up to whole vectors, as
/// the micro-kernel writes them), one `BLOCK × Dp` product of `dS·K`, and the Kᵀ and Vᵀ of the
/// key block at hand (`D × BLOCK`, `Dv × BLOCK`: [`Bwd::pack_block`]).
struct Scratch {
    buf: Vec<f32>,
    dp: usize,
    dvp: usize,
}

impl Scratch {
    fn len(dp: usize, dvp: usize) -> usize {
        (2 * BLOCK * BLOCK)
            .saturating_add(BLOCK.saturating_mul(dp).saturating_mul(3))
            .saturating_add(BLOCK.saturating_mul(dvp).saturating_mul(2))
    }
    fn new(dp: usize, dvp: usize) -> Result<Self> {
        Ok(Scratch {
            buf: try_zeros("scratch", Self::len(dp, dvp))?,
            dp,
            dvp,
        })
    }
    /// The scratch's parts.
    fn parts(&mut self) -> Tiles<'_> {
        let (p, rest) = self.buf.split_at_mut(BLOCK * BLOCK);
        let (ds, rest) = rest.split_at_mut(BLOCK * BLOCK);
        let (acc_k, rest) = rest.split_at_mut(BLOCK * self.dp);
        let (acc_v, rest) = rest.split_at_mut(BLOCK * self.dvp);
        let (dsk, rest) = rest.split_at_mut(BLOCK * self.dp);
        let (kt, vt) = rest.split_at_mut(BLOCK * self.dp);
        Tiles {
            p,
            ds,
            acc_k,
            acc_v,
            dsk,
            kv: KvBlock { kt, vt },
        }
    }
}

/// [`Scratch`] split: `P`, `dS` (row stride `BLOCK`), the dK and dV accumulators, `dS·K`, the
/// packed key block.
struct Tiles<'a> {
    p: &'a mut [f32],
    ds: &'a mut [f32],
    acc_k: &'a mut [f32],
    acc_v: &'a mut [f32],
    dsk: &'a mut [f32],
    kv: KvBlock<'a>,
}

/// Kᵀ and Vᵀ of one key block, the B operands of `S = Q·Kᵀ` and `dP = dO·Vᵀ` in the layout the
/// micro-kernel reads ([`tile_gemm`]: row-major, whole vectors wide): `D` rows of `BLOCK`
/// (`Dv` for Vᵀ), zero past the block's keys. Each task packs the block it works on into its
/// scratch, where it stays in cache; a packed copy of all of K and V cost the call a fresh
/// allocation of their size, whose first touch and transposes took a tenth of a 2-thread
/// backward.
struct KvBlock<'a> {
    kt: &'a mut [f32],
    vt: &'a mut [f32],
}

/// The tile products' B operands that the micro-kernel cannot read in place ([`tile_gemm`]:
/// whole vectors wide): lane-padded copies of K, Q and dO where `D` or `Dv` is not a multiple of
/// the vector width (else they are read in place).
struct Packed {
    /// `(B, Hkv, Lk, Dp)`, `(B, Hq, Lq, Dp)`, `(B, Hq, Lq, Dvp)` when padding is needed.
    k: Option<Vec<f32>>,
    q: Option<Vec<f32>>,
    d_o: Option<Vec<f32>>,
}

/// The validated call, shared by the tasks.
struct Bwd<'p> {
    plan: &'p Plan,
    /// `out` and `dout`: base pointer and (B, H, L) strides.
    o: (*const f32, [usize; 3]),
    d_o: (*const f32, [usize; 3]),
    lse: *const f32,
    packed: Packed,
    /// `D` and `Dv` rounded up to the ISA's vector width.
    dp: usize,
    dvp: usize,
}

// SAFETY: the pointers come from borrows that outlive the call; inputs are only read, and each
// task writes only the output rows it owns (argued at each task).
unsafe impl Sync for Bwd<'_> {}

/// `(first row, rows)` of block `blk` of `len`.
fn block(blk: usize, len: usize) -> (usize, usize) {
    let r0 = blk * BLOCK;
    (r0, BLOCK.min(len - r0))
}

impl<'p> Bwd<'p> {
    /// The shared state of a validated call (one task's scratch tried first), with the packed
    /// operands.
    fn new(plan: &'p Plan, saved: &Saved, dout: &Tensor) -> Result<Self> {
        let s = plan.shape;
        let w = plan.isa.lanes();
        let (dp, dvp) = (s.d.div_ceil(w) * w, s.dv.div_ceil(w) * w);
        drop(try_zeros::<f32>("scratch", Scratch::len(dp, dvp))?);
        let out = &saved.out;
        let mut b = Bwd {
            plan,
            o: (
                out.data.as_ptr(),
                used_strides(s.dv, out.shape, out.strides),
            ),
            d_o: (
                dout.data.as_ptr(),
                used_strides(s.dv, dout.shape, dout.strides),
            ),
            lse: saved.lse.as_ptr(),
            packed: Packed {
                k: None,
                q: None,
                d_o: None,
            },
            dp,
            dvp,
        };
        b.packed = b.pack()?;
        Ok(b)
    }

    /// Builds [`Packed`] from the validated views.
    fn pack(&self) -> Result<Packed> {
        let pl = self.plan;
        let s = pl.shape;
        // A lane-padded dense copy of the `(B, H, L, width)` rows of a view at `base`, strides
        // `st`.
        let padded = |arg: &'static str,
                      [h, l, width, wp]: [usize; 4],
                      (base, st): (*const f32, [usize; 3])|
         -> Result<Option<Vec<f32>>> {
            if width == wp {
                return Ok(None);
            }
            let mut buf = try_zeros::<f32>(arg, checked_len(arg, &[s.b, h, l, wp])?)?;
            for (r, dst) in buf.chunks_exact_mut(wp.max(1)).enumerate() {
                let (b, hh, i) = (r / (h * l), r / l % h, r % l);
                // SAFETY: row `i` of head `hh` of batch `b` of a validated view of this shape:
                // `width` contiguous values.
                let src =
                    unsafe { core::slice::from_raw_parts(base.add(off(st, b, hh, i)), width) };
                dst[..width].copy_from_slice(src);
            }
            Ok(Some(buf))
        };
        Ok(Packed {
            k: padded("k", [s.hkv, s.lk, s.d, self.dp], (pl.k, pl.ks))?,
            q: padded("q", [s.hq, s.lq, s.d, self.dp], (pl.q, pl.qs))?,
            d_o: padded("dout", [s.hq, s.lq, s.dv, self.dvp], self.d_o)?,
        })
    }

    /// Row `i` of query head `h` of batch `b` of Q (`dout`: of dO) as a B operand: pointer and
    /// row stride, lane-padded.
    ///
    /// # Safety
    /// Indices in range.
    unsafe fn rows_q(&self, b: usize, h: usize, i: usize, dout: bool) -> (*const f32, usize) {
        let (pl, s) = (self.plan, &self.plan.shape);
        let (padded, wp) = if dout {
            (&self.packed.d_o, self.dvp)
        } else {
            (&self.packed.q, self.dp)
        };
        // SAFETY: indices in range of the padded copy or the validated view.
        unsafe {
            match padded {
                Some(buf) => (buf.as_ptr().add(((b * s.hq + h) * s.lq + i) * wp), wp),
                None if dout => (self.d_o.0.add(off(self.d_o.1, b, h, i)), self.d_o.1[2]),
                None => (pl.q.add(off(pl.qs, b, h, i)), pl.qs[2]),
            }
        }
    }

    /// Row `j` of KV head `hk` of batch `b` of K as a B operand, lane-padded.
    ///
    /// # Safety
    /// Indices in range.
    unsafe fn rows_k(&self, b: usize, hk: usize, j: usize) -> (*const f32, usize) {
        let (pl, s) = (self.plan, &self.plan.shape);
        // SAFETY: indices in range of the padded copy or the validated view.
        unsafe {
            match &self.packed.k {
                Some(buf) => (
                    buf.as_ptr().add(((b * s.hkv + hk) * s.lk + j) * self.dp),
                    self.dp,
                ),
                None => (pl.k.add(off(pl.ks, b, hk, j)), pl.ks[2]),
            }
        }
    }

    /// `D = rowsum(dO ∘ O)` of every row, dense `(B, Hq, Lq)`.
    fn deltas(&self, par: crate::options::Par) -> Result<Vec<f32>> {
        let s = self.plan.shape;
        let rows = checked_len("lse", &[s.b, s.hq, s.lq])?;
        let mut delta = try_zeros::<f32>("delta", rows)?;
        let dp = SendPtr(delta.as_mut_ptr());
        run_tasks(par, s.b * s.hq, rows.saturating_mul(s.dv), |t| {
            // SAFETY: task `t` writes rows `t·Lq..(t+1)·Lq` of `delta` only.
            unsafe { self.delta(t / s.hq, t % s.hq, dp.get().add(t * s.lq)) };
        });
        Ok(delta)
    }

    /// The bias gradient rows of bias batch `ib`, head `ih` and query block `qb` (all query
    /// rows summed when the bias has one row, `bs[2] == 1`), into dense `grad` of shape
    /// `(bs[0], bs[1], bs[2], Lk)`.
    ///
    /// # Safety
    /// The caller owns those rows of `grad`.
    unsafe fn dbias(
        &self,
        ib: usize,
        ih: usize,
        qb: usize,
        bs: [usize; 3],
        delta: &[f32],
        grad: SendPtr,
    ) -> Result<()> {
        let pl = self.plan;
        let s = &pl.shape;
        let mut sc = Scratch::new(self.dp, self.dvp)?;
        let Tiles { p, ds, mut kv, .. } = sc.parts();
        let mut packed = None;
        let batches = if bs[0] == 1 { 0..s.b } else { ib..ib + 1 };
        let heads = if bs[1] == 1 { 0..s.hq } else { ih..ih + 1 };
        let qblocks = if bs[2] == 1 {
            0..s.lq.div_ceil(BLOCK)
        } else {
            qb..qb + 1
        };
        let group = s.hq / s.hkv.max(1);
        for b in batches {
            for h in heads.clone() {
                for qb in qblocks.clone() {
                    let (i0, m) = block(qb, s.lq);
                    let spec = pl.spec(b, h, i0);
                    for kb in 0..s.lk.div_ceil(BLOCK) {
                        let (j0, n) = block(kb, s.lk);
                        if !self.touches(&spec, m, j0, n) {
                            continue;
                        }
                        let hk = h / group;
                        if packed != Some((b, hk, kb)) {
                            self.pack_block(b, hk, kb, &mut kv);
                            packed = Some((b, hk, kb));
                        }
                        // SAFETY: indices in range; the tiles hold BLOCK² ≥ m·n values. `raw`: the
                        // bias is added after the softcap, so its gradient is dS by the logit.
                        unsafe { self.tile(b, h, (i0, m), (j0, n), &kv, delta, p, ds, true) };
                        for r in 0..m {
                            let row = if bs[2] == 1 { 0 } else { i0 + r };
                            let at = ((ib * bs[1] + ih) * bs[2] + row) * s.lk + j0;
                            for c in 0..n {
                                // SAFETY: row `row` of this task's (batch, head), key `j0 + c`.
                                unsafe { *grad.get().add(at + c) += ds[r * BLOCK + c] };
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `delta[i] = Σ_c dO[i, c]·O[i, c]` for the rows of head `h` of batch `b`.
    ///
    /// # Safety
    /// `delta` writable for `Lq` values; `b`, `h` in range.
    unsafe fn delta(&self, b: usize, h: usize, delta: *mut f32) {
        let s = &self.plan.shape;
        for i in 0..s.lq {
            // SAFETY: rows of validated views; `i < Lq`.
            unsafe {
                let o = self.o.0.add(off(self.o.1, b, h, i));
                let g = self.d_o.0.add(off(self.d_o.1, b, h, i));
                let mut acc = 0.0f32;
                for c in 0..s.dv {
                    acc += *o.add(c) * *g.add(c);
                }
                *delta.add(i) = acc;
            }
        }
    }

    /// Packs key block `kb` of KV head `hk` of batch `b` into `kv`.
    fn pack_block(&self, b: usize, hk: usize, kb: usize, kv: &mut KvBlock) {
        let pl = self.plan;
        let s = &pl.shape;
        let (j0, n) = block(kb, s.lk);
        // SAFETY: rows `j0..j0+n` of KV head `hk` of batch `b` of the validated K and V views
        // (D and Dv contiguous values, rows `ks[2]`, `vs[2]` apart); `kv` holds `D·BLOCK` and
        // `Dv·BLOCK` values (Dp, Dvp ≥ D, Dv).
        unsafe {
            transpose_block(pl.k.add(off(pl.ks, b, hk, j0)), pl.ks[2], n, s.d, kv.kt);
            transpose_block(pl.v.add(off(pl.vs, b, hk, j0)), pl.vs[2], n, s.dv, kv.vt);
        }
    }

    /// Whether some row of query block `(i0, m)` may see a key of block `(j0, n)` (a cheap test
    /// on the first and last rows: visible ranges only move right with the row).
    fn touches(&self, spec: &ScoreSpec, m: usize, j0: usize, n: usize) -> bool {
        let (lo, _) = spec.visible_range(0);
        let (_, hi) = spec.visible_range(m - 1);
        lo < j0 + n && hi > j0 && lo < hi
    }

    /// The parts of tile (query block `(i0, m)` under `spec`, key block `(j0, n)`) that its rows
    /// see, as `(first row, rows, keys from j0)`: the whole tile, or, where the first row's
    /// visible keys end inside the block (the causal diagonal, a key length), its rows in
    /// sub-blocks of [`SUB`], each up to its last row's visible end. The keys left out are
    /// hidden from every row of the part, so their weights and `dS` are zeros: the products
    /// skip them (a quarter of each diagonal tile). The split depends on the tile alone, so the
    /// one-pass and two-pass orders still add the same terms in the same order.
    fn parts(&self, spec: &ScoreSpec, m: usize, j0: usize, n: usize) -> Parts {
        let mut parts = Parts {
            list: [(0, m, n); BLOCK / SUB],
            len: 1,
        };
        if spec.visible_range(0).1 >= j0 + n {
            return parts;
        }
        parts.len = 0;
        for a in (0..m).step_by(SUB) {
            let rows = SUB.min(m - a);
            let keys = spec.visible_range(a + rows - 1).1.saturating_sub(j0).min(n);
            if keys > 0 {
                parts.list[parts.len] = (a, rows, keys);
                parts.len += 1;
            }
        }
        parts
    }

    /// Scores of query rows `i0..i0+m` of head `h` of batch `b` against keys `j0..j0+n` (their
    /// block packed in `kv`), turned into probabilities `P` in `p` and `dS = P ∘ (dP − D)` (times
    /// the softcap's derivative, unless `raw`: then `dS` by the logit, what the bias gets) in
    /// `ds`; both with row stride `BLOCK`, the columns past `n` unspecified.
    ///
    /// # Safety
    /// Indices in range; `p` and `ds` hold `BLOCK²` values.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile(
        &self,
        b: usize,
        h: usize,
        (i0, m): (usize, usize),
        (j0, n): (usize, usize),
        kv: &KvBlock,
        delta: &[f32],
        p: &mut [f32],
        ds: &mut [f32],
        raw: bool,
    ) {
        let pl = self.plan;
        let s = &pl.shape;
        let spec = pl.spec(b, h, i0);
        let w = pl.isa.lanes();
        // SAFETY: (both products) Q and dO rows `i0..i0+m` of validated views (A, by broadcast),
        // the packed Kᵀ and Vᵀ of this key block (B: D or Dv rows of BLOCK ≥ n rounded up to
        // the width), and the tiles (C: m rows of BLOCK).
        unsafe {
            let q = pl.q.add(off(pl.qs, b, h, i0));
            let dout = self.d_o.0.add(off(self.d_o.1, b, h, i0));
            let (kt, vt) = (kv.kt.as_ptr(), kv.vt.as_ptr());
            let nvec = n.div_ceil(w);
            // S = Q·Kᵀ (scaled below, row by row), dP = dO·Vᵀ.
            tile_gemm(
                pl.isa,
                m,
                nvec,
                s.d,
                q,
                pl.qs[2],
                1,
                kt,
                BLOCK,
                p.as_mut_ptr(),
                BLOCK,
                false,
            );
            let ldo = self.d_o.1[2];
            tile_gemm(
                pl.isa,
                m,
                nvec,
                s.dv,
                dout,
                ldo,
                1,
                vt,
                BLOCK,
                ds.as_mut_ptr(),
                BLOCK,
                false,
            );
        }
        let row_base = (b * s.hq + h) * s.lq + i0;
        // In the ISA's vectors: the forward's own score rule, then `p = 2^((x − lse)·log2 e)` and
        // `dS` (with the softcap's derivative unless `raw`).
        for r in 0..m {
            // SAFETY: `row_base + r` is a row of the dense `(B, Hq, Lq)` lse.
            let l = unsafe { *self.lse.add(row_base + r) };
            let dr = delta[row_base + r];
            let row = r * BLOCK..r * BLOCK + n;
            let (pr, dsr) = (&mut p[row.clone()], &mut ds[row]);
            if l == f32::NEG_INFINITY {
                pr.fill(0.0);
                dsr.fill(0.0);
                continue;
            }
            // SAFETY: the spec's mask and bias rows are readable for keys `< j0 + n ≤ Lk`
            // (validated views); the plan's ISA is supported.
            unsafe { probs_and_ds(pl.isa, &spec, r, j0, (pl.scale, l, dr), pr, dsr, !raw) };
        }
    }

    /// `dS·K` of one tile into `out` (`m × Dp`, replaced): what the tile adds to dQ, before the
    /// scale.
    ///
    /// # Safety
    /// Indices in range; `ds` is the tile's dS (row stride `BLOCK`), `out` holds `m·Dp` values.
    unsafe fn ds_k(
        &self,
        b: usize,
        hk: usize,
        (j0, n): (usize, usize),
        m: usize,
        ds: &[f32],
        out: &mut [f32],
    ) {
        let pl = self.plan;
        // SAFETY: dS read by broadcast over its `n` keys; K rows `j0..j0+n` lane-padded
        // ([`Self::rows_k`]); `out` holds `m` rows of `Dp`.
        unsafe {
            let (k, ldk) = self.rows_k(b, hk, j0);
            let nvec = self.dp / pl.isa.lanes();
            tile_gemm(
                pl.isa,
                m,
                nvec,
                n,
                ds.as_ptr(),
                BLOCK,
                1,
                k,
                ldk,
                out.as_mut_ptr(),
                self.dp,
                false,
            );
        }
    }

    /// All gradients of KV head `hk` of batch `b` in one pass over its tiles: dq rows of the
    /// group's query heads zeroed, then accumulated key block by key block.
    ///
    /// # Safety
    /// The caller owns those rows of `dq`, `dk` and `dv`.
    unsafe fn one_pass(
        &self,
        b: usize,
        hk: usize,
        delta: &[f32],
        (dq, dqs): (SendPtr, [usize; 3]),
        dk: (SendPtr, [usize; 3]),
        dv: (SendPtr, [usize; 3]),
    ) -> Result<()> {
        let s = &self.plan.shape;
        let mut sc = Scratch::new(self.dp, self.dvp)?;
        let group = s.hq / s.hkv;
        for h in hk * group..(hk + 1) * group {
            for i in 0..s.lq {
                // SAFETY: row `i` of query head `h` of batch `b`, owned by the caller.
                unsafe { core::ptr::write_bytes(dq.get().add(off(dqs, b, h, i)), 0, s.d) };
            }
        }
        for kb in 0..s.lk.div_ceil(BLOCK) {
            // SAFETY: forwarded; `kb` is a key block of this head.
            unsafe { self.dk_dv(b, hk, kb, delta, dk, dv, Some((dq, dqs)), &mut sc)? };
        }
        Ok(())
    }

    /// dK and dV of key block `kb` of KV head `hk` of batch `b`, and with `dq`, each tile's
    /// `scale·dS·K` added to the dq rows of its query block.
    ///
    /// # Safety
    /// The caller owns those rows of `dk` and `dv` (and of `dq`: every row of the group's heads).
    #[allow(clippy::too_many_arguments)]
    unsafe fn dk_dv(
        &self,
        b: usize,
        hk: usize,
        kb: usize,
        delta: &[f32],
        (dk, dks): (SendPtr, [usize; 3]),
        (dv, dvs): (SendPtr, [usize; 3]),
        dq: Option<(SendPtr, [usize; 3])>,
        sc: &mut Scratch,
    ) -> Result<()> {
        let pl = self.plan;
        let s = &pl.shape;
        let w = pl.isa.lanes();
        let (dp, dvp) = (self.dp, self.dvp);
        let (j0, n) = block(kb, s.lk);
        let Tiles {
            p,
            ds,
            acc_k,
            acc_v,
            dsk,
            mut kv,
        } = sc.parts();
        self.pack_block(b, hk, kb, &mut kv);
        let (acc_k, acc_v) = (&mut acc_k[..n * dp], &mut acc_v[..n * dvp]);
        acc_k.fill(0.0);
        acc_v.fill(0.0);
        let group = s.hq / s.hkv;
        for h in hk * group..(hk + 1) * group {
            for qb in 0..s.lq.div_ceil(BLOCK) {
                let (q0, mq) = block(qb, s.lq);
                let spec = pl.spec(b, h, q0);
                if !self.touches(&spec, mq, j0, n) {
                    continue;
                }
                for (a, m, n) in self.parts(&spec, mq, j0, n).iter() {
                    let i0 = q0 + a;
                    // SAFETY: indices in range; the tiles hold BLOCK² values.
                    unsafe { self.tile(b, h, (i0, m), (j0, n), &kv, delta, p, ds, false) };
                    // SAFETY: Pᵀ and dSᵀ read by broadcast through swapped strides (n keys × m
                    // queries of the tiles), dO and Q rows lane-padded, the accumulators `n`
                    // rows of `Dvp` / `Dp`.
                    unsafe {
                        let (dout, ldo) = self.rows_q(b, h, i0, true);
                        let (q, ldq) = self.rows_q(b, h, i0, false);
                        // dV += Pᵀ·dO, dK += dSᵀ·Q (scaled when written out).
                        let (av, ak) = (acc_v.as_mut_ptr(), acc_k.as_mut_ptr());
                        tile_gemm(
                            pl.isa,
                            n,
                            dvp / w,
                            m,
                            p.as_ptr(),
                            1,
                            BLOCK,
                            dout,
                            ldo,
                            av,
                            dvp,
                            true,
                        );
                        tile_gemm(
                            pl.isa,
                            n,
                            dp / w,
                            m,
                            ds.as_ptr(),
                            1,
                            BLOCK,
                            q,
                            ldq,
                            ak,
                            dp,
                            true,
                        );
                    }
                    if let Some((dq, dqs)) = dq {
                        // dQ += scale·dS·K, added into the caller's rows in key-block order (the
                        // same operations, in the same order, as [`Self::dq`]).
                        // SAFETY: indices in range; `dsk` holds BLOCK·Dp ≥ m·Dp values.
                        unsafe { self.ds_k(b, hk, (j0, n), m, ds, dsk) };
                        for r in 0..m {
                            // SAFETY: row `i0 + r` of head `h` of batch `b`, owned by the caller.
                            let row = unsafe {
                                core::slice::from_raw_parts_mut(
                                    dq.get().add(off(dqs, b, h, i0 + r)),
                                    s.d,
                                )
                            };
                            for (x, &y) in row.iter_mut().zip(&dsk[r * dp..]) {
                                *x += pl.scale * y;
                            }
                        }
                    }
                }
            }
        }
        for j in 0..n {
            // SAFETY: rows `j0 + j` of KV head `hk` of batch `b`, owned by this task.
            let (kd, vd) = unsafe {
                (
                    core::slice::from_raw_parts_mut(dk.get().add(off(dks, b, hk, j0 + j)), s.d),
                    core::slice::from_raw_parts_mut(dv.get().add(off(dvs, b, hk, j0 + j)), s.dv),
                )
            };
            for (x, &y) in kd.iter_mut().zip(&acc_k[j * dp..]) {
                *x = pl.scale * y;
            }
            vd.copy_from_slice(&acc_v[j * dvp..j * dvp + s.dv]);
        }
        Ok(())
    }

    /// dQ of query block `qb` of head `h` of batch `b`.
    ///
    /// # Safety
    /// The caller owns those rows of `dq`.
    unsafe fn dq(
        &self,
        b: usize,
        h: usize,
        qb: usize,
        delta: &[f32],
        (dq, dqs): (SendPtr, [usize; 3]),
    ) -> Result<()> {
        let pl = self.plan;
        let s = &pl.shape;
        let dp = self.dp;
        let (i0, m) = block(qb, s.lq);
        let hk = h / (s.hq / s.hkv);
        let mut sc = Scratch::new(dp, self.dvp)?;
        let Tiles {
            p,
            ds,
            acc_k: acc,
            dsk,
            mut kv,
            ..
        } = sc.parts();
        let acc = &mut acc[..m * dp];
        acc.fill(0.0);
        let spec = pl.spec(b, h, i0);
        for kb in 0..s.lk.div_ceil(BLOCK) {
            let (j0, n) = block(kb, s.lk);
            if !self.touches(&spec, m, j0, n) {
                continue;
            }
            // The block is packed again for every query block: 128·(D + Dv) values moved
            // against the tile's 7 products of 128²·D.
            self.pack_block(b, hk, kb, &mut kv);
            for (a, ms, n) in self.parts(&spec, m, j0, n).iter() {
                // SAFETY: as in `dk_dv`.
                unsafe {
                    self.tile(b, h, (i0 + a, ms), (j0, n), &kv, delta, p, ds, false);
                    self.ds_k(b, hk, (j0, n), ms, ds, dsk);
                }
                for (x, &y) in acc[a * dp..(a + ms) * dp].iter_mut().zip(dsk.iter()) {
                    *x += pl.scale * y;
                }
            }
        }
        for r in 0..m {
            // SAFETY: row `i0 + r` of head `h` of batch `b`, owned by this task.
            unsafe {
                let d = dq.get().add(off(dqs, b, h, i0 + r));
                core::ptr::copy_nonoverlapping(acc.as_ptr().add(r * dp), d, s.d);
            }
        }
        Ok(())
    }
}

/// Whether local row 0 of `spec` sees a key (one in its visible range that the mask keeps and
/// the bias does not set to −inf) or has a sink: its lse is then finite.
fn sees_a_key(spec: &ScoreSpec) -> bool {
    if spec.sink.is_some() {
        return true;
    }
    let (lo, hi) = spec.visible_range(0);
    (lo..hi).any(|j| {
        // SAFETY: the spec's mask and bias rows belong to validated views, readable at keys
        // `< key_len`, and `hi ≤ key_len`.
        unsafe {
            (spec.mask.is_null() || *spec.mask.add(j) != 0)
                && (spec.bias.is_null() || *spec.bias.add(j) != f32::NEG_INFINITY)
        }
    })
}

/// `dst[c·BLOCK + j] = src[j·ld + c]` for `j < n ≤ BLOCK`, `c < width`, and zero for
/// `n ≤ j < BLOCK`: a key block transposed 16 rows at a time, so that each destination line is
/// written whole while the 16 source rows stay in L1.
///
/// # Safety
/// `src` readable for `n` rows of `width` values `ld` apart.
unsafe fn transpose_block(src: *const f32, ld: usize, n: usize, width: usize, dst: &mut [f32]) {
    const ROWS: usize = 16;
    let dst = &mut dst[..width * BLOCK];
    let mut j0 = 0;
    while j0 < n {
        let rows = ROWS.min(n - j0);
        for (c, line) in dst.chunks_exact_mut(BLOCK).enumerate() {
            for (j, x) in line[j0..j0 + rows].iter_mut().enumerate() {
                // SAFETY: row `j0 + j < n`, column `c < width`, per the contract.
                *x = unsafe { *src.add((j0 + j) * ld + c) };
            }
        }
        j0 += rows;
    }
    if n < BLOCK {
        for line in dst.chunks_exact_mut(BLOCK) {
            line[n..].fill(0.0);
        }
    }
}
