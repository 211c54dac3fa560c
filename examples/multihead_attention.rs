//! `nn.MultiheadAttention(embed_dim=128, num_heads=8, batch_first=True)` on `(2, 10, 128)`,
//! with the weights saved to and loaded from a `.safetensors` file (as a PyTorch checkpoint
//! would be), a key padding mask, and the head-averaged weights.
//!
//! `cargo run --release --example multihead_attention`

use attnkit::{KeyPadding, MhaConfig, MhaOptions, MultiheadAttention, StateDict, Tokens, Weights};

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
    let (b, l, e, h) = (2, 10, 128, 8);
    // A PyTorch-style state dict, under the prefix a Transformer encoder layer would use.
    let prefix = "encoder.layers.0.self_attn";
    let mut sd = StateDict::new();
    let xavier = (6.0 / (4 * e) as f32).sqrt();
    sd.insert(
        format!("{prefix}.in_proj_weight"),
        &[3 * e, e],
        &values(3 * e * e, 1, xavier),
    )?;
    sd.insert(
        format!("{prefix}.in_proj_bias"),
        &[3 * e],
        &values(3 * e, 2, 0.1),
    )?;
    sd.insert(
        format!("{prefix}.out_proj.weight"),
        &[e, e],
        &values(e * e, 3, 1.0 / (e as f32).sqrt()),
    )?;
    sd.insert(format!("{prefix}.out_proj.bias"), &[e], &values(e, 4, 0.1))?;
    let path = std::env::temp_dir().join(format!(
        "attnkit-example-mha-{}.safetensors",
        std::process::id()
    ));
    sd.save(&path)?;

    let mha = MultiheadAttention::load(MhaConfig::new(e, h), &path, prefix)?;
    let _ = std::fs::remove_file(&path);

    let x = values(b * l * e, 5, 1.0);
    let x = Tokens::ble(&x, [b, l, e]);
    let y = mha.forward(&x, &x, &x, &MhaOptions::new().weights(Weights::Averaged))?;
    println!(
        "MHA(128, 8 heads): x (2, 10, 128) → out {:?}, averaged weights {:?}",
        y.shape, y.weights_shape
    );

    // Batch 1 has only 7 real tokens: key_padding_mask in PyTorch's polarity (true = padded).
    let kpm: Vec<bool> = (0..b * l).map(|i| i >= l && i % l >= 7).collect();
    let y = mha.forward(
        &x,
        &x,
        &x,
        &MhaOptions::new()
            .key_padding_mask(KeyPadding::bool(&kpm, [b, l]))
            .weights(Weights::PerHead),
    )?;
    let w = y.weights.as_ref().unwrap();
    let row = &w[(h * l) * l..(h * l) * l + l]; // batch 1, head 0, query 0
    println!(
        "batch 1, head 0, query 0 weights (keys 7.. padded): {:?}",
        row.iter()
            .map(|v| (v * 1e3).round() / 1e3)
            .collect::<Vec<_>>()
    );
    Ok(())
}
