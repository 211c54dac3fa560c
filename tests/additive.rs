//! `AdditiveAttention` against the PyTorch golden (`tests/data/additive_attention`) on every
//! ISA, against an f64 reference of the whole layer (projections included) on random shapes
//! with masks and key lengths, the concat-form equivalence, the state dict round trip, and typed
//! errors.

mod common;

use attnkit::{
    AdditiveAttention, AdditiveDims, AdditiveOptions, AdditiveWeights, AttnError, AttnMask,
    MaskRef, Par, Tokens,
};
use common::{compare, isas, randn};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;

fn read(case: &str, file: &str, n: usize, size: usize) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(case)
        .join(file);
    let b = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert_eq!(b.len(), n * size, "{case}/{file}: expected {n} elements");
    b
}

fn f32s(name: &str, n: usize) -> Vec<f32> {
    read("additive_attention", &format!("{name}.f32"), n, 4)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f64s(name: &str, n: usize) -> Vec<f64> {
    read("additive_attention", &format!("{name}.f64"), n, 8)
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn check(tag: &str, got: &[f32], want: &[f64]) -> f64 {
    let (max, bad, first) = compare(got, want);
    assert_eq!(
        bad, 0,
        "{tag}: {bad} elements out of tolerance, first at {first:?} (max err {max:e})"
    );
    max
}

const B: usize = 2;
const LQ: usize = 5;
const LK: usize = 9;
const DQ: usize = 12;
const DK: usize = 10;
const DV: usize = 7;
const A: usize = 16;

fn golden_layer() -> AdditiveAttention {
    AdditiveAttention::new(&AdditiveWeights {
        dims: AdditiveDims {
            attn_dim: A,
            query_dim: DQ,
            key_dim: DK,
        },
        w_q: &f32s("W_q", A * DQ),
        w_k: &f32s("W_k", A * DK),
        bias: Some(&f32s("b", A)),
        v: &f32s("v", A),
    })
    .unwrap()
}

#[test]
fn golden_additive_attention() {
    let layer = golden_layer();
    let (q, k, v) = (
        f32s("query", B * LQ * DQ),
        f32s("keys", B * LK * DK),
        f32s("values", B * LK * DV),
    );
    let out = f64s("out", B * LQ * DV);
    let w = f64s("weights", B * LQ * LK);
    let s = f64s("scores", B * LQ * LK);
    // The same weights in the textbook concat form W = [W_q | W_k].
    let (wq, wk) = (f32s("W_q", A * DQ), f32s("W_k", A * DK));
    let concat: Vec<f32> = (0..A)
        .flat_map(|a| {
            wq[a * DQ..(a + 1) * DQ]
                .iter()
                .chain(&wk[a * DK..(a + 1) * DK])
                .copied()
        })
        .collect();
    let from_concat = AdditiveAttention::from_concat(
        AdditiveDims {
            attn_dim: A,
            query_dim: DQ,
            key_dim: DK,
        },
        &concat,
        Some(&f32s("b", A)),
        &f32s("v", A),
    )
    .unwrap();
    assert_eq!(from_concat, layer);
    let seq = |x: &[f32], l: usize, e: usize| -> Vec<f32> {
        let mut y = vec![0.0; x.len()];
        for bi in 0..B {
            for li in 0..l {
                y[(li * B + bi) * e..(li * B + bi + 1) * e]
                    .copy_from_slice(&x[(bi * l + li) * e..(bi * l + li + 1) * e]);
            }
        }
        y
    };
    let (qs, ks, vs) = (seq(&q, LQ, DQ), seq(&k, LK, DK), seq(&v, LK, DV));
    for isa in isas() {
        for par in [Par::Rayon, Par::Seq] {
            let y = layer
                .forward(
                    &Tokens::ble(&q, [B, LQ, DQ]),
                    &Tokens::ble(&k, [B, LK, DK]),
                    &Tokens::ble(&v, [B, LK, DV]),
                    &AdditiveOptions::new().isa(isa).par(par).outputs(true, true),
                )
                .unwrap();
            let e1 = check(&format!("additive {isa} out"), &y.out, &out);
            let e2 = check(
                &format!("additive {isa} weights"),
                y.weights.as_ref().unwrap(),
                &w,
            );
            let e3 = check(
                &format!("additive {isa} scores"),
                y.scores.as_ref().unwrap(),
                &s,
            );
            // Sequence-first inputs: output (Lq, B, Dv).
            let ys = layer
                .forward(
                    &Tokens::lbe(&qs, [LQ, B, DQ]),
                    &Tokens::lbe(&ks, [LK, B, DK]),
                    &Tokens::lbe(&vs, [LK, B, DV]),
                    &AdditiveOptions::new().isa(isa).par(par),
                )
                .unwrap();
            assert_eq!(ys.shape, [LQ, B, DV]);
            let want = seq(&y.out, LQ, DV);
            if cfg!(feature = "blas") {
                // OpenBLAS may block a GEMM differently for other strides (seen with its
                // SkylakeX kernels): the same numbers up to rounding.
                for (i, (g, w)) in ys.out.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-6 + 1e-6 * w.abs(),
                        "{isa}: seq-first out[{i}] {g} vs {w}"
                    );
                }
            } else {
                // Our kernels and matrixmultiply do not depend on the strides: bitwise.
                assert_eq!(ys.out, want, "{isa}: seq-first must be the same numbers");
            }
            if par == Par::Rayon {
                eprintln!("additive_attention {isa}: max err out {e1:.2e}, weights {e2:.2e}, scores {e3:.2e}");
            }
        }
    }
}

