//! Kernel benches: the QKᵀ tile, the P·V tile (both through `kernels::matmul`, which packs B on
//! each call), the row softmax and `exp2_slice`.
//! One bench id per ISA × shape; ISAs this CPU lacks are listed as skipped. Throughput is in
//! FLOPs for the tiles (`2·m·n·k`) and in elements for softmax/exp2.
//!
//! `cargo bench --bench kernels` (a few tens of seconds: small samples, short measurement).

use attnkit::kernels::{exp2_slice, matmul, softmax_row, Isa};
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;

/// Query rows per tile and keys per block, as the fused kernel uses them.
const M: usize = 64;
const KEYS: usize = 128;

fn data(n: usize, seed: u32) -> Vec<f32> {
    // Deterministic values in [-1, 1).
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
        .collect()
}

fn isas() -> Vec<Isa> {
    for isa in Isa::ALL {
        if !isa.is_supported() {
            eprintln!("kernels bench: skipping {isa} (not supported by this CPU)");
        }
    }
    Isa::available()
}

fn tiles(c: &mut Criterion) {
    // The fused kernel keeps queries on the SIMD axis: the score tile is Sᵀ = K·Q̂ᵀ and the
    // output tile Oᵀ += Vᵀ·Pᵀ (see `kernels::matmul`).
    let mut g = c.benchmark_group("qk_tile");
    for isa in isas() {
        for d in [64, 128] {
            // Sᵀ[KEYS × M] = K[KEYS × d] · Q̂ᵀ[d × M]
            let (k, qt) = (data(KEYS * d, 1), data(d * M, 2));
            let mut st = vec![0.0f32; KEYS * M];
            g.throughput(Throughput::Elements((2 * M * KEYS * d) as u64));
            g.bench_function(
                BenchmarkId::new(isa.name(), format!("keys{KEYS}_q{M}_d{d}")),
                |b| {
                    b.iter(|| {
                        matmul(
                            isa,
                            KEYS,
                            M,
                            d,
                            black_box(&k),
                            d,
                            black_box(&qt),
                            M,
                            &mut st,
                            M,
                            false,
                        )
                    })
                },
            );
        }
    }
    g.finish();
    let mut g = c.benchmark_group("pv_tile");
    for isa in isas() {
        for d in [64, 128] {
            // Oᵀ[d × M] += Vᵀ[d × KEYS] · Pᵀ[KEYS × M]
            let (vt, pt) = (data(d * KEYS, 3), data(KEYS * M, 4));
            let mut ot = vec![0.0f32; d * M];
            g.throughput(Throughput::Elements((2 * M * KEYS * d) as u64));
            g.bench_function(
                BenchmarkId::new(isa.name(), format!("d{d}_q{M}_keys{KEYS}")),
                |b| {
                    b.iter(|| {
                        matmul(
                            isa,
                            d,
                            M,
                            KEYS,
                            black_box(&vt),
                            KEYS,
                            black_box(&pt),
                            M,
                            &mut ot,
                            M,
                            true,
                        )
                    })
                },
            );
        }
    }
    g.finish();
}

fn elementwise(c: &mut Criterion) {
    let mut g = c.benchmark_group("softmax_row");
    for isa in isas() {
        for n in [512, 4096] {
            let x: Vec<f32> = data(n, 5).iter().map(|v| 8.0 * v).collect();
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(BenchmarkId::new(isa.name(), format!("n{n}")), |b| {
                b.iter_batched_ref(
                    || x.clone(),
                    |row| softmax_row(isa, row),
                    BatchSize::SmallInput,
                )
            });
        }
    }
    g.finish();
    let mut g = c.benchmark_group("exp2_slice");
    for isa in isas() {
        for n in [512, 4096] {
            let x: Vec<f32> = data(n, 6).iter().map(|v| 20.0 * v).collect();
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(BenchmarkId::new(isa.name(), format!("n{n}")), |b| {
                b.iter_batched_ref(
                    || x.clone(),
                    |row| exp2_slice(isa, row),
                    BatchSize::SmallInput,
                )
            });
        }
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(800))
}

criterion_group! { name = benches; config = config(); targets = tiles, elementwise }
criterion_main!(benches);
