//! Throughput of the layers, fused against unfused, at 1 and 2 threads (medians):
//!
//! * multi-head attention forward, B=2, L=512, E=1024, 16 heads, no weights: the fused SDPA
//!   kernel vs the unfused baseline (`Fusion::Unfused`: a materialised `L × L` score matrix
//!   per head, GEMM–softmax–GEMM), both with the same GEMM projections;
//! * additive attention, B=4, Lq=Lk=512, A=256 (Dq=Dk=Dv=256): the fused kernel vs the textbook
//!   unfused path, which materialises `tanh(q′_i + k′_j)` as an `(Lq, Lk, A)` tensor per batch
//!   element (268 MB), then `scores = H·v`, a row softmax and `P·V`.
//!
//! `cargo run --release --example layers_bench [-- --quick]`

use attnkit::kernels::{softmax_row, tanh_slice, Isa};
use attnkit::unfused::Backend;
use attnkit::{
    AdditiveAttention, AdditiveDims, AdditiveOptions, AdditiveWeights, Fusion, Linear, MhaConfig,
    MhaOptions, MultiheadAttention, Par, StateDict, Tokens,
};
use rayon::prelude::*;
use std::time::Instant;

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Median wall time (seconds) of `reps` runs after one warm-up.
fn median(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[t.len() / 2]
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// `C (m × n) = A (m × k) · B (k × n)`, all row-major with the given leading dimensions.
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    assert!(
        a.len() >= (m - 1) * lda + k
            && b.len() >= (k - 1) * ldb + n
            && c.len() >= (m - 1) * ldc + n
    );
    // SAFETY: the extents are asserted above.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            lda as isize,
            1,
            b.as_ptr(),
            ldb as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            ldc as isize,
            1,
        )
    };
}

