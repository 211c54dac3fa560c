//! A Llama-architecture decoder (random weights made by transformers, `tests/data/tiny_llama`)
//! prefilled and decoded through attnkit, against transformers' logits and greedy tokens
//! (`reference.json`, from `scripts/llama_reference.py`). Both prompts (7 and 12 tokens) run
//! as one ragged batch, over the dense and the paged caches in every storage type.

use attnkit::{bf16, f16, Par};
use attnkit_models::cache::{Dense, KvStore, Paged};
use attnkit_models::llama::{GenProfile, Generation, Llama};
use attnkit_models::ops::argmax;
use attnkit_models::Profile;
use serde_json::Value;
use std::path::Path;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tiny_llama");

struct Reference {
    prompts: Vec<Vec<u32>>,
    prefill_logits: Vec<Vec<f32>>,
    tokens: Vec<Vec<u32>>,
    step_logits: Vec<Vec<f32>>,
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(Path::new(DIR).join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ints = |x: &Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    let rows = |x: &Value| -> Vec<f32> {
        x.as_array()
            .unwrap()
            .iter()
            .flat_map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_f64().unwrap() as f32)
            })
            .collect()
    };
    let p = v["prompts"].as_array().unwrap();
    Reference {
        prompts: p.iter().map(|p| ints(&p["prompt_ids"])).collect(),
        prefill_logits: p.iter().map(|p| rows(&p["prefill_logits"])).collect(),
        tokens: p.iter().map(|p| ints(&p["generated_ids"])).collect(),
        step_logits: p.iter().map(|p| rows(&p["step_logits"])).collect(),
    }
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Generates with `cache`; returns the largest logit error against transformers over the
/// prefill and every step, after checking the greedy tokens.
fn run(model: &Llama, r: &Reference, cache: &mut impl KvStore, par: Par, what: &str) -> f32 {
    let steps = r.tokens[0].len();
    let gens: Vec<Generation> = model
        .generate(&r.prompts, steps, cache, par, &mut GenProfile::default())
        .unwrap();
    let mut err = 0.0f32;
    for (i, g) in gens.iter().enumerate() {
        assert_eq!(g.tokens, r.tokens[i], "{what}: prompt {i}'s greedy tokens");
        err = err
            .max(max_abs(&g.prefill_logits, &r.prefill_logits[i]))
            .max(max_abs(&g.step_logits, &r.step_logits[i]));
    }
    err
}

#[test]
fn f32_caches_equal_transformers() {
    let model = Llama::load(Path::new(DIR)).unwrap();
    let r = reference();
    let c = model.cfg.clone();
    let (b, cap) = (r.prompts.len(), 64);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for par in [Par::Seq, Par::Rayon] {
        let mut dense = Dense::<f32>::new(c.layers, b, c.kv_heads, cap, c.head_dim).unwrap();
        let err = pool.install(|| run(&model, &r, &mut dense, par, "dense f32"));
        eprintln!("dense f32 cache, {par:?}: max logit error {err:e}");
        assert!(err <= 1e-4, "dense f32 cache: logits off by {err:e}");
        // Pages of 4 tokens: the prompts and continuations span several, and a padded prefill
        // is cut back inside a page.
        let mut paged = Paged::<f32>::new(c.layers, b, c.kv_heads, c.head_dim, 4, 32).unwrap();
        let err = pool.install(|| run(&model, &r, &mut paged, par, "paged f32"));
        eprintln!("paged f32 cache, {par:?}: max logit error {err:e}");
        assert!(err <= 1e-4, "paged f32 cache: logits off by {err:e}");
    }
}