/// The whole layer in f64: projections, exact tanh, masks, softmax, weighted values.
#[allow(clippy::too_many_arguments)]
fn reference(
    wq: &[f32],
    wk: &[f32],
    bias: &[f32],
    wv: &[f32],
    (a, dq, dk, dv): (usize, usize, usize, usize),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (b, lq, lk): (usize, usize, usize),
    visible: &dyn Fn(usize, usize, usize) -> Option<f64>,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; b * lq * dv];
    let mut w = vec![0.0; b * lq * lk];
    for bi in 0..b {
        let qp: Vec<f64> = (0..lq * a)
            .map(|t| {
                let (i, x) = (t / a, t % a);
                bias[x] as f64
                    + (0..dq)
                        .map(|p| wq[x * dq + p] as f64 * q[(bi * lq + i) * dq + p] as f64)
                        .sum::<f64>()
            })
            .collect();
        let kp: Vec<f64> = (0..lk * a)
            .map(|t| {
                let (j, x) = (t / a, t % a);
                (0..dk)
                    .map(|p| wk[x * dk + p] as f64 * k[(bi * lk + j) * dk + p] as f64)
                    .sum::<f64>()
            })
            .collect();
        for i in 0..lq {
            let s: Vec<f64> = (0..lk)
                .map(|j| match visible(bi, i, j) {
                    None => f64::NEG_INFINITY,
                    Some(add) => {
                        add + (0..a)
                            .map(|x| wv[x] as f64 * (qp[i * a + x] + kp[j * a + x]).tanh())
                            .sum::<f64>()
                    }
                })
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if mx == f64::NEG_INFINITY {
                continue;
            }
            let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
            for j in 0..lk {
                let p = (s[j] - mx).exp() / z;
                w[(bi * lq + i) * lk + j] = p;
                for c in 0..dv {
                    out[(bi * lq + i) * dv + c] += p * v[(bi * lk + j) * dv + c] as f64;
                }
            }
        }
    }
    (out, w)
}

