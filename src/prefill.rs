//! The prefill driver of [`crate::sdpa`]: tasks of (batch, head, query block) on the fused flash
//! kernel, in parallel or in one loop.

use crate::error::Result;
use crate::exec::parallel;
use crate::options::Par;
use crate::plan::{off, Plan};
use crate::scratch::{run_tasks_scratch, try_with_scratch};
use crate::view::store_rounded;
use attnkit_kernels::{
    flash_forward_with, scratch_len_paged, scratch_len_with, Dtype, Elem, FlashArgs, Stored,
};

/// Query rows per task: enough to amortise packing each K/V block, few enough that long
/// sequences give every core many tasks. Depends on the shape only, never on the thread count,
/// so results do not either.
const Q_BLOCK: usize = 96;
/// Query rows per task without a causal mask when one head's K and V pass [`KV_L2_BYTES`]: every
/// task then streams them from L3 rather than L2, so fewer, taller tasks read them less often.
/// Measured on the Xeon (flash probe, each block size in turn within a round, 15 rounds; K and V
/// from L3): 96 → 192 rows +15 % (D = 64, 4096 keys; D = 128, 2048 keys), 288 rows +22 %;
/// with K and V in L2, 192 rows −2 %. Causal tasks keep 96: their diagonal is computed in
/// 16-key steps whose share grows with the block (−10–20 % at 192 rows, attnbench).
const Q_BLOCK_TALL: usize = 192;
/// Bytes of one head's K and V above which they no longer stay in L2 between the tasks of that
/// head (half of the Xeon's 2 MiB; Zen 4 has 1 MiB).
const KV_L2_BYTES: usize = 1 << 20;

/// Query rows per task (see [`Q_BLOCK_TALL`]).
fn q_block<Q, KV, O>(p: &Plan<Q, KV, O>) -> usize {
    let s = &p.shape;
    let kv =
        s.lk.saturating_mul(s.d.saturating_add(s.dv))
            .saturating_mul(core::mem::size_of::<KV>());
    if p.causal.is_none() && kv > KV_L2_BYTES {
        Q_BLOCK_TALL
    } else {
        Q_BLOCK
    }
}

fn q_blocks<Q, KV, O>(p: &Plan<Q, KV, O>) -> usize {
    p.shape.lq.div_ceil(q_block(p))
}

/// Runs every (batch, head, query block) task of `p` (the prefill kernel; `p` has work to do).
///
/// # Errors
/// [`AttnError::Alloc`](crate::AttnError) if the kernel's scratch cannot be allocated (then
/// nothing was written).
pub(crate) fn run<Q: Elem, KV: Stored, O: Elem>(p: &Plan<Q, KV, O>, par: Par) -> Result<()> {
    let s = &p.shape;
    let (nqb, group) = (q_blocks(p), s.hq / s.hkv);
    let n = s.b * s.hq * nqb;
    let len = task_scratch_len(p, q_block(p).min(s.lq));
    if parallel(par, n, p.work()) {
        // Later query blocks first: under a causal mask they are the expensive ones, and
        // rayon hands out ranges front to back.
        return run_tasks_scratch(par, n, p.work(), len, |t, scratch| {
            let (bh, qb) = (t / nqb, nqb - 1 - t % nqb);
            let (b, h) = (bh / s.hq, bh % s.hq);
            task(p, b, h, h / group, qb, scratch);
        });
    }
    // On one thread: one scratch borrow and no index arithmetic per task, which small calls
    // (16 tasks of 10 rows at (2, 8, 10, 16)) notice.
    try_with_scratch(len, |scratch| {
        for b in 0..s.b {
            for hk in 0..s.hkv {
                for h in hk * group..(hk + 1) * group {
                    for qb in (0..nqb).rev() {
                        task(p, b, h, hk, qb, scratch);
                    }
                }
            }
        }
    })
}

/// Scratch floats of a task of `m` rows: the kernel's, plus `m·Dv` for an output not in f32
/// (written by the kernel into f32 scratch and rounded from there).
fn task_scratch_len<Q: Elem, KV: Stored, O: Elem>(p: &Plan<Q, KV, O>, m: usize) -> usize {
    let s = &p.shape;
    let staged = if O::DTYPE == Dtype::F32 {
        0
    } else {
        m.saturating_mul(s.dv)
    };
    let kernel = if p.pages.is_some() {
        scratch_len_paged::<Q, KV>(m, s.d, s.dv)
    } else {
        scratch_len_with::<Q, KV>(m, s.d, s.dv, p.precision)
    };
    kernel.saturating_add(staged)
}

/// One task: query block `qb` of head `h` (KV head `hk`) of batch `b`, with `scratch` of
/// at least [`task_scratch_len`] floats.
fn task<Q: Elem, KV: Stored, O: Elem>(
    p: &Plan<Q, KV, O>,
    b: usize,
    h: usize,
    hk: usize,
    qb: usize,
    scratch: &mut [f32],
) {
    let s = &p.shape;
    let row0 = qb * q_block(p);
    let m = q_block(p).min(s.lq - row0);
    let out = off(p.os, b, h, row0);
    // The kernel's destination: `out` itself in f32, else `m` dense rows staged at the end of
    // the scratch (past the kernel's share: see `task_scratch_len`).
    let (scratch, staged) = if O::DTYPE == Dtype::F32 {
        (scratch, &mut [][..])
    } else {
        let n = scratch.len() - m * s.dv;
        scratch.split_at_mut(n)
    };
    let (o, ldo) = if O::DTYPE == Dtype::F32 {
        // SAFETY: offset inside the validated view; `O` is f32 here.
        (unsafe { p.o.add(out) }.cast::<f32>(), p.os[2])
    } else {
        (staged.as_mut_ptr(), s.dv)
    };
    let (k_scale, v_scale) = p.scales_at(b, hk);
    // SAFETY: (pointer offsets below) every offset addresses an element inside its buffer,
    // as validated by `check_len` / the dense-length checks in `Plan::new`.
    let args = unsafe {
        FlashArgs {
            m,
            n: s.lk,
            d: s.d,
            dv: s.dv,
            scale: p.scale,
            spec: p.spec(b, h, row0),
            q: p.q.add(off(p.qs, b, h, row0)),
            ldq: p.qs[2],
            k: p.k.add(off(p.ks, b, hk, 0)),
            ldk: p.ks[2],
            v: p.v.add(off(p.vs, b, hk, 0)),
            ldv: p.vs[2],
            k_scale,
            v_scale,
            o,
            ldo,
            lse: if p.lse.is_null() {
                p.lse
            } else {
                p.lse.add((b * s.hq + h) * s.lq + row0)
            },
            weights: if p.weights.is_null() {
                p.weights
            } else {
                p.weights.add(((b * s.hq + h) * s.lq + row0) * s.lk)
            },
            ldw: s.lk,
            pages: p.pages_at(b),
        }
    };
    // SAFETY: `args` describes validated, in-bounds extents; this task's output rows (out,
    // lse, weights) are disjoint from every other task's; the ISA was checked.
    // (One flash instance serves every element type: `flash_forward_with` only erases them.)
    unsafe { flash_forward_with(p.isa, &args, scratch, p.precision) }
    if O::DTYPE != Dtype::F32 {
        for r in 0..m {
            // SAFETY: row `row0 + r` of this task's output view (validated, disjoint from
            // every other task's rows), `Dv` elements.
            unsafe {
                store_rounded(
                    p.o.add(out + r * p.os[2]),
                    &staged[r * s.dv..(r + 1) * s.dv],
                )
            };
        }
    }
}
