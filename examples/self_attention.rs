//! The textbook single-head self-attention layer (`nn.Linear` query/key/value, no output
//! projection) on `(2, 8, 64) → (2, 8, 64)`, with its weights built as a PyTorch `state_dict`.
//!
//! `cargo run --release --example self_attention`

use attnkit::{Causal, MhaOptions, SelfAttention, StateDict, Tokens, Weights};

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
    let (b, l, e) = (2, 8, 64);
    // state_dict of `SelfAttention(64)`: query/key/value = nn.Linear(64, 64).
    let mut sd = StateDict::new();
    for (i, name) in ["query", "key", "value"].iter().enumerate() {
        let bound = 1.0 / (e as f32).sqrt(); // nn.Linear's default init range
        sd.insert(
            format!("{name}.weight"),
            &[e, e],
            &values(e * e, 10 + i as u64, bound),
        )?;
        sd.insert(
            format!("{name}.bias"),
            &[e],
            &values(e, 20 + i as u64, bound),
        )?;
    }
    let layer = SelfAttention::from_state_dict(&sd, "")?;

    let x = values(b * l * e, 1, 1.0);
    let y = layer.forward(
        &Tokens::ble(&x, [b, l, e]),
        &MhaOptions::new().weights(Weights::Averaged),
    )?;
    println!(
        "self-attention: x (2, 8, 64) → out {:?}, weights {:?}",
        y.shape, y.weights_shape
    );
    let w = y.weights.as_ref().unwrap();
    println!(
        "weights of token 0 (batch 0): {:?}",
        w[..l]
            .iter()
            .map(|v| (v * 1e3).round() / 1e3)
            .collect::<Vec<_>>()
    );

    // Causal (decoder-style) self-attention: token i sees tokens ≤ i.
    let yc = layer.forward(
        &Tokens::ble(&x, [b, l, e]),
        &MhaOptions::new()
            .causal(Causal::TopLeft)
            .weights(Weights::Averaged),
    )?;
    let wc = yc.weights.as_ref().unwrap();
    println!(
        "causal weights of token 2 (batch 0): {:?}",
        wc[2 * l..3 * l]
            .iter()
            .map(|v| (v * 1e3).round() / 1e3)
            .collect::<Vec<_>>()
    );
    Ok(())
}