#[test]
fn random_shapes_match_f64_reference() {
    let mut rng = SmallRng::seed_from_u64(31);
    // (B, Lq, Lk, Dq, Dk, Dv, A)
    let shapes = [
        (1, 1, 1, 1, 1, 1, 1),
        (2, 3, 17, 5, 6, 7, 9),
        (3, 20, 33, 16, 8, 24, 32),
        (1, 40, 300, 32, 32, 16, 64),
        (2, 17, 129, 8, 12, 40, 17),
    ];
    for (n, &(b, lq, lk, dq, dk, dv, a)) in shapes.iter().enumerate() {
        let wq = randn(&mut rng, a * dq, 0.3);
        let wk = randn(&mut rng, a * dk, 0.3);
        let bias = randn(&mut rng, a, 0.1);
        let wv = randn(&mut rng, a, 1.0 / (a as f32).sqrt());
        let layer = AdditiveAttention::new(&AdditiveWeights {
            dims: AdditiveDims {
                attn_dim: a,
                query_dim: dq,
                key_dim: dk,
            },
            w_q: &wq,
            w_k: &wk,
            bias: Some(&bias),
            v: &wv,
        })
        .unwrap();
        let q = randn(&mut rng, b * lq * dq, 1.0);
        let k = randn(&mut rng, b * lk * dk, 1.0);
        let v = randn(&mut rng, b * lk * dv, 1.0);
        let lens: Vec<usize> = (0..b)
            .map(|i| if i == 0 { lk } else { rng.gen_range(0..=lk) })
            .collect();
        let mask: Vec<bool> = (0..b * lq * lk).map(|_| rng.gen_bool(0.8)).collect();
        let bias_mask = randn(&mut rng, lq * lk, 1.0);
        let dims = (a, dq, dk, dv);
        let sizes = (b, lq, lk);
        type Vis<'m> = Box<dyn Fn(usize, usize, usize) -> Option<f64> + 'm>;
        let variants: Vec<(&str, AdditiveOptions, Vis)> = vec![
            (
                "plain",
                AdditiveOptions::new(),
                Box::new(|_, _, _| Some(0.0)),
            ),
            (
                "lengths+mask",
                AdditiveOptions::new()
                    .key_lengths(&lens)
                    .mask(AttnMask::Bool(MaskRef::new(&mask, [b, 1, lq, lk]))),
                Box::new(|bi, i, j| (j < lens[bi] && mask[(bi * lq + i) * lk + j]).then_some(0.0)),
            ),
            (
                "bias",
                AdditiveOptions::new()
                    .mask(AttnMask::Bias(MaskRef::new(&bias_mask, [1, 1, lq, lk]))),
                Box::new(|_, i, j| Some(bias_mask[i * lk + j] as f64)),
            ),
        ];
        for (name, opts, vis) in &variants {
            let (want, want_w) =
                reference(&wq, &wk, &bias, &wv, dims, &q, &k, &v, sizes, vis.as_ref());
            for isa in isas() {
                let y = layer
                    .forward(
                        &Tokens::ble(&q, [b, lq, dq]),
                        &Tokens::ble(&k, [b, lk, dk]),
                        &Tokens::ble(&v, [b, lk, dv]),
                        &opts.isa(isa).outputs(true, false),
                    )
                    .unwrap();
                check(&format!("shape {n} {name} {isa} out"), &y.out, &want);
                check(
                    &format!("shape {n} {name} {isa} weights"),
                    y.weights.as_ref().unwrap(),
                    &want_w,
                );
            }
        }
    }
}

#[test]
fn parallel_equals_sequential_bitwise() {
    let mut rng = SmallRng::seed_from_u64(3);
    let (b, lq, lk, d, a) = (2, 70, 300, 32, 48);
    let layer = AdditiveAttention::new(&AdditiveWeights {
        dims: AdditiveDims {
            attn_dim: a,
            query_dim: d,
            key_dim: d,
        },
        w_q: &randn(&mut rng, a * d, 0.3),
        w_k: &randn(&mut rng, a * d, 0.3),
        bias: None,
        v: &randn(&mut rng, a, 0.3),
    })
    .unwrap();
    let (q, k) = (
        randn(&mut rng, b * lq * d, 1.0),
        randn(&mut rng, b * lk * d, 1.0),
    );
    let (qt, kt) = (Tokens::ble(&q, [b, lq, d]), Tokens::ble(&k, [b, lk, d]));
    let run = |par: Par, threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            layer
                .forward(
                    &qt,
                    &kt,
                    &kt,
                    &AdditiveOptions::new().par(par).outputs(true, true),
                )
                .unwrap()
        })
    };
    let seq = run(Par::Seq, 1);
    for threads in [1, 2, 3] {
        assert_eq!(run(Par::Rayon, threads), seq, "{threads} threads");
    }
}