/// Teacher-forced decoding: transformers' tokens fed in at every step, so that each step's
/// logits compare with the reference's even where a cache would have chosen differently.
/// Returns the largest logit error and how many steps' argmax still equal transformers' token.
fn teacher_forced(model: &Llama, r: &Reference, cache: &mut impl KvStore) -> (f32, usize) {
    let v = model.cfg.vocab;
    let mut prof = Profile::default();
    let prefill = model
        .prefill(&r.prompts, cache, Par::Seq, &mut prof)
        .unwrap();
    let mut err = 0.0f32;
    let mut agree = 0;
    let mut positions: Vec<usize> = r.prompts.iter().map(Vec::len).collect();
    let mut last: Vec<Vec<f32>> = prefill.iter().map(|p| p[p.len() - v..].to_vec()).collect();
    for (i, p) in prefill.iter().enumerate() {
        err = err.max(max_abs(p, &r.prefill_logits[i]));
    }
    for step in 0..r.tokens[0].len() {
        for (i, l) in last.iter().enumerate() {
            err = err.max(max_abs(l, &r.step_logits[i][step * v..][..v]));
            agree += usize::from(argmax(l) as u32 == r.tokens[i][step]);
        }
        let tokens: Vec<u32> = r.tokens.iter().map(|t| t[step]).collect();
        let logits = model
            .decode(&tokens, &positions, cache, Par::Seq, &mut prof)
            .unwrap();
        for (l, row) in last.iter_mut().zip(logits.chunks_exact(v)) {
            l.copy_from_slice(row);
        }
        positions.iter_mut().for_each(|p| *p += 1);
    }
    (err, agree)
}

/// 16- and 8-bit caches round the keys and values the decode steps read (the prefill attends
/// in f32), so their logits are compared teacher-forced. The 16-bit caches keep every greedy
/// choice (transformers' smallest top-1/top-2 margin on these prompts is 0.127) and generate
/// transformers' tokens; int8's per-row rounding on this random-weight model moves logits by
/// more than some margins, so its error and agreement are reported, not asserted.
#[test]
fn low_precision_caches() {
    let model = Llama::load(Path::new(DIR)).unwrap();
    let r = reference();
    let c = model.cfg.clone();
    let (b, cap, l) = (r.prompts.len(), 64, c.layers);
    let (h, d) = (c.kv_heads, c.head_dim);
    let steps = r.prompts.len() * r.tokens[0].len();
    let results = [
        (
            "dense bf16",
            teacher_forced(
                &model,
                &r,
                &mut Dense::<bf16>::new(l, b, h, cap, d).unwrap(),
            ),
        ),
        (
            "dense f16",
            teacher_forced(&model, &r, &mut Dense::<f16>::new(l, b, h, cap, d).unwrap()),
        ),
        (
            "paged bf16",
            teacher_forced(
                &model,
                &r,
                &mut Paged::<bf16>::new(l, b, h, d, 4, 32).unwrap(),
            ),
        ),
        (
            "dense int8",
            teacher_forced(&model, &r, &mut Dense::<i8>::new(l, b, h, cap, d).unwrap()),
        ),
        (
            "paged int8",
            teacher_forced(
                &model,
                &r,
                &mut Paged::<i8>::new(l, b, h, d, 4, 32).unwrap(),
            ),
        ),
    ];
    for (what, (err, agree)) in results {
        eprintln!(
            "{what} cache, teacher-forced: max logit error {err:e}, argmax agrees {agree}/{steps}"
        );
        if !what.ends_with("int8") {
            assert_eq!(agree, steps, "{what}: a greedy choice changed");
        }
    }
    // Free-running, the 16-bit caches generate transformers' tokens.
    run(
        &model,
        &r,
        &mut Dense::<bf16>::new(l, b, h, cap, d).unwrap(),
        Par::Seq,
        "dense bf16",
    );
    run(
        &model,
        &r,
        &mut Dense::<f16>::new(l, b, h, cap, d).unwrap(),
        Par::Seq,
        "dense f16",
    );
    run(
        &model,
        &r,
        &mut Paged::<bf16>::new(l, b, h, d, 4, 32).unwrap(),
        Par::Seq,
        "paged bf16",
    );
}
