//! Kernel scratch the allocator refuses is an `AttnError::Alloc`, never an abort, and the
//! refused call writes nothing. Scratch grows with the head dimension (a prefill task holds Q̂ᵀ
//! and Oᵀ of 16 or more rows), so a call whose buffers are small enough can still ask for too
//! much of it; this binary's allocator refuses any single allocation above [`LIMIT`], as a
//! machine with that much free memory would.

use attnkit::{
    bf16, sdpa, unfused, AttnError, Elem, Kernel, Operand, Par, SdpaOptions, Tensor, TensorMut,
};
use std::alloc::{GlobalAlloc, Layout, System};

/// The largest single allocation served (48 MiB).
const LIMIT: usize = 48 << 20;

struct Capped;

// SAFETY: every request is refused (null, which `GlobalAlloc` permits) or forwarded unchanged
// to `System`, whose guarantees then hold; `dealloc` only sees `System`'s pointers.
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract; `ptr` came from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded contract; `ptr` came from `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Capped = Capped;

/// Head dimension of the refused calls: Q, K, V and out of one row are 4 MiB each in f32, a
/// prefill task's scratch is ≥ 128 MiB and the decode kernel's ≥ 64 MiB.
const D: usize = 1 << 20;

fn values<E: Elem>(n: usize) -> Vec<E> {
    (0..n)
        .map(|i| E::from_f32(((i % 7) as f32 - 3.0) / 8.0))
        .collect()
}

/// `sdpa` on `hq` heads of one query row against `lk` keys, head dimension [`D`]: refused
/// with `Alloc { arg: "scratch" }`, the output untouched; then the same call at `D = 64`
/// succeeds on this thread.
fn refused<E: Operand + Elem>(kernel: Kernel, par: Par, hq: usize, lk: usize) {
    let (q, kv) = (values::<E>(hq * D), values::<E>(lk * D));
    let mut out = vec![7.0f32; hq * D];
    let opts = SdpaOptions::new().kernel(kernel).par(par);
    let res = sdpa(
        &Tensor::bhld(&q, [1, hq, 1, D]),
        &Tensor::bhld(&kv, [1, 1, lk, D]),
        &Tensor::bhld(&kv, [1, 1, lk, D]),
        &mut TensorMut::bhld(&mut out, [1, hq, 1, D]),
        &opts,
    );
    let what = format!("{kernel:?} {par:?} {:?} hq={hq} lk={lk}", E::DTYPE);
    match res {
        Err(AttnError::Alloc {
            arg: "scratch",
            bytes,
        }) => {
            assert!(bytes > LIMIT, "{what}: refused {bytes} bytes")
        }
        other => panic!("{what}: {other:?}"),
    }
    assert!(
        out.iter().all(|&x| x == 7.0),
        "{what}: a refused call wrote"
    );

    let d = 64;
    let mut out = vec![7.0f32; hq * d];
    sdpa(
        &Tensor::bhld(&q[..hq * d], [1, hq, 1, d]),
        &Tensor::bhld(&kv[..lk * d], [1, 1, lk, d]),
        &Tensor::bhld(&kv[..lk * d], [1, 1, lk, d]),
        &mut TensorMut::bhld(&mut out, [1, hq, 1, d]),
        &opts,
    )
    .unwrap_or_else(|e| panic!("{what}, then D = 64: {e}"));
    assert!(out.iter().all(|x| x.abs() < 1.0), "{what}, then D = 64");
}

#[test]
fn prefill_scratch_refused() {
    for par in [Par::Seq, Par::Rayon] {
        refused::<f32>(Kernel::Prefill, par, 2, 2);
        refused::<bf16>(Kernel::Prefill, par, 2, 2);
    }
}

#[test]
fn decode_scratch_refused() {
    for par in [Par::Seq, Par::Rayon] {
        refused::<f32>(Kernel::Decode, par, 2, 3);
        refused::<bf16>(Kernel::Decode, par, 2, 3);
    }
}

/// The unfused path's scratch is one head's Lq × Lk score matrix: 64 MiB here, from inputs of
/// 16 KiB.
#[test]
fn unfused_scratch_refused() {
    let l = 4096;
    let x = values::<f32>(l);
    let mut out = vec![7.0f32; l];
    let shape = [1, 1, l, 1];
    let t = Tensor::bhld(&x, shape);
    let res = unfused::sdpa_unfused(
        &t,
        &t,
        &t,
        &mut TensorMut::bhld(&mut out, shape),
        &SdpaOptions::new(),
    );
    assert!(
        matches!(res, Err(AttnError::Alloc { arg: "scratch", .. })),
        "{res:?}"
    );
    assert!(out.iter().all(|&x| x == 7.0), "a refused call wrote");
}