#[test]
#[cfg(feature = "safetensors")]
fn state_dict_round_trip_and_errors() {
    let layer = golden_layer();
    let bytes = layer.state_dict("attention").to_safetensors().unwrap();
    let sd = attnkit::StateDict::from_safetensors(&bytes).unwrap();
    assert_eq!(
        AdditiveAttention::from_state_dict(&sd, "attention").unwrap(),
        layer
    );
    // d2l layout: w_v as (1, A) with no biases; a (A,) vector is accepted too.
    let mut sd2 = sd.clone();
    let (_, v) = sd.tensor("attention.w_v.weight").unwrap();
    sd2.insert("attention.w_v.weight", &[A], &v).unwrap();
    assert_eq!(
        AdditiveAttention::from_state_dict(&sd2, "attention").unwrap(),
        layer
    );
    // Errors name the tensor and both shapes.
    let mut bad = sd.clone();
    bad.remove("attention.W_k.weight");
    assert_eq!(
        AdditiveAttention::from_state_dict(&bad, "attention").unwrap_err(),
        AttnError::MissingTensor {
            name: "attention.W_k.weight".into()
        }
    );
    let mut bad = sd.clone();
    bad.insert("attention.W_k.weight", &[15, DK], &vec![0.0; 15 * DK])
        .unwrap();
    assert_eq!(
        AdditiveAttention::from_state_dict(&bad, "attention").unwrap_err(),
        AttnError::WeightShape {
            name: "attention.W_k.weight".into(),
            expected: vec![A, DK],
            got: vec![15, DK]
        }
    );
    let mut bad = sd.clone();
    bad.insert("attention.W_q.bias", &[A + 1], &[0.0; A + 1])
        .unwrap();
    assert_eq!(
        AdditiveAttention::from_state_dict(&bad, "attention").unwrap_err(),
        AttnError::WeightShape {
            name: "attention.W_q.bias".into(),
            expected: vec![A],
            got: vec![A + 1]
        }
    );
    assert_eq!(
        AdditiveAttention::new(&AdditiveWeights {
            dims: AdditiveDims {
                attn_dim: 2,
                query_dim: 2,
                key_dim: 2
            },
            w_q: &[0.0; 3],
            w_k: &[0.0; 4],
            bias: None,
            v: &[0.0; 2]
        })
        .unwrap_err(),
        AttnError::WeightShape {
            name: "W_q".into(),
            expected: vec![2, 2],
            got: vec![3]
        }
    );
}

