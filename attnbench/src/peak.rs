//! The FMA peak that `pct_peak` is relative to: a short probe of f32 fused multiply-adds in
//! independent register chains on the widest vectors the CPU has (AVX-512, else AVX2+FMA), run on
//! `threads` threads at once. Best of [`TRIALS`] short trials (≈ 0.15 s in all): on a noisy host a
//! trial can only under-read the peak, so more trials read closer to it.

use attnkit::Isa;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

/// Independent accumulator chains: enough to cover FMA latency × ports (4 × 2 on recent x86).
pub const CHAINS: usize = 12;
/// Trials of the probe; it reports the best.
pub const TRIALS: usize = 16;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
// The AVX-512 intrinsics are stable since Rust 1.89 (the kernels crate needs them too).
#[allow(clippy::incompatible_msrv)]
unsafe fn fma_avx512(iters: u64, a: f32, b: f32) -> f32 {
    use std::arch::x86_64::*;
    let (va, vb) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, va, vb);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

/// The pair product's ceiling: `vdpbf16ps` in independent chains (64 flops each: 16 lanes of
/// two products and two adds), what the `avx512bf16` kernel's products run on.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::incompatible_msrv)]
unsafe fn dpbf16_avx512(iters: u64, a: f32) -> f32 {
    use std::arch::x86_64::*;
    // Both halves of each pair hold `a` rounded to bf16.
    let bits = (a.to_bits() >> 16) * 0x1_0001;
    let va: __m512bh = core::mem::transmute(_mm512_set1_epi32(bits as i32));
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, va, va);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64, a: f32, b: f32) -> f32 {
    use std::arch::x86_64::*;
    let (va, vb) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, va, vb);
        }
    }
    let mut s = _mm256_setzero_ps();
    for x in acc {
        s = _mm256_add_ps(s, x);
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), s);
    lanes.iter().sum()
}

/// A probe kernel: `(run(iters), flops per iteration, description)`.
type Probe = (fn(u64) -> f32, f64, &'static str);

/// The probe kernel for this CPU, on `isa`'s vectors (the AVX2 peak for an AVX2 run: on cores
/// with two 512-bit FMA ports it is half the AVX-512 one); none for the scalar path.
fn kernel(isa: Isa) -> Option<Probe> {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512Bf16 && isa.is_supported() {
            // SAFETY: AVX-512 F and BF16 are part of the path, just checked.
            let f: fn(u64) -> f32 = |n| unsafe { dpbf16_avx512(n, black_box(1e-3)) };
            return Some((f, (CHAINS * 16 * 4) as f64, "AVX-512 BF16 dot"));
        }
        // AMX runs are measured against the f32 FMA ceiling (what "× the f32 peak" means).
        if matches!(isa, Isa::Avx512 | Isa::Amx) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was just detected.
            let f: fn(u64) -> f32 =
                |n| unsafe { fma_avx512(n, black_box(0.999_999), black_box(1e-7)) };
            return Some((f, (CHAINS * 16 * 2) as f64, "AVX-512 FMA"));
        }
        if isa != Isa::Scalar
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: AVX2 and FMA were just detected.
            let f: fn(u64) -> f32 =
                |n| unsafe { fma_avx2(n, black_box(0.999_999), black_box(1e-7)) };
            return Some((f, (CHAINS * 8 * 2) as f64, "AVX2 FMA"));
        }
    }
    None
}

/// What the probe runs on this CPU for `isa`, e.g. "AVX-512 FMA".
pub fn describe(isa: Isa) -> &'static str {
    kernel(isa).map_or("no vector FMA", |k| k.2)
}

/// Measures the FMA peak in GFLOP/s of `threads` threads running at once; `None` on CPUs without
/// a vector FMA path (then `pct_peak` is left out unless `--peak` gives it).
pub fn probe(threads: usize, isa: Isa) -> Option<f64> {
    let (run, flops_per_iter, _) = kernel(isa)?;
    let threads = threads.max(1);
    // ≈ 8 ms per trial at 200 GFLOP/s per thread.
    let iters: u64 = 4_000_000;
    let mut best = 0.0f64;
    for _ in 0..TRIALS {
        // Each worker times itself from the common start: the spawning thread is an extra
        // runnable thread on a machine with `threads` cores, and a clock it read late (after
        // being descheduled) made the 2-thread probe on 2 cores read more than twice 1 thread.
        let barrier = Barrier::new(threads);
        let secs = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        let t = Instant::now();
                        black_box(run(iters));
                        t.elapsed().as_secs_f64()
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("probe thread"))
                .fold(0.0f64, f64::max)
        });
        best = best.max(flops_per_iter * iters as f64 * threads as f64 / secs / 1e9);
    }
    Some(best)
}
