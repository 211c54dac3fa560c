//! The decode path of [`crate::sdpa`]: GQA groups × split-KV chunks on the decode kernel, then an
//! exact logsumexp merge.
//!
//! Task `(b, kv head, chunk)` runs every query row that reads this KV head (`Hq/Hkv` heads ×
//! `Lq` rows) over keys `[chunk·C, (chunk+1)·C)`, so K and V are streamed from memory once per
//! group, and a single long sequence still gives every core work. The chunk length `C` depends
//! on the shape only ([`chunk_len`]), and partials are merged in chunk order, so the result is
//! the same for every thread count.

use crate::alloc::try_zeros;
use crate::error::Result;
use crate::exec::SendPtr;
use crate::options::Par;
use crate::plan::{off, Plan};
use crate::scratch::run_tasks_scratch;
use crate::view::store_rounded;
use attnkit_kernels::{
    decode_scratch_len, merge_partials, partial_len, DecodeArgs, DecodeRow, DecodeWalk, Dtype,
    Elem, Operand, ScoreSpec,
};
use std::cell::RefCell;

/// Keys per split-KV chunk: long enough that a chunk's fixed cost (packing Q, the merge) is
/// small next to streaming its K and V, short enough that one 8k-token sequence makes 16 tasks.
pub(crate) fn chunk_len(lk: usize) -> usize {
    const MIN: usize = 512;
    MIN.max(lk.div_ceil(64))
}