#[test]
fn bad_inputs_are_typed_errors() {
    let layer = golden_layer();
    let (q, k, v) = (
        vec![0.0f32; B * LQ * DQ],
        vec![0.0f32; B * LK * DK],
        vec![0.0f32; B * LK * DV],
    );
    let (qt, kt, vt) = (
        Tokens::ble(&q, [B, LQ, DQ]),
        Tokens::ble(&k, [B, LK, DK]),
        Tokens::ble(&v, [B, LK, DV]),
    );
    let o = AdditiveOptions::new();
    assert_eq!(
        layer.forward(&kt, &kt, &vt, &o).unwrap_err(),
        AttnError::ShapeMismatch {
            arg: "queries",
            dim: "E",
            expected: DQ,
            got: DK
        }
    );
    let v_short = Tokens::ble(&v[..B * 4 * DV], [B, 4, DV]);
    assert_eq!(
        layer.forward(&qt, &kt, &v_short, &o).unwrap_err(),
        AttnError::ShapeMismatch {
            arg: "values",
            dim: "L",
            expected: LK,
            got: 4
        }
    );
    assert_eq!(
        layer
            .forward(&qt, &kt, &vt, &o.key_lengths(&[9, 10]))
            .unwrap_err(),
        AttnError::KeyLength {
            batch: 1,
            len: 10,
            lk: 9
        }
    );
    assert_eq!(
        layer
            .forward(&qt, &kt, &vt, &o.key_lengths(&[9]))
            .unwrap_err(),
        AttnError::InputShape {
            arg: "key_lengths",
            expected: vec![2],
            got: vec![1]
        }
    );
    let m = vec![true; B * 2 * LQ * LK];
    assert_eq!(
        layer
            .forward(
                &qt,
                &kt,
                &vt,
                &o.mask(AttnMask::Bool(MaskRef::new(&m, [B, 2, LQ, LK])))
            )
            .unwrap_err(),
        AttnError::InputShape {
            arg: "mask",
            expected: vec![B, 1, LQ, LK],
            got: vec![B, 2, LQ, LK]
        }
    );
    assert!(matches!(
        layer
            .forward(
                &qt,
                &kt,
                &vt,
                &o.mask(AttnMask::Bool(MaskRef::new(&m[..5], [1, 1, 1, LK])))
            )
            .unwrap_err(),
        AttnError::BufferLength {
            arg: "mask",
            needed: 9,
            got: 5
        }
    ));
    let mut out = vec![0.0f32; 3];
    assert!(matches!(
        layer
            .forward_into(&qt, &kt, &vt, &mut out, None, None, &o)
            .unwrap_err(),
        AttnError::BufferLength { arg: "out", .. }
    ));
    // Fully masked rows give zeros, never NaN.
    let lens = [0usize, 3];
    let y = layer
        .forward(&qt, &kt, &vt, &o.key_lengths(&lens).outputs(true, true))
        .unwrap();
    assert!(y.out[..LQ * DV].iter().all(|&x| x == 0.0));
    assert!(y.weights.unwrap()[..LQ * LK].iter().all(|&x| x == 0.0));
    assert!(y.scores.unwrap()[..LQ * LK]
        .iter()
        .all(|&x| x == f32::NEG_INFINITY));
}

