//! all-MiniLM-L6-v2 batch times with attnkit's attention, on 1 and 2 threads, as JSON lines in
//! the fields of `scripts/bench_models_torch.py`'s minilm rows (`scripts/bench_models.sh` runs
//! both, alternating).
//!
//! Batches: the three of `tests/data/minilm_reference.json`, and a fourth of 8 long texts (the
//! longest reference sentence repeated 1…8 times, truncated at 256 tokens) where attention
//! weighs more. Each figure is the median of `--reps` calls (default 20) after two warm-ups,
//! tokenisation excluded; `attn_share` is the median share of a call spent in `attnkit::sdpa`.

use attnkit::Par;
use attnkit_models::bert::SentenceEncoder;
use attnkit_models::Profile;
use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let reps: usize = match args.iter().position(|a| a == "--reps") {
        Some(i) => args.get(i + 1).ok_or("--reps N")?.parse()?,
        None => 20,
    };
    let dir = std::env::var_os("ATTNKIT_MINILM_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("weights/all-MiniLM-L6-v2"),
        PathBuf::from,
    );
    let enc = SentenceEncoder::load(&dir)?;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/minilm_reference.json");
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let mut batches: Vec<Vec<String>> = reference["batches"]
        .as_array()
        .ok_or("no batches")?
        .iter()
        .map(|b| {
            b["sentences"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .collect();
    let longest = batches
        .iter()
        .flatten()
        .max_by_key(|s| s.len())
        .ok_or("no sentences")?
        .clone();
    batches.push(
        (1..=8)
            .map(|k| vec![longest.as_str(); k].join(" "))
            .collect(),
    );

    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        for (i, sentences) in batches.iter().enumerate() {
            let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();
            let tokens = enc.tokenize(&refs)?;
            let (mut ms, mut attn, mut share) = (vec![], vec![], vec![]);
            for rep in 0..reps + 2 {
                let mut prof = Profile::default();
                pool.install(|| enc.embed_batch(&tokens, Par::Rayon, &mut prof))?;
                if rep >= 2 {
                    ms.push(prof.total.as_secs_f64() * 1e3);
                    attn.push(prof.attention.as_secs_f64() * 1e3);
                    share.push(prof.attention.as_secs_f64() / prof.total.as_secs_f64());
                }
            }
            let med = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            println!(
                "{{\"model\":\"minilm\",\"impl\":\"attnkit\",\"threads\":{threads},\"batch\":{i},\"B\":{},\"L\":{},\"ms\":{:.4},\"attn_ms\":{:.4},\"attn_share\":{:.4}}}",
                tokens.lens.len(),
                tokens.len,
                med(ms),
                med(attn),
                med(share)
            );
        }
    }
    Ok(())
}
