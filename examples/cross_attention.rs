//! Cross-attention: decoder queries attend to an encoder's memory. `Lq ≠ Lk` and the encoder
//! width differs from the decoder's, so the multi-head layer uses `kdim`/`vdim`
//! (`nn.MultiheadAttention(32, 4, kdim=48, vdim=48)`), and the single-head layer takes
//! `key`/`value` projections of width 48.
//!
//! `cargo run --release --example cross_attention`

use attnkit::{
    KeyPadding, Linear, MhaConfig, MhaOptions, MultiheadAttention, SelfAttention, StateDict,
    Tokens, Weights,
};

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
    let (b, lq, lk, e, e_enc, h) = (2, 5, 12, 32, 48, 4);
    let decoder = values(b * lq * e, 1, 1.0); // (B, Lq, E): the decoder's states
    let memory = values(b * lk * e_enc, 2, 1.0); // (B, Lk, E_enc): the encoder's output
    let (q, mem) = (
        Tokens::ble(&decoder, [b, lq, e]),
        Tokens::ble(&memory, [b, lk, e_enc]),
    );
    let encoder_lengths = [12, 9]; // batch 1's source sentence is shorter

    // Multi-head: separate q/k/v projection weights because kdim = vdim = 48 ≠ E = 32.
    let mut sd = StateDict::new();
    sd.insert("q_proj_weight", &[e, e], &values(e * e, 3, 0.2))?;
    sd.insert("k_proj_weight", &[e, e_enc], &values(e * e_enc, 4, 0.2))?;
    sd.insert("v_proj_weight", &[e, e_enc], &values(e * e_enc, 5, 0.2))?;
    sd.insert("in_proj_bias", &[3 * e], &values(3 * e, 6, 0.1))?;
    sd.insert("out_proj.weight", &[e, e], &values(e * e, 7, 0.2))?;
    sd.insert("out_proj.bias", &[e], &values(e, 8, 0.1))?;
    let mha =
        MultiheadAttention::from_state_dict(MhaConfig::new(e, h).kdim(e_enc).vdim(e_enc), &sd, "")?;
    let opts = MhaOptions::new()
        .key_padding_mask(KeyPadding::lengths(&encoder_lengths))
        .weights(Weights::Averaged);
    let y = mha.forward(&q, &mem, &mem, &opts)?;
    println!(
        "MHA cross-attention: queries (2, 5, 32) × memory (2, 12, 48) → out {:?}, weights {:?}",
        y.shape, y.weights_shape
    );
    let w = y.weights.as_ref().unwrap();
    println!(
        "batch 1, query 0 (keys 9.. padded): {:?}",
        w[lq * lk..lq * lk + lk]
            .iter()
            .map(|v| (v * 1e3).round() / 1e3)
            .collect::<Vec<_>>()
    );

    // Single head: Linear query (16 × 32), key/value (16 × 48).
    let d = 16;
    let lin = |out: usize, inp: usize, seed: u64| {
        Linear::new(
            values(out * inp, seed, 0.2),
            Some(values(out, seed + 100, 0.1)),
            out,
            inp,
        )
    };
    let head = SelfAttention::new(lin(d, e, 9)?, lin(d, e_enc, 10)?, lin(d, e_enc, 11)?)?;
    let y = head.forward_cross(&q, &mem, &MhaOptions::new())?;
    println!("single-head cross-attention → out {:?}", y.shape);
    Ok(())
}
