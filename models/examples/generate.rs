//! Greedy generation with the tiny Llama-architecture model of `tests/data/tiny_llama`
//! (attention by attnkit over a KV cache), with prefill and decode speeds on 1 and 2 threads.
//!
//! `cargo run --release -p attnkit-models --example generate [-- --json] [-- TOKEN_IDS…]`
//!
//! Without ids it runs the two reference prompts and a 512-token one. `--json` prints one line
//! per (threads, prompt) in the fields of `scripts/bench_models_torch.py`'s llama rows, for the
//! side-by-side run of `scripts/bench_models.sh`. Each figure is the median of `REPS` runs.

use attnkit::Par;
use attnkit_models::cache::Dense;
use attnkit_models::llama::{GenProfile, Llama};
use std::path::Path;
use std::time::Duration;

const DECODE_STEPS: usize = 64;
const REPS: usize = 20;
const LONG_PROMPT: usize = 512;

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// A fixed pseudo-random prompt of `n` ids (bos first), the same on every run.
fn long_prompt(n: usize, vocab: usize) -> Vec<u32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut ids = vec![1u32];
    ids.extend((1..n).map(|_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        3 + (s % (vocab as u64 - 3)) as u32
    }));
    ids
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny_llama");
    let model = Llama::load(&dir)?;
    let c = model.cfg.clone();
    let ids: Vec<u32> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let prompts: Vec<Vec<u32>> = if ids.is_empty() {
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
        let mut p: Vec<Vec<u32>> = reference["prompts"]
            .as_array()
            .ok_or("reference.json: no prompts")?
            .iter()
            .map(|p| {
                p["prompt_ids"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|t| t.as_u64())
                    .map(|t| t as u32)
                    .collect()
            })
            .collect();
        p.push(long_prompt(LONG_PROMPT, c.vocab));
        p
    } else {
        vec![ids]
    };
    let cache =
        |len: usize| Dense::<f32>::new(c.layers, 1, c.kv_heads, len + DECODE_STEPS + 1, c.head_dim);
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        for prompt in &prompts {
            let prompt = std::slice::from_ref(prompt);
            let n = prompt[0].len();
            let (mut prefill, mut decode) = (vec![], vec![]);
            let (mut attn_prefill, mut attn_decode) = (vec![], vec![]);
            let mut tokens = vec![];
            for _ in 0..REPS + 2 {
                let mut kv = cache(n)?;
                let mut prof = GenProfile::default();
                let gens = pool.install(|| {
                    model.generate(prompt, DECODE_STEPS + 1, &mut kv, Par::Rayon, &mut prof)
                })?;
                tokens = gens[0].tokens.clone();
                prefill.push(prof.prefill.total);
                decode.push(prof.decode.total);
                attn_prefill
                    .push(prof.prefill.attention.as_secs_f64() / prof.prefill.total.as_secs_f64());
                attn_decode
                    .push(prof.decode.attention.as_secs_f64() / prof.decode.total.as_secs_f64());
            }
            let (p, d) = (median(prefill[2..].to_vec()), median(decode[2..].to_vec()));
            let share = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (sp, sd) = (share(attn_prefill), share(attn_decode));
            let (ptok, dtok) = (
                n as f64 / p.as_secs_f64(),
                DECODE_STEPS as f64 / d.as_secs_f64(),
            );
            if json {
                println!(
                    "{{\"model\":\"llama\",\"impl\":\"attnkit\",\"threads\":{threads},\"prompt_len\":{n},\"prefill_tok_s\":{ptok:.1},\"decode_tok_s\":{dtok:.1},\"prefill_attn_share\":{sp:.4},\"decode_attn_share\":{sd:.4}}}"
                );
            } else {
                println!(
                    "{threads} thread(s), prompt of {n}: prefill {ptok:.0} tok/s ({:.0}% in attention), decode {dtok:.0} tok/s ({:.0}% in attention); first tokens {:?}",
                    100.0 * sp,
                    100.0 * sd,
                    &tokens[..8.min(tokens.len())]
                );
            }
        }
    }
    Ok(())
}
