//! all-MiniLM-L6-v2 through attnkit against sentence-transformers' embeddings of the same padded
//! batches (`tests/data/minilm_reference.json`, from `scripts/minilm_reference.py`). The model
//! comes from `scripts/fetch_minilm.sh` (README's test command runs it); without it the test
//! fails and says so.

use attnkit::Par;
use attnkit_models::bert::{cosine, SentenceEncoder};
use attnkit_models::Profile;
use serde_json::Value;
use std::path::PathBuf;

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("ATTNKIT_MINILM_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("weights/all-MiniLM-L6-v2"),
        PathBuf::from,
    );
    assert!(
        dir.join("model.safetensors").exists(),
        "all-MiniLM-L6-v2 is not in {}: run `bash scripts/fetch_minilm.sh` (or set ATTNKIT_MINILM_DIR)",
        dir.display()
    );
    dir
}

fn reference() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/minilm_reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn sentences(batch: &Value) -> Vec<&str> {
    batch["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect()
}

#[test]
fn embeddings_equal_sentence_transformers() {
    let enc = SentenceEncoder::load(&model_dir()).unwrap();
    let e = enc.bert.cfg.hidden;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let reference = reference();
    let (mut worst_err, mut worst_cos) = (0.0f32, 1.0f32);
    for (bi, batch) in reference["batches"].as_array().unwrap().iter().enumerate() {
        let sents = sentences(batch);
        let tokens = enc.tokenize(&sents).unwrap();
        // The tokenizer crate on the model's tokenizer.json: the ids transformers fed the model.
        let want_ids: Vec<u32> = batch["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
            })
            .collect();
        assert_eq!(tokens.ids, want_ids, "batch {bi}: token ids");
        let want_lens: Vec<usize> = batch["attention_mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .filter(|x| x.as_u64() == Some(1))
                    .count()
            })
            .collect();
        assert_eq!(tokens.lens, want_lens, "batch {bi}: lengths");
        assert!(
            tokens.lens.iter().any(|&n| n < tokens.len),
            "batch {bi} has no padding"
        );

        let seq = enc
            .embed_batch(&tokens, Par::Seq, &mut Profile::default())
            .unwrap();
        let par = pool.install(|| enc.embed_batch(&tokens, Par::Rayon, &mut Profile::default()));
        assert_eq!(seq, par.unwrap(), "batch {bi}: threads changed the result");
        for (s, (got, want)) in seq
            .chunks_exact(e)
            .zip(batch["embeddings"].as_array().unwrap())
            .enumerate()
        {
            let want = floats(want);
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let cos = cosine(got, &want);
            assert!(
                err <= 1e-4 && cos >= 0.99999,
                "batch {bi} sentence {s}: max abs {err:e}, cosine {cos}"
            );
            (worst_err, worst_cos) = (worst_err.max(err), worst_cos.min(cos));
        }
    }
    eprintln!(
        "MiniLM against sentence-transformers: max abs {worst_err:e}, min cosine {worst_cos}"
    );
}

/// Padding must not leak: a sentence embedded alone equals its row of a padded batch.
#[test]
fn padding_does_not_change_an_embedding() {
    let enc = SentenceEncoder::load(&model_dir()).unwrap();
    let e = enc.bert.cfg.hidden;
    let reference = reference();
    let sents = sentences(&reference["batches"][0]);
    let batch = enc.embed(&sents, Par::Seq).unwrap();
    for (s, row) in sents.iter().zip(batch.chunks_exact(e)) {
        let alone = enc.embed(&[s], Par::Seq).unwrap();
        let err = row
            .iter()
            .zip(&alone)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err <= 1e-5, "{s:?}: alone and padded differ by {err:e}");
    }
}
