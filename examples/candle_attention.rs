//! Attention on candle tensors: attnkit's fused kernel (`attnkit::candle::sdpa`, reading the
//! tensors in place) against candle's own matmul-softmax-matmul, on a `(B, L, H, D)` projection
//! read per head with `.transpose(1, 2)`. Prints the largest difference and the median time of
//! a few runs of each, on one thread (`RAYON_NUM_THREADS`, unless already set).
//!
//! `cargo run --release --features candle --example candle_attention`

use attnkit::{Causal, Par, SdpaOptions};
use candle_core::{DType, Device, Result, Tensor, D};
use std::time::Instant;

/// Candle's attention: `softmax(Q·Kᵀ/√D + causal mask)·V`, the softmax as `exp(x − max)/sum`.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let d = q.dim(3)?;
    let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?
        .broadcast_add(mask)?;
    let e = scores
        .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
        .exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v.contiguous()?)
}

/// The median time of `runs` calls of `f`, in milliseconds, and its last result.
fn median_ms(runs: usize, mut f: impl FnMut() -> Result<Tensor>) -> Result<(f64, Tensor)> {
    let mut times = Vec::with_capacity(runs);
    let mut out = f()?; // warm-up
    for _ in 0..runs {
        let t = Instant::now();
        out = f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[runs / 2], out))
}

fn main() -> Result<()> {
    // Candle's matmul and both rayon pools read it; set before anything starts a thread.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let (b, l, h, d) = (1, 512, 8, 64);
    let dev = Device::Cpu;
    let proj = |seed: u64| -> Result<Tensor> {
        let mut s = seed;
        let x: Vec<f32> = (0..b * l * h * d)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        // A (B, L, H, D) projection viewed as (B, H, L, D): strided, not copied.
        Tensor::from_vec(x, (b, l, h, d), &dev)?.transpose(1, 2)
    };
    let (q, k, v) = (proj(1)?, proj(2)?, proj(3)?);
    let mask: Vec<f32> = (0..l * l)
        .map(|x| {
            if x % l > x / l {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (l, l), &dev)?;

    let opts = SdpaOptions::new().causal(Causal::TopLeft).par(Par::Seq);
    let runs = 7;
    let (t_attn, ours) = median_ms(runs, || attnkit::candle::sdpa(&q, &k, &v, &opts))?;
    let (t_candle, theirs) = median_ms(runs, || candle_attention(&q, &k, &v, &mask))?;
    let diff = (ours - theirs)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_dtype(DType::F64)?;
    println!(
        "causal attention, (B, H, L, D) = ({b}, {h}, {l}, {d}), f32, {} thread(s), median of {runs}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_default()
    );
    println!("  attnkit::candle::sdpa        {t_attn:8.2} ms");
    println!("  candle matmul-softmax-matmul {t_candle:8.2} ms");
    println!("  max |difference| {:.2e}", diff.to_scalar::<f64>()?);
    Ok(())
}
