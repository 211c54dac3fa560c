//! Peak resident memory of one fused SDPA call at B=1, H=16, L=16384, D=64 (causal), next to the
//! size of its inputs and output: the score matrix (16 GiB here) is never materialised, so the
//! call should add only its per-thread scratch.
//!
//! `cargo run --release --example peak_memory` (Linux: reads VmHWM from /proc/self/status).

use attnkit::{sdpa, Causal, SdpaOptions, Tensor, TensorMut};

fn peak_kib() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let (b, h, l, d) = (1, 16, 16384, 64);
    let n = b * h * l * d;
    let fill = |seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * seed) % 1000) as f32 / 1000.0 - 0.5)
            .collect()
    };
    let (q, k, v) = (fill(7919), fill(104_729), fill(31));
    // Touch every page of the output so it counts before the call, not during it.
    let mut out = vec![1.0f32; n];
    let before = peak_kib();
    let t = std::time::Instant::now();
    sdpa(
        &Tensor::bhld(&q, [b, h, l, d]),
        &Tensor::bhld(&k, [b, h, l, d]),
        &Tensor::bhld(&v, [b, h, l, d]),
        &mut TensorMut::bhld(&mut out, [b, h, l, d]),
        &SdpaOptions::new().causal(Causal::TopLeft),
    )
    .expect("sdpa");
    let secs = t.elapsed().as_secs_f64();
    let after = peak_kib();
    let io_mib = (4 * n * 4) as f64 / (1 << 20) as f64;
    println!(
        "B=1 H=16 L=16384 D=64 causal: {secs:.2} s; inputs + output {io_mib:.0} MiB; \
         peak RSS {:.1} MiB before the call, {:.1} MiB after (+{:.2} MiB)",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        (after - before) as f64 / 1024.0
    );
}
