//! Additive (Bahdanau) attention on the shapes of the d2l.ai tutorial: queries `(2, 1, 20)`,
//! keys `(2, 10, 2)`, values `(2, 10, 4)`, `num_hiddens = 8`, valid lengths `[2, 6]`; then the
//! same layer built from the textbook concat form `vᵀ·tanh(W·[q; k] + b)`.
//!
//! `cargo run --release --example additive_attention`

use attnkit::{AdditiveAttention, AdditiveDims, AdditiveOptions, AdditiveWeights, Tokens};

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

fn main() -> Result<(), attnkit::AttnError> {
    let (b, lq, lk, dq, dk, dv, a) = (2, 1, 10, 20, 2, 4, 8);
    let queries = values(b * lq * dq, 1, 1.0);
    let keys = vec![1.0f32; b * lk * dk]; // d2l: torch.ones((2, 10, 2))
    let vals: Vec<f32> = (0..b * lk * dv).map(|i| (i % (lk * dv)) as f32).collect(); // d2l: arange(40).reshape(1, 10, 4).repeat(2, 1, 1)
    let (w_q, w_k, w_v) = (
        values(a * dq, 2, 0.3),
        values(a * dk, 3, 0.3),
        values(a, 4, 0.5),
    );
    let layer = AdditiveAttention::new(&AdditiveWeights {
        dims: AdditiveDims {
            attn_dim: a,
            query_dim: dq,
            key_dim: dk,
        },
        w_q: &w_q,
        w_k: &w_k,
        bias: None,
        v: &w_v,
    })?;
    let valid_lens = [2usize, 6];
    let y = layer.forward(
        &Tokens::ble(&queries, [b, lq, dq]),
        &Tokens::ble(&keys, [b, lk, dk]),
        &Tokens::ble(&vals, [b, lk, dv]),
        &AdditiveOptions::new()
            .key_lengths(&valid_lens)
            .outputs(true, false),
    )?;
    println!("additive attention: out {:?}", y.shape);
    for (bi, row) in y.out.chunks(dv).enumerate() {
        println!("  batch {bi}: {row:?}");
    }
    let w = y.weights.as_ref().unwrap();
    println!(
        "  weights batch 0 (2 valid keys, all keys equal → uniform): {:?}",
        &w[..lk]
    );
    println!("  weights batch 1 (6 valid keys): {:?}", &w[lk..2 * lk]);

    // The concat form: W = [W_q | W_k] of shape (A, Dq + Dk) is the same function.
    let w_cat: Vec<f32> = (0..a)
        .flat_map(|r| {
            w_q[r * dq..(r + 1) * dq]
                .iter()
                .chain(&w_k[r * dk..(r + 1) * dk])
                .copied()
        })
        .collect();
    let concat = AdditiveAttention::from_concat(
        AdditiveDims {
            attn_dim: a,
            query_dim: dq,
            key_dim: dk,
        },
        &w_cat,
        None,
        &w_v,
    )?;
    assert_eq!(concat, layer);
    println!("from_concat(W (8, 22)) builds the same layer");
    Ok(())
}
