//! `KvCache<i8>` and `sdpa_int8`: each appended row quantised symmetrically with its own scale,
//! and attention equal to the f64 reference on the dequantised values within 1e-5 (the kernels
//! add no error of their own) on every ISA and kernel, with ragged lengths, GQA, a window,
//! 16-bit queries and outputs. A NaN or infinity is refused and changes nothing; bad scales
//! are typed errors.

mod common;

use attnkit::{
    bf16, sdpa, sdpa_int8, AttnError, Causal, Kernel, KvCache, Par, SdpaOptions, Tensor, TensorMut,
};
use common::{compare, isas, randn, reference, Dims, Problem, RefMask};
use rand::rngs::SmallRng;
use rand::SeedableRng;

/// `(B, Hq, Hkv, D, Dv, capacity)`: one element; GQA with odd sizes; a decode-sized head.
const SHAPES: [[usize; 6]; 3] = [
    [1, 1, 1, 1, 1, 4],
    [2, 6, 2, 5, 7, 40],
    [1, 8, 2, 128, 64, 700],
];

/// The dequantised `(B, Hkv, L, width)` rows of a cache view and its scales, dense.
fn dequantised(t: Tensor<i8>, scales: &[f32], cap: usize) -> Vec<f32> {
    let ([b, h, l, w], data, st) = (t.shape(), t.data(), t.strides());
    let mut out = Vec::with_capacity(b * h * l * w);
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                let s = scales[(bi * h + hi) * cap + li];
                let o = bi * st[0] + hi * st[1] + li * st[2];
                out.extend(data[o..o + w].iter().map(|&q| s * f32::from(q)));
            }
        }
    }
    out
}

/// A cache filled in three appends of N(0, 1) rows (one token of every sequence, then halves),
/// with a few outlier channels in the keys, and sequence 1 truncated so lengths differ.
fn filled(rng: &mut SmallRng, s: [usize; 6]) -> KvCache<i8> {
    let [b, _, hkv, d, dv, cap] = s;
    let mut c = KvCache::<i8>::new_of(b, hkv, cap, d, dv).unwrap();
    for t in [1, cap / 2, cap - cap / 2 - 1] {
        let mut k = randn(rng, b * hkv * t * d, 1.0);
        for (i, x) in k.iter_mut().enumerate() {
            if i % d == d / 3 {
                *x *= 20.0;
            }
        }
        let v = randn(rng, b * hkv * t * dv, 1.0);
        c.append(
            &Tensor::bhld(&k, [b, hkv, t, d]),
            &Tensor::bhld(&v, [b, hkv, t, dv]),
        )
        .unwrap();
    }
    if b > 1 {
        let l = c.lens()[1] * 2 / 3;
        c.truncate(1, l).unwrap();
    }
    c
}

#[test]
fn int8_cache_equals_f64_on_dequantised_values() {
    let mut rng = SmallRng::seed_from_u64(11);
    for s in SHAPES {
        let [b, hq, hkv, d, dv, cap] = s;
        let c = filled(&mut rng, s);
        let kd = dequantised(c.keys(), c.key_scales(), cap);
        let vd = dequantised(c.values(), c.value_scales(), cap);
        let lk = c.keys().shape()[2];
        for lq in [1, 3, 9] {
            let q = randn(&mut rng, b * hq * lq * d, 1.0);
            let qh: Vec<bf16> = q.iter().map(|&x| bf16::from_f32(x)).collect();
            let qhf: Vec<f32> = qh.iter().map(|x| x.to_f32()).collect();
            for window in [None, Some(5)] {
                let want = |q: &[f32]| {
                    reference(&Problem {
                        dims: Dims {
                            b,
                            hq,
                            hkv,
                            lq,
                            lk,
                            d,
                            dv,
                        },
                        q,
                        k: &kd,
                        v: &vd,
                        scale: 1.0 / (d as f64).sqrt(),
                        causal: Some(Causal::BottomRight),
                        window,
                        mask: RefMask::None,
                        key_lengths: Some(c.lens()),
                        alibi: None,
                        softcap: None,
                        sinks: None,
                    })
                    .out
                };
                let (want32, want16) = (want(&q), want(&qhf));
                for isa in isas() {
                    for kernel in [Kernel::Auto, Kernel::Prefill, Kernel::Decode] {
                        let mut opts = SdpaOptions::new().isa(isa).kernel(kernel);
                        if let Some(w) = window {
                            opts = opts.window(w);
                        }
                        let what = format!("{s:?} lq={lq} {isa} {kernel:?} {window:?}");
                        let oshape = [b, hq, lq, dv];
                        let mut got = vec![f32::NAN; want32.len()];
                        let qt = Tensor::bhld(&q, [b, hq, lq, d]);
                        c.attend(&qt, &mut TensorMut::bhld(&mut got, oshape), &opts)
                            .unwrap();
                        let (err, bad, first) = compare(&got, &want32);
                        assert_eq!(bad, 0, "{what}: max err {err:e}, first at {first:?}");
                        // bf16 queries (widened exactly), bf16 output (the f32 result rounded).
                        let mut got = vec![f32::NAN; want16.len()];
                        let qt = Tensor::bhld(&qh, [b, hq, lq, d]);
                        c.attend(&qt, &mut TensorMut::bhld(&mut got, oshape), &opts)
                            .unwrap();
                        let (err, bad, first) = compare(&got, &want16);
                        assert_eq!(bad, 0, "{what} bf16 Q: max err {err:e}, first at {first:?}");
                        let mut got16 = vec![bf16::from_f32(f32::NAN); want16.len()];
                        c.attend(&qt, &mut TensorMut::bhld(&mut got16, oshape), &opts)
                            .unwrap();
                        let rounded: Vec<bf16> = got.iter().map(|&x| bf16::from_f32(x)).collect();
                        assert_eq!(got16, rounded, "{what}: bf16 out");
                    }
                }
            }
        }
    }
}

