//! Dot-product and scaled dot-product attention on the shapes attention tutorials use:
//! the scores of one query against six keys, `(1, 64)·(6, 64)ᵀ → (1, 6)`, and SDPA on a
//! `(4, 64)` sequence (four tokens attending to each other).
//!
//! `cargo run --release --example dot_product`

use attnkit::{
    dot_product_attention, scaled_dot_product_attention, sdpa_ext, Extras, SdpaOptions, Tensor,
    TensorMut,
};

/// Deterministic pseudo-random numbers in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn main() -> Result<(), attnkit::AttnError> {
    let d = 64;

    // One query against six keys: scores (1, 6), weights (1, 6), output (1, 64).
    let (q, k, v) = (values(d, 1), values(6 * d, 2), values(6 * d, 3));
    let (qt, kt, vt) = (
        Tensor::bhld(&q, [1, 1, 1, d]),
        Tensor::bhld(&k, [1, 1, 6, d]),
        Tensor::bhld(&v, [1, 1, 6, d]),
    );
    let scores: Vec<f32> = (0..6)
        .map(|j| (0..d).map(|p| q[p] * k[j * d + p]).sum())
        .collect();
    let mut out = vec![0.0f32; d];
    let mut weights = vec![0.0f32; 6];
    let opts = SdpaOptions::new().scale(1.0); // plain dot product
    sdpa_ext(
        &qt,
        &kt,
        &vt,
        &mut TensorMut::bhld(&mut out, [1, 1, 1, d]),
        &opts,
        Extras {
            lse: None,
            weights: Some(&mut weights),
        },
    )?;
    println!("scores  (1, 6): {:?}", round(&scores));
    println!(
        "weights (1, 6): {:?}  (sum {:.6})",
        round(&weights),
        weights.iter().sum::<f32>()
    );
    let mut out2 = vec![0.0f32; d];
    dot_product_attention(
        &qt,
        &kt,
        &vt,
        &mut TensorMut::bhld(&mut out2, [1, 1, 1, d]),
        &SdpaOptions::new(),
    )?;
    assert!(close(&out, &out2));
    println!("output  (1, 64): first 4 = {:?}", round(&out[..4]));

    // Scaled dot-product self-attention on a (4, 64) sequence.
    let x = values(4 * d, 4);
    let t = Tensor::bhld(&x, [1, 1, 4, d]);
    let mut y = vec![0.0f32; 4 * d];
    let mut w = vec![0.0f32; 16];
    sdpa_ext(
        &t,
        &t,
        &t,
        &mut TensorMut::bhld(&mut y, [1, 1, 4, d]),
        &SdpaOptions::new(),
        Extras {
            lse: None,
            weights: Some(&mut w),
        },
    )?;
    println!("SDPA (4, 64) → (4, 64), weights softmax(QKᵀ/8):");
    for row in w.chunks(4) {
        println!("  {:?}", round(row));
    }
    let mut y2 = vec![0.0f32; 4 * d];
    scaled_dot_product_attention(
        &t,
        &t,
        &t,
        &mut TensorMut::bhld(&mut y2, [1, 1, 4, d]),
        &SdpaOptions::new(),
    )?;
    assert!(close(&y, &y2));
    Ok(())
}

/// Same within f32 rounding (the call with weights may take another kernel path).
fn close(a: &[f32], b: &[f32]) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| (x - y).abs() <= 1e-6 * (1.0 + y.abs()))
}

fn round(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| (v * 1e4).round() / 1e4).collect()
}
