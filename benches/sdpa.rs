//! End-to-end benches: fused `sdpa` at the core shapes (causal and not), the unfused baseline on
//! each GEMM backend this build has (matrixmultiply; OpenBLAS with `--features blas`) at one
//! shape, and, when they exist, the attention layers (EXTENSION POINT: add a `layers` group).
//! Throughput is in FLOPs under the attnbench convention, `4·B·H·Lq·Lk·D`, halved for a square
//! causal mask: criterion's "elem/s" reads as FLOP/s. Threads: the global rayon pool (all cores,
//! or `RAYON_NUM_THREADS`).
//!
//! `cargo bench --bench sdpa` (about a minute: 10 samples per id, short measurement).

use attnkit::unfused::{sdpa_unfused_with, Backend};
use attnkit::{sdpa, Causal, SdpaOptions, Tensor, TensorMut};
use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use std::time::Duration;

const CORE: [(usize, usize, usize, usize); 6] = [
    (1, 16, 512, 64),
    (1, 16, 1024, 64),
    (1, 16, 2048, 64),
    (1, 8, 2048, 128),
    (4, 12, 512, 64),
    (1, 16, 4096, 64),
];

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
        .collect()
}

fn flops(b: usize, h: usize, l: usize, d: usize, causal: bool) -> u64 {
    let f = 4 * (b * h * l * l * d) as u64;
    if causal {
        f / 2
    } else {
        f
    }
}

fn fused(c: &mut Criterion) {
    let mut g = c.benchmark_group("sdpa_fused");
    // Calls of 10–300 ms: flat sampling keeps each id near the measurement time.
    g.sampling_mode(SamplingMode::Flat);
    for causal in [false, true] {
        for (b, h, l, d) in CORE {
            let shape = [b, h, l, d];
            let (q, k, v) = (
                data(b * h * l * d, 1),
                data(b * h * l * d, 2),
                data(b * h * l * d, 3),
            );
            let mut out = vec![0.0f32; b * h * l * d];
            let opts = if causal {
                SdpaOptions::new().causal(Causal::TopLeft)
            } else {
                SdpaOptions::new()
            };
            g.throughput(Throughput::Elements(flops(b, h, l, d, causal)));
            let id = format!("b{b}_h{h}_l{l}_d{d}{}", if causal { "_causal" } else { "" });
            g.bench_function(BenchmarkId::from_parameter(id), |bch| {
                bch.iter(|| {
                    let (tq, tk, tv) = (
                        Tensor::bhld(&q, shape),
                        Tensor::bhld(&k, shape),
                        Tensor::bhld(&v, shape),
                    );
                    sdpa(&tq, &tk, &tv, &mut TensorMut::bhld(&mut out, shape), &opts).unwrap()
                })
            });
        }
    }
    g.finish();
}

fn unfused(c: &mut Criterion) {
    let mut g = c.benchmark_group("sdpa_unfused");
    let (b, h, l, d) = (1, 16, 1024, 64);
    let shape = [b, h, l, d];
    let (q, k, v) = (
        data(b * h * l * d, 1),
        data(b * h * l * d, 2),
        data(b * h * l * d, 3),
    );
    let mut out = vec![0.0f32; b * h * l * d];
    g.throughput(Throughput::Elements(flops(b, h, l, d, false)));
    for &backend in Backend::ALL {
        g.bench_function(
            BenchmarkId::new(backend.name(), format!("b{b}_h{h}_l{l}_d{d}")),
            |bch| {
                bch.iter(|| {
                    let (tq, tk, tv) = (
                        Tensor::bhld(&q, shape),
                        Tensor::bhld(&k, shape),
                        Tensor::bhld(&v, shape),
                    );
                    sdpa_unfused_with(
                        &tq,
                        &tk,
                        &tv,
                        &mut TensorMut::bhld(&mut out, shape),
                        &SdpaOptions::new(),
                        backend,
                    )
                    .unwrap()
                })
            },
        );
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

criterion_group! { name = benches; config = config(); targets = fused, unfused }
criterion_main!(benches);