/// Every stored row: `scale = max|x| / 127`, the largest value at ±127, each value within half
/// a step of the input; an all-zero row has scale 0 and zeros.
#[test]
fn rows_are_quantised_symmetrically_with_their_own_scale() {
    let (b, h, t, d, cap) = (2, 3, 4, 19, 6);
    let mut rng = SmallRng::seed_from_u64(5);
    let mut k = randn(&mut rng, b * h * t * d, 3.0);
    k[d..2 * d].fill(0.0); // row (0, 0, 1)
    let v = randn(&mut rng, b * h * t * d, 0.01);
    let mut c = KvCache::<i8>::new_of(b, h, cap, d, d).unwrap();
    c.append(
        &Tensor::bhld(&k, [b, h, t, d]),
        &Tensor::bhld(&v, [b, h, t, d]),
    )
    .unwrap();
    for (x, stored, scales) in [
        (&k, c.keys(), c.key_scales()),
        (&v, c.values(), c.value_scales()),
    ] {
        let st = stored.strides();
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..t {
                    let row = &x[((bi * h + hi) * t + i) * d..][..d];
                    let q = &stored.data()[bi * st[0] + hi * st[1] + i * st[2]..][..d];
                    let s = scales[(bi * h + hi) * cap + i];
                    let amax = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                    assert_eq!(s, amax / 127.0);
                    if amax == 0.0 {
                        assert!(q.iter().all(|&q| q == 0));
                        continue;
                    }
                    assert_eq!(q.iter().map(|q| q.unsigned_abs()).max(), Some(127));
                    for (&xv, &qv) in row.iter().zip(q) {
                        let err = (xv as f64 - s as f64 * qv as f64).abs();
                        assert!(err <= 0.5001 * s as f64, "{xv} vs {qv}·{s}");
                    }
                }
            }
        }
    }
}

/// A NaN or infinity anywhere in an append is refused with the row named, and nothing changes.
#[test]
fn non_finite_rows_are_refused_and_change_nothing() {
    let (b, h, t, d, cap) = (2, 2, 3, 5, 8);
    let mut rng = SmallRng::seed_from_u64(9);
    let mut c = KvCache::<i8>::new_of(b, h, cap, d, d).unwrap();
    let x = randn(&mut rng, b * h * t * d, 1.0);
    let xt = Tensor::bhld(&x, [b, h, t, d]);
    c.append(&xt, &xt).unwrap();
    let snapshot = |c: &KvCache<i8>| {
        (
            c.keys().data().to_vec(),
            c.values().data().to_vec(),
            c.key_scales().to_vec(),
            c.value_scales().to_vec(),
            c.lens().to_vec(),
        )
    };
    let before = snapshot(&c);
    for (bad, at_k, row) in [
        (f32::NAN, false, (1, 0, 1)),
        (f32::INFINITY, true, (0, 1, 2)),
        (f32::NEG_INFINITY, false, (1, 1, 0)),
    ] {
        let mut y = randn(&mut rng, b * h * t * d, 1.0);
        let (bi, hi, i) = row;
        y[((bi * h + hi) * t + i) * d + d - 1] = bad;
        let (yt, good) = (
            Tensor::bhld(&y, [b, h, t, d]),
            Tensor::bhld(&x, [b, h, t, d]),
        );
        let (kt, vt) = if at_k { (yt, good) } else { (good, yt) };
        let err = c.append(&kt, &vt).unwrap_err();
        let arg = if at_k { "k" } else { "v" };
        assert_eq!(
            err,
            AttnError::NonFinite {
                arg,
                batch: bi,
                head: hi,
                token: i
            }
        );
        assert!(err.to_string().contains("NaN or infinity"), "{err}");
        assert_eq!(snapshot(&c), before);
    }
    // The cache still works and still refuses past its capacity without a change.
    let big = vec![0.5f32; b * h * cap * d];
    let bt = Tensor::bhld(&big, [b, h, cap, d]);
    assert!(matches!(
        c.append(&bt, &bt),
        Err(AttnError::Capacity { .. })
    ));
    assert_eq!(snapshot(&c), before);
}