fn main() -> Result<(), attnkit::AttnError> {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 3 } else { 7 };
    let isa = Isa::detect()?;
    println!(
        "ISA {isa}, {} CPUs; medians of {reps} runs",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    // ---------------------------------------------------------------------------------------
    // Multi-head attention.
    let (b, l, e, h) = (2usize, 512usize, 1024usize, 16usize);
    let mut sd = StateDict::new();
    sd.insert("in_proj_weight", &[3 * e, e], &values(3 * e * e, 1, 0.03))?;
    sd.insert("in_proj_bias", &[3 * e], &values(3 * e, 2, 0.1))?;
    sd.insert("out_proj.weight", &[e, e], &values(e * e, 3, 0.03))?;
    sd.insert("out_proj.bias", &[e], &values(e, 4, 0.1))?;
    let mha = MultiheadAttention::from_state_dict(MhaConfig::new(e, h), &sd, "")?;
    let in_proj = Linear::from_state_dict(
        &{
            let mut s = StateDict::new();
            let (shape, w) = sd.tensor("in_proj_weight")?;
            s.insert("weight", &shape, &w)?;
            s
        },
        "",
    )?;
    let x = values(b * l * e, 5, 1.0);
    let xt = Tokens::ble(&x, [b, l, e]);
    let proj_flops = 2.0 * (b * l * e) as f64 * (4 * e) as f64;
    let attn_flops = 4.0 * (b * l * l * e) as f64;
    let flops = proj_flops + attn_flops;
    println!(
        "\nMHA forward B={b} L={l} E={e} H={h} (no weights): {:.2} GFLOP ({:.2} projections + {:.2} attention)",
        flops / 1e9,
        proj_flops / 1e9,
        attn_flops / 1e9
    );
    println!(
        "{:<34} {:>8} {:>11} {:>8}",
        "path (projection GEMM library)", "threads", "median ms", "GFLOP/s"
    );
    for &backend in Backend::ALL {
        for threads in [1, 2] {
            let p = pool(threads);
            for (name, path) in [
                ("fused", Fusion::Fused),
                ("unfused (materialised)", Fusion::Unfused),
            ] {
                let opts = MhaOptions::new()
                    .fusion(path)
                    .par(Par::Rayon)
                    .backend(backend);
                let t =
                    p.install(|| median(reps, || drop(mha.forward(&xt, &xt, &xt, &opts).unwrap())));
                let label = format!("{name} ({})", backend.name());
                println!(
                    "{label:<34} {threads:>8} {:>11.1} {:>8.1}",
                    t * 1e3,
                    flops / t / 1e9
                );
            }
        }
    }
    // The packed Q/K/V projection alone (3/4 of the projection work), for the breakdown.
    for threads in [1, 2] {
        let t = pool(threads)
            .install(|| median(reps, || drop(in_proj.forward(&xt, Par::Rayon).unwrap())));
        println!(
            "{:<34} {threads:>8} {:>11.1} {:>8.1}",
            "  in_proj GEMM alone (default)",
            t * 1e3,
            0.75 * proj_flops / t / 1e9
        );
    }

    // ---------------------------------------------------------------------------------------
    // Additive attention.
    let (b, lq, lk, d, a) = (4usize, 512usize, 512usize, 256usize, 256usize);
    let (w_q, w_k, bias, w_v) = (
        values(a * d, 11, 0.06),
        values(a * d, 12, 0.06),
        values(a, 13, 0.1),
        values(a, 14, 0.06),
    );
    let layer = AdditiveAttention::new(&AdditiveWeights {
        dims: AdditiveDims {
            attn_dim: a,
            query_dim: d,
            key_dim: d,
        },
        w_q: &w_q,
        w_k: &w_k,
        bias: Some(&bias),
        v: &w_v,
    })?;
    let lin_q = Linear::new(w_q, Some(bias), a, d)?;
    let lin_k = Linear::new(w_k, None, a, d)?;
    let (q, k, v) = (
        values(b * lq * d, 15, 1.0),
        values(b * lk * d, 16, 1.0),
        values(b * lk * d, 17, 1.0),
    );
    let (qt, kt, vt) = (
        Tokens::ble(&q, [b, lq, d]),
        Tokens::ble(&k, [b, lk, d]),
        Tokens::ble(&v, [b, lk, d]),
    );
    let pairs = (b * lq * lk * a) as f64;

    let unfused = |par: bool| -> Vec<f32> {
        let qp = lin_q.forward(&qt, Par::Rayon).unwrap(); // (B, Lq, A), bias included
        let kp = lin_k.forward(&kt, Par::Rayon).unwrap(); // (B, Lk, A)
        let mut out = vec![0.0f32; b * lq * d];
        let one = |(bi, o): (usize, &mut [f32])| {
            // H[i, j, :] = tanh(q′_i + k′_j): the (Lq, Lk, A) tensor.
            let mut hten = vec![0.0f32; lq * lk * a];
            for i in 0..lq {
                let qi = &qp[(bi * lq + i) * a..(bi * lq + i + 1) * a];
                for j in 0..lk {
                    let kj = &kp[(bi * lk + j) * a..(bi * lk + j + 1) * a];
                    let hrow = &mut hten[(i * lk + j) * a..(i * lk + j + 1) * a];
                    for ((hv, &x), &y) in hrow.iter_mut().zip(qi).zip(kj) {
                        *hv = x + y;
                    }
                }
            }
            tanh_slice(isa, &mut hten);
            let mut scores = vec![0.0f32; lq * lk];
            gemm(lq * lk, a, 1, &hten, a, &w_v, 1, &mut scores, 1);
            drop(hten);
            for row in scores.chunks_mut(lk) {
                softmax_row(isa, row);
            }
            gemm(lq, lk, d, &scores, lk, &v[bi * lk * d..], d, o, d);
        };
        if par {
            out.par_chunks_mut(lq * d).enumerate().for_each(one);
        } else {
            out.chunks_mut(lq * d).enumerate().for_each(one);
        }
        out
    };
    // Same numbers both ways (the unfused path is the textbook computation).
    let fused_out = layer.forward(&qt, &kt, &vt, &AdditiveOptions::new())?.out;
    let unf_out = unfused(true);
    let diff = fused_out
        .iter()
        .zip(&unf_out)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    println!("\nAdditive attention B={b} Lq={lq} Lk={lk} A={a} Dq=Dk=Dv={d}: {:.0} M (query, key, a) terms; fused vs unfused max |diff| {diff:.1e}", pairs / 1e6);
    println!(
        "{:<28} {:>8} {:>11} {:>14}",
        "path", "threads", "median ms", "G terms/s"
    );
    let reps_unf = if quick { 1 } else { 3 };
    for threads in [1, 2] {
        let p = pool(threads);
        let t = p.install(|| {
            median(reps, || {
                drop(
                    layer
                        .forward(&qt, &kt, &vt, &AdditiveOptions::new())
                        .unwrap(),
                )
            })
        });
        println!(
            "{:<28} {threads:>8} {:>11.1} {:>14.2}",
            "fused",
            t * 1e3,
            pairs / t / 1e9
        );
        let t = p.install(|| median(reps_unf, || drop(unfused(threads > 1))));
        println!(
            "{:<28} {threads:>8} {:>11.1} {:>14.2}",
            "unfused (L×L×A tensor)",
            t * 1e3,
            pairs / t / 1e9
        );
    }
    Ok(())
}