thread_local! {
    /// Partials of the split-KV path, owned by the calling thread for the duration of a call
    /// (separate from the per-task kernel scratch, which the same thread may also use).
    static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `p` on the decode kernel: every (batch, KV head, chunk) task, then the merge.
///
/// # Errors
/// [`AttnError::Alloc`](crate::AttnError) if the partials or the kernel's scratch cannot be
/// allocated (then nothing was written).
pub(crate) fn run<Q: Elem, KV: Operand, O: Elem>(p: &Plan<Q, KV, O>, par: Par) -> Result<()> {
    let s = p.shape;
    let groups = s.b * s.hkv;
    let g = s.hq / s.hkv;
    let rows = g * s.lq;
    if groups == 0 || rows == 0 {
        return Ok(());
    }
    let clen = chunk_len(s.lk);
    let chunks = s.lk.div_ceil(clen).max(1);
    let pl = partial_len(s.dv);
    let per_task = rows * pl;
    // Take the buffer out of the thread-local rather than borrowing it across the parallel
    // loop: while this thread waits in rayon it may run another call's decode (nested
    // parallelism in the caller), which then finds an empty buffer and uses its own.
    let mut buf = PARTIALS.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
    // Saturating: a length past `isize::MAX` is then refused by the allocation.
    let len = groups.saturating_mul(chunks).saturating_mul(per_task);
    // A 16-bit output row is merged into f32 at the end of the buffer, then rounded.
    let staged = if O::DTYPE == Dtype::F32 { 0 } else { s.dv };
    if buf.len() < len.saturating_add(staged) {
        // Free the old buffer first: peak memory is then the new size only.
        drop(std::mem::take(&mut buf));
        buf = try_zeros("partials", len.saturating_add(staged))?;
    }
    let (buf_parts, row) = buf.split_at_mut(len);
    let parts = SendPtr(buf_parts.as_mut_ptr());
    let scratch = task_scratch_len::<Q>(s.d, s.dv);
    run_tasks_scratch(par, groups * chunks, p.work(), scratch, |t, scratch| {
        // SAFETY: task `t` owns partial rows `[t·rows, (t+1)·rows)` of the buffer.
        let dst = unsafe { parts.get().add(t * per_task) };
        task(p, t / chunks, t % chunks, clen, dst, pl, scratch);
    })?;
    for grp in 0..groups {
        let (b, hk) = (grp / s.hkv, grp % s.hkv);
        for r in 0..rows {
            let (h, i) = (hk * g + r / s.lq, r % s.lq);
            // SAFETY: `out` row (b, h, i) and lse entry are in bounds (validated) and
            // nothing else touches them now.
            unsafe {
                let dst = p.o.add(off(p.os, b, h, i));
                let out = if O::DTYPE == Dtype::F32 {
                    core::slice::from_raw_parts_mut(dst.cast::<f32>(), s.dv)
                } else {
                    &mut row[..s.dv]
                };
                let sink = p.sinks.map(|p| *p.add(h));
                let lse = merge_partials(
                    &buf_parts[(grp * chunks * rows + r) * pl..],
                    per_task,
                    chunks,
                    sink,
                    out,
                );
                if O::DTYPE != Dtype::F32 {
                    store_rounded(dst, &row[..s.dv]);
                }
                if !p.lse.is_null() {
                    *p.lse.add((b * s.hq + h) * s.lq + i) = lse;
                }
            }
        }
    }
    // Keep the larger buffer for the next call on this thread.
    PARTIALS.with(|cell| {
        let mut kept = cell.borrow_mut();
        if kept.len() < buf.len() {
            *kept = buf;
        }
    });
    Ok(())
}

/// Query rows per kernel call (the kernel itself works in groups of 8 rows).
const PASS_ROWS: usize = 16;

/// Scratch floats of a task: the kernel's, plus a pass of queries widened to f32 when they are
/// not f32 (the kernels' instances read f32 queries; see [`Operand`]).
fn task_scratch_len<Q: Elem>(d: usize, dv: usize) -> usize {
    let widened = if Q::DTYPE == Dtype::F32 {
        0
    } else {
        PASS_ROWS.saturating_mul(d)
    };
    decode_scratch_len(d, dv).saturating_add(widened)
}

/// Task `(grp, chunk)`: every query row of KV group `grp` over key chunk `chunk`, partials to `dst`.
fn task<Q: Elem, KV: Operand, O: Elem>(
    p: &Plan<Q, KV, O>,
    grp: usize,
    chunk: usize,
    clen: usize,
    dst: *mut f32,
    pl: usize,
    scratch: &mut [f32],
) {
    let s = p.shape;
    let (b, hk) = (grp / s.hkv, grp % s.hkv);
    let g = s.hq / s.hkv;
    let mut rows = [DecodeRow {
        q: core::ptr::null(),
        spec: ScoreSpec::new(0),
    }; PASS_ROWS];
    // Queries not in f32 are widened a pass at a time into the end of the scratch.
    let (scratch, qw) = if Q::DTYPE == Dtype::F32 {
        (scratch, &mut [][..])
    } else {
        let n = scratch.len() - PASS_ROWS * s.d;
        scratch.split_at_mut(n)
    };
    let nrows = g * s.lq;
    let (k_scale, v_scale) = p.scales_at(b, hk);
    let j_begin = chunk * clen;
    let j_end = (j_begin + clen).min(s.lk);
    for r0 in (0..nrows).step_by(rows.len()) {
        let n = rows.len().min(nrows - r0);
        for (k, row) in rows[..n].iter_mut().enumerate() {
            let r = r0 + k;
            let (h, i) = (hk * g + r / s.lq, r % s.lq);
            // SAFETY: offset of a validated view (see `Plan::new`).
            let q = unsafe { p.q.add(off(p.qs, b, h, i)) };
            let q = if Q::DTYPE == Dtype::F32 {
                q.cast::<f32>()
            } else {
                let dst = &mut qw[k * s.d..(k + 1) * s.d];
                // SAFETY: row `i` of the validated view holds `D` elements.
                let src = unsafe { core::slice::from_raw_parts(q, s.d) };
                for (x, y) in dst.iter_mut().zip(src) {
                    *x = y.to_f32();
                }
                dst.as_ptr()
            };
            *row = DecodeRow {
                q,
                spec: p.spec(b, h, i),
            };
        }
        let args = DecodeArgs {
            rows: &rows[..n],
            d: s.d,
            dv: s.dv,
            // SAFETY: KV head `hk` of batch `b` is inside the validated views.
            k: unsafe { p.k.add(off(p.ks, b, hk, 0)) },
            ldk: p.ks[2],
            // SAFETY: as above.
            v: unsafe { p.v.add(off(p.vs, b, hk, 0)) },
            ldv: p.vs[2],
            k_scale,
            v_scale,
            j_begin,
            j_end,
            scale: p.scale,
            walk: DecodeWalk::Auto,
            pages: p.pages_at(b),
        };
        // SAFETY: rows, K/V and masks are in bounds for keys < j_end ≤ Lk; `dst` holds
        // `nrows` partial rows of `pl` floats owned by this task; the ISA was checked.
        unsafe { KV::decode_partial(p.isa, &args, dst.add(r0 * pl), pl, scratch) };
    }
}