/// `sdpa_int8` on dense tensors equals the cache's own attention; bad scales are typed errors
/// naming them; plain `sdpa` refuses int8 operands (it has no scales); and the result does not
/// depend on the thread count.
#[test]
fn sdpa_int8_checks_its_scales() {
    let (b, hq, hkv, lk, d) = (2, 4, 2, 37, 16);
    let mut rng = SmallRng::seed_from_u64(21);
    let mut c = KvCache::<i8>::new_of(b, hkv, lk, d, d).unwrap();
    let x = randn(&mut rng, b * hkv * lk * d, 1.0);
    let y = randn(&mut rng, b * hkv * lk * d, 1.0);
    let kv = [b, hkv, lk, d];
    c.append(&Tensor::bhld(&x, kv), &Tensor::bhld(&y, kv))
        .unwrap();
    let q = randn(&mut rng, b * hq * d, 1.0);
    let (qs, os) = ([b, hq, 1, d], [b, hq, 1, d]);
    let qt = Tensor::bhld(&q, qs);
    let opts = SdpaOptions::new().causal(Causal::BottomRight);
    let mut want = vec![0.0f32; b * hq * d];
    c.attend(&qt, &mut TensorMut::bhld(&mut want, os), &opts)
        .unwrap();
    let (k, v) = (c.keys(), c.values());
    let sshape = [b, hkv, lk, 1];
    let (ks, vs) = (c.key_scales(), c.value_scales());
    for par in [Par::Seq, Par::Rayon] {
        let mut got = vec![f32::NAN; want.len()];
        let o = opts.par(par);
        let (kst, vst) = (Tensor::bhld(ks, sshape), Tensor::bhld(vs, sshape));
        sdpa_int8(
            &qt,
            &k,
            &kst,
            &v,
            &vst,
            &mut TensorMut::bhld(&mut got, os),
            &o,
        )
        .unwrap();
        assert_eq!(got, want, "{par:?}");
    }
    let mut out = vec![f32::NAN; want.len()];
    let mut call = |kst: Tensor<f32>, vst: Tensor<f32>| {
        sdpa_int8(
            &qt,
            &k,
            &kst,
            &v,
            &vst,
            &mut TensorMut::bhld(&mut out, os),
            &opts,
        )
        .unwrap_err()
    };
    let good = Tensor::bhld(vs, sshape);
    assert_eq!(
        call(Tensor::bhld(ks, [b, hkv, lk - 1, 1]), good),
        AttnError::ShapeMismatch {
            arg: "k_scales",
            dim: "Lk",
            expected: lk,
            got: lk - 1
        }
    );
    assert_eq!(
        call(Tensor::bhld(ks, sshape), Tensor::bhld(&vs[1..], sshape)),
        AttnError::BufferLength {
            arg: "v_scales",
            needed: vs.len(),
            got: vs.len() - 1
        }
    );
    let spread = vec![1.0f32; 2 * vs.len()];
    assert!(matches!(
        call(
            Tensor::bhld(ks, sshape),
            Tensor::strided(&spread, sshape, [hkv * lk * 2, lk * 2, 2])
        ),
        AttnError::BadStride {
            arg: "v_scales",
            dim: "Lk",
            ..
        }
    ));
    assert!(out.iter().all(|x| x.is_nan()), "a refused call wrote");
    let err = sdpa(&qt, &k, &v, &mut TensorMut::bhld(&mut out, os), &opts).unwrap_err();
    assert!(
        matches!(err, AttnError::BadParam { arg: "k", .. }),
        "{err:?}"
    );
}

/// Empty sizes on an int8 cache: zero-width rows, an empty cache, no sequences, no capacity.
/// Every call either works or returns an error; none panics.
#[test]
fn int8_cache_edge_sizes() {
    for [b, h, cap, d, dv, t] in [
        [1, 1, 4, 0, 3, 2],
        [1, 2, 4, 3, 0, 2],
        [0, 2, 4, 3, 3, 1],
        [2, 1, 0, 3, 3, 0],
        [1, 1, 3, 0, 0, 3],
    ] {
        let mut c = KvCache::<i8>::new_of(b, h, cap, d, dv).unwrap();
        let (k, v) = (vec![1.5f32; b * h * t * d], vec![-2.0f32; b * h * t * dv]);
        c.append(
            &Tensor::bhld(&k, [b, h, t, d]),
            &Tensor::bhld(&v, [b, h, t, dv]),
        )
        .unwrap();
        assert_eq!(c.lens(), vec![t; b]);
        let q = vec![0.25f32; b * h * d];
        let mut out = vec![f32::NAN; b * h * dv];
        c.attend(
            &Tensor::bhld(&q, [b, h, 1, d]),
            &mut TensorMut::bhld(&mut out, [b, h, 1, dv]),
            &SdpaOptions::new(),
        )
        .unwrap();
        let want = if t == 0 { 0.0 } else { -2.0 };
        assert!(out.iter().all(|&x| (x - want).abs() < 1e-6), "{out:?}");
    }
}
