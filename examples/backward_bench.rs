//! Times the backward pass against the forward on the same shapes, 1 and 2 threads: median of
//! `REPS` calls each, the two alternating. GFLOP/s count the forward as `4·B·H·Lq·Lk·D` (half
//! with a causal mask) and the backward as 2.5× that (its five products; attnkit recomputes two
//! more, which are not counted), the convention of FlashAttention's papers.
//!
//! `cargo run --release --example backward_bench`

use attnkit::{
    sdpa_backward, sdpa_ext, Causal, Extras, Par, Saved, SdpaOptions, Tensor, TensorMut,
};
use std::time::Instant;

const REPS: usize = 7;

fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

fn main() {
    let shapes = [
        (1, 16, 1024, 64, false),
        (1, 16, 1024, 64, true),
        (1, 8, 2048, 128, false),
        (1, 8, 2048, 128, true),
        (4, 12, 512, 64, false),
        (4, 12, 512, 64, true),
    ];
    println!("| B,H,L,D | causal | threads | forward ms | backward ms | bwd/fwd | fwd GFLOP/s | bwd GFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|");
    for (b, h, l, d, causal) in shapes {
        let n = b * h * l * d;
        let (q, k, v, dout) = (randn(n, 1), randn(n, 2), randn(n, 3), randn(n, 4));
        let s = [b, h, l, d];
        let (qt, kt, vt) = (
            Tensor::bhld(&q, s),
            Tensor::bhld(&k, s),
            Tensor::bhld(&v, s),
        );
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut opts = SdpaOptions::new().par(Par::Rayon);
            if causal {
                opts = opts.causal(Causal::TopLeft);
            }
            let mut out = vec![0.0f32; n];
            let mut lse = vec![0.0f32; b * h * l];
            let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
            let (mut tf, mut tb) = (Vec::new(), Vec::new());
            pool.install(|| {
                for _ in 0..REPS + 1 {
                    let t = Instant::now();
                    sdpa_ext(
                        &qt,
                        &kt,
                        &vt,
                        &mut TensorMut::bhld(&mut out, s),
                        &opts,
                        Extras {
                            lse: Some(&mut lse),
                            weights: None,
                        },
                    )
                    .unwrap();
                    tf.push(t.elapsed().as_secs_f64());
                    let saved = Saved {
                        q: qt,
                        k: kt,
                        v: vt,
                        out: Tensor::bhld(&out, s),
                        lse: &lse,
                    };
                    let t = Instant::now();
                    sdpa_backward(
                        &saved,
                        &Tensor::bhld(&dout, s),
                        &mut TensorMut::bhld(&mut dq, s),
                        &mut TensorMut::bhld(&mut dk, s),
                        &mut TensorMut::bhld(&mut dv, s),
                        &opts,
                    )
                    .unwrap();
                    tb.push(t.elapsed().as_secs_f64());
                }
            });
            // The first round warms up.
            let (f, bw) = (median(tf[1..].to_vec()), median(tb[1..].to_vec()));
            let flops = 4.0 * (b * h * l * l * d) as f64 * if causal { 0.5 } else { 1.0 };
            println!(
                "| {b},{h},{l},{d} | {causal} | {threads} | {:.1} | {:.1} | {:.2} | {:.0} | {:.0} |",
                f * 1e3,
                bw * 1e3,
                bw / f,
                flops / f / 1e9,
                2.5 * flops / bw / 1e9
            );
        }
    }
}
