//! Embeds the sentences given on the command line with all-MiniLM-L6-v2 (attention by attnkit)
//! and prints their cosine similarities.
//!
//! `bash scripts/fetch_minilm.sh && cargo run --release -p attnkit-models --example embed -- \
//!     "A man is eating food." "A man eats a meal." "The sky is blue."`
//!
//! The model folder is `models/weights/all-MiniLM-L6-v2`, or `ATTNKIT_MINILM_DIR`.

use attnkit::Par;
use attnkit_models::bert::{cosine, SentenceEncoder};
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::var_os("ATTNKIT_MINILM_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("weights/all-MiniLM-L6-v2"),
        PathBuf::from,
    );
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sentences: Vec<&str> = if args.is_empty() {
        vec![
            "A man is eating food.",
            "A man eats a meal.",
            "The sky is blue today.",
        ]
    } else {
        args.iter().map(String::as_str).collect()
    };
    let enc = SentenceEncoder::load(&dir)?;
    let e = enc.bert.cfg.hidden;
    let emb = enc.embed(&sentences, Par::Rayon)?;
    println!("cosine similarities:");
    for (i, a) in emb.chunks_exact(e).enumerate() {
        let row: Vec<String> = emb
            .chunks_exact(e)
            .map(|b| format!("{:6.3}", cosine(a, b)))
            .collect();
        println!("{} | {:?}", row.join(" "), sentences[i]);
    }
    Ok(())
}