/// The additive layer's backward (#17): every input's and parameter's gradient against central
/// finite differences of an f64 forward written here (`vᵀ·tanh(W_q·q + b + W_k·k)`, softmax over
/// the valid keys, weights·V), with key lengths (one batch short), both biases, and a
/// sequence-first query.
#[test]
fn additive_backward_matches_finite_differences() {
    use attnkit::AdditiveOptions;
    let (b, lq, lk, dq, dk, dv, a) = (2, 5, 7, 6, 4, 3, 8);
    let lens = [7usize, 4];
    // Values on a grid of 1/64: exact in f32, so both sides start from the same numbers.
    let grid = |n: usize, seed: usize| -> Vec<f64> {
        (0..n)
            .map(|i| (((i * 37 + seed * 101) % 97) as f64 - 48.0) / 64.0)
            .collect()
    };
    let (wq, wk, bq, bk, v) = (
        grid(a * dq, 1),
        grid(a * dk, 2),
        grid(a, 3),
        grid(a, 4),
        grid(a, 5),
    );
    let (q, k, vals, dy) = (
        grid(b * lq * dq, 6),
        grid(b * lk * dk, 7),
        grid(b * lk * dv, 8),
        grid(b * lq * dv, 9),
    );
    // The loss Σ out·dy in f64; the query is batch-first here.
    let loss = |p: &[Vec<f64>; 8]| -> f64 {
        let [wq, wk, bq, bk, v, q, k, vals] = p;
        let mut total = 0.0;
        for bi in 0..b {
            for i in 0..lq {
                let s: Vec<f64> = (0..lens[bi])
                    .map(|j| {
                        (0..a)
                            .map(|c| {
                                let x: f64 = (0..dq)
                                    .map(|e| wq[c * dq + e] * q[(bi * lq + i) * dq + e])
                                    .sum::<f64>()
                                    + (0..dk)
                                        .map(|e| wk[c * dk + e] * k[(bi * lk + j) * dk + e])
                                        .sum::<f64>()
                                    + bq[c]
                                    + bk[c];
                                v[c] * x.tanh()
                            })
                            .sum()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for c in 0..dv {
                    let o: f64 = s
                        .iter()
                        .enumerate()
                        .map(|(j, x)| (x - m).exp() / z * vals[(bi * lk + j) * dv + c])
                        .sum();
                    total += o * dy[(bi * lq + i) * dv + c];
                }
            }
        }
        total
    };
    let f = |x: &[f64]| -> Vec<f32> { x.iter().map(|&y| y as f32).collect() };
    let (wq32, wk32, bq32, bk32, v32) = (f(&wq), f(&wk), f(&bq), f(&bk), f(&v));
    let mut sd = attnkit::StateDict::new();
    sd.insert("W_q.weight", &[a, dq], &wq32).unwrap();
    sd.insert("W_k.weight", &[a, dk], &wk32).unwrap();
    sd.insert("W_q.bias", &[a], &bq32).unwrap();
    sd.insert("W_k.bias", &[a], &bk32).unwrap();
    sd.insert("w_v.weight", &[1, a], &v32).unwrap();
    let layer = AdditiveAttention::from_state_dict(&sd, "").unwrap();
    // The query sequence-first: (Lq, B, Dq) memory.
    let q32 = f(&q);
    let mut qs = vec![0.0f32; q32.len()];
    for bi in 0..b {
        for i in 0..lq {
            qs[(i * b + bi) * dq..][..dq].copy_from_slice(&q32[(bi * lq + i) * dq..][..dq]);
        }
    }
    let (k32, v32s, dy32) = (f(&k), f(&vals), f(&dy));
    let mut dys = vec![0.0f32; dy32.len()];
    for bi in 0..b {
        for i in 0..lq {
            dys[(i * b + bi) * dv..][..dv].copy_from_slice(&dy32[(bi * lq + i) * dv..][..dv]);
        }
    }
    let opts = AdditiveOptions::new().key_lengths(&lens);
    let (y, tape) = layer
        .forward_train(
            &Tokens::lbe(&qs, [lq, b, dq]),
            &Tokens::ble(&k32, [b, lk, dk]),
            &Tokens::ble(&v32s, [b, lk, dv]),
            &opts,
        )
        .unwrap();
    assert_eq!(y.shape, [lq, b, dv]);
    let g = layer.backward(&tape, &dys).unwrap();
    // Back to batch-first for the comparison.
    let mut dq_bf = vec![0.0f32; g.dquery.len()];
    for bi in 0..b {
        for i in 0..lq {
            dq_bf[(bi * lq + i) * dq..][..dq].copy_from_slice(&g.dquery[(i * b + bi) * dq..][..dq]);
        }
    }
    let params = [wq, wk, bq, bk, v, q, k, vals];
    let names = [
        "W_q.weight",
        "W_k.weight",
        "W_q.bias",
        "W_k.bias",
        "w_v.weight",
    ];
    let mut worst = 0.0f64;
    for (t, grad) in [
        g.params.tensor(names[0]).unwrap().1,
        g.params.tensor(names[1]).unwrap().1,
        g.params.tensor(names[2]).unwrap().1,
        g.params.tensor(names[3]).unwrap().1,
        g.params.tensor(names[4]).unwrap().1,
        dq_bf,
        g.dkey.clone(),
        g.dvalue.clone(),
    ]
    .into_iter()
    .enumerate()
    {
        let n = grad.len();
        assert_eq!(n, params[t].len(), "tensor {t}");
        for idx in (0..n).step_by(n / 9 + 1) {
            let h = 1e-5;
            let mut up = params.clone();
            up[t][idx] += h;
            let mut down = params.clone();
            down[t][idx] -= h;
            let fd = (loss(&up) - loss(&down)) / (2.0 * h);
            let err = (grad[idx] as f64 - fd).abs();
            worst = worst.max(err / (1.0 + fd.abs()));
            assert!(
                err <= 1e-5 * (1.0 + fd.abs()),
                "tensor {t} [{idx}]: {} vs finite difference {fd}",
                grad[idx]
            );
        }
    }
    eprintln!("worst gap to finite differences: {worst:e}");
}
