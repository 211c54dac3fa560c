//! `sdpa_backward` (#17) against an f64 backward computed from the f64 reference's weights:
//! `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))` (times the softcap's `1 − tanh²`),
//! `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`, summed over each GQA group — over shapes that cross
//! the 128-row/128-key tiles (1, odd sizes, Lq ≠ Lk, D ≠ Dv, D not a multiple of a vector), every
//! causal alignment, windows, key lengths (0 included), bool masks, biases, ALiBi, softcap and
//! sinks, and strided (BLHD) views. Also: results bitwise independent of the thread count,
//! typed refusals.

mod common;

use attnkit::{
    alibi_slopes, sdpa_backward, sdpa_backward_vec, sdpa_ext_vec, AttnError, Causal, MaskRef, Par,
    Returns, Saved, SdpaOptions, Tensor, TensorMut,
};
use common::{mask_index, randn, reference, Dims, Problem, RefMask};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Gradients in f64 from the reference weights `w (B, Hq, Lq, Lk)` and output, and for each
/// gradient element the sum of the magnitudes of the terms that make it (`dS`'s as
/// `P·(|dP| + |D|)`, the difference it is): the scale of its floating-point error.
fn reference_backward(p: &Problem, w: &[f64], out: &[f64], dout: &[f32]) -> [[Vec<f64>; 3]; 2] {
    let Dims {
        b,
        hq,
        hkv,
        lq,
        lk,
        d,
        dv,
    } = p.dims;
    let group = hq / hkv;
    let (mut dq, mut dk, mut dvv) = (
        vec![0.0; b * hq * lq * d],
        vec![0.0; b * hkv * lk * d],
        vec![0.0; b * hkv * lk * dv],
    );
    let (mut mq, mut mk, mut mv) = (dq.clone(), dk.clone(), dvv.clone());
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / group;
            for i in 0..lq {
                let row = (bi * hq + h) * lq + i;
                let go = &dout[row * dv..(row + 1) * dv];
                let delta: f64 = (0..dv).map(|c| go[c] as f64 * out[row * dv + c]).sum();
                let delta_mag: f64 = (0..dv)
                    .map(|c| (go[c] as f64 * out[row * dv + c]).abs())
                    .sum();
                for j in 0..lk {
                    let pw = w[row * lk + j];
                    if pw == 0.0 {
                        continue;
                    }
                    let kr = ((bi * hkv + kh) * lk + j) * d;
                    let vr = ((bi * hkv + kh) * lk + j) * dv;
                    let (mut dp, mut dp_mag) = (0.0, 0.0);
                    for c in 0..dv {
                        dvv[vr + c] += pw * go[c] as f64;
                        mv[vr + c] += (pw * go[c] as f64).abs();
                        dp += go[c] as f64 * p.v[vr + c] as f64;
                        dp_mag += (go[c] as f64 * p.v[vr + c] as f64).abs();
                    }
                    let mut ds = pw * (dp - delta);
                    let ds_mag = pw * (dp_mag + delta_mag);
                    if let Some(cap) = p.softcap {
                        let x: f64 = (0..d)
                            .map(|c| p.q[row * d + c] as f64 * p.k[kr + c] as f64)
                            .sum::<f64>()
                            * p.scale;
                        let t = (x / cap).tanh();
                        ds *= 1.0 - t * t;
                    }
                    for c in 0..d {
                        dq[row * d + c] += p.scale * ds * p.k[kr + c] as f64;
                        dk[kr + c] += p.scale * ds * p.q[row * d + c] as f64;
                        mq[row * d + c] += p.scale * ds_mag * (p.k[kr + c] as f64).abs();
                        mk[kr + c] += p.scale * ds_mag * (p.q[row * d + c] as f64).abs();
                    }
                }
            }
        }
    }
    [[dq, dk, dvv], [mq, mk, mv]]
}

/// `(B, H, L, X)` dense re-laid-out as `(B, L, H, X)`.
fn to_blhd(x: &[f32], [b, h, l, w]: [usize; 4]) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                let src = ((bi * h + hi) * l + li) * w;
                let dst = ((bi * l + li) * h + hi) * w;
                y[dst..dst + w].copy_from_slice(&x[src..src + w]);
            }
        }
    }
    y
}

#[derive(Clone, Debug)]
struct Case {
    dims: Dims,
    causal: Option<Causal>,
    window: Option<usize>,
    lens: Option<Vec<usize>>,
    mask: u8, // 0 none, 1 bool, 2 bias
    alibi: bool,
    softcap: Option<f32>,
    sinks: bool,
    blhd: bool,
}

fn check(c: &Case, seed: u64) -> f64 {
    let dims = c.dims;
    let mut rng = SmallRng::seed_from_u64(seed);
    let q = randn(&mut rng, dims.q().iter().product(), 1.0);
    let k = randn(&mut rng, dims.k().iter().product(), 1.0);
    let v = randn(&mut rng, dims.v().iter().product(), 1.0);
    let dout = randn(&mut rng, dims.out().iter().product(), 1.0);
    let ms = [dims.b, 1, dims.lq, dims.lk];
    let bools: Vec<bool> = (0..ms.iter().product())
        .map(|_| rng.gen_bool(0.8))
        .collect();
    let bias: Vec<f32> = (0..ms.iter().product())
        .map(|_| {
            if rng.gen_bool(0.1) {
                f32::NEG_INFINITY
            } else {
                rng.gen_range(-2.0..2.0)
            }
        })
        .collect();
    let slopes = alibi_slopes(dims.hq, 8.0);
    let sinks: Vec<f32> = (0..dims.hq).map(|h| h as f32 * 0.5 - 1.0).collect();
    let mut opts = SdpaOptions::new();
    if let Some(cz) = c.causal {
        opts = opts.causal(cz);
    }
    if let Some(w) = c.window {
        opts = opts.window(w);
    }
    if let Some(l) = &c.lens {
        opts = opts.key_lengths(l);
    }
    let mask = match c.mask {
        1 => {
            opts = opts.bool_mask(MaskRef::new(&bools, ms));
            RefMask::Bool(&bools, ms)
        }
        2 => {
            opts = opts.bias(MaskRef::new(&bias, ms));
            RefMask::Bias(&bias, ms)
        }
        _ => RefMask::None,
    };
    if c.alibi {
        opts = opts.alibi(&slopes);
    }
    if let Some(cap) = c.softcap {
        opts = opts.softcap(cap);
    }
    if c.sinks {
        opts = opts.sinks(&sinks);
    }
    let scale = 1.0 / (dims.d.max(1) as f64).sqrt();
    let p = Problem {
        dims,
        q: &q,
        k: &k,
        v: &v,
        scale,
        causal: c.causal,
        window: c.window,
        mask,
        key_lengths: c.lens.as_deref(),
        alibi: c.alibi.then_some(&slopes[..]),
        softcap: c.softcap.map(f64::from),
        sinks: c.sinks.then_some(&sinks[..]),
    };
    let r = reference(&p);
    let [want, mag] = reference_backward(&p, &r.w, &r.out, &dout);

    let (qt, kt, vt) = (
        Tensor::bhld(&q, dims.q()),
        Tensor::bhld(&k, dims.k()),
        Tensor::bhld(&v, dims.v()),
    );
    let fwd = sdpa_ext_vec(
        &qt,
        &kt,
        &vt,
        &opts,
        Returns {
            lse: true,
            weights: false,
        },
    )
    .unwrap();
    let lse = fwd.lse.unwrap();
    let got = if c.blhd {
        // Every view in (B, L, H, ·) memory: strides on every argument.
        let lh = |s: [usize; 4]| [s[0], s[2], s[1], s[3]];
        let (qb, kb, vb) = (
            to_blhd(&q, dims.q()),
            to_blhd(&k, dims.k()),
            to_blhd(&v, dims.v()),
        );
        let (ob, gb) = (to_blhd(&fwd.out, dims.out()), to_blhd(&dout, dims.out()));
        let saved = Saved {
            q: Tensor::blhd(&qb, lh(dims.q())),
            k: Tensor::blhd(&kb, lh(dims.k())),
            v: Tensor::blhd(&vb, lh(dims.v())),
            out: Tensor::blhd(&ob, lh(dims.out())),
            lse: &lse,
        };
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        sdpa_backward(
            &saved,
            &Tensor::blhd(&gb, lh(dims.out())),
            &mut TensorMut::blhd(&mut dq, lh(dims.q())),
            &mut TensorMut::blhd(&mut dk, lh(dims.k())),
            &mut TensorMut::blhd(&mut dv, lh(dims.v())),
            &opts,
        )
        .unwrap();
        let back = |x: &[f32], s: [usize; 4]| -> Vec<f32> {
            // (B, L, H, X) → (B, H, L, X).
            let [b, h, l, w] = s;
            let mut y = vec![0.0; x.len()];
            for bi in 0..b {
                for li in 0..l {
                    for hi in 0..h {
                        let src = ((bi * l + li) * h + hi) * w;
                        let dst = ((bi * h + hi) * l + li) * w;
                        y[dst..dst + w].copy_from_slice(&x[src..src + w]);
                    }
                }
            }
            y
        };
        [
            back(&dq, dims.q()),
            back(&dk, dims.k()),
            back(&dv, dims.v()),
        ]
    } else {
        let saved = Saved {
            q: qt,
            k: kt,
            v: vt,
            out: Tensor::bhld(&fwd.out, dims.out()),
            lse: &lse,
        };
        let g = sdpa_backward_vec(&saved, &Tensor::bhld(&dout, dims.out()), &opts).unwrap();
        [g.dq, g.dk, g.dv]
    };
    // Tolerance per element: 1e-5·(1 + |want|), plus 1e-6 of the summed term magnitudes — the
    // linear bound of a sum's rounding error, which matters where the terms cancel (one key: dS
    // is exactly 0, and dK is pure rounding).
    let mut worst = 0.0f64;
    for (name, ((g, w), m)) in ["dq", "dk", "dv"]
        .iter()
        .zip(got.iter().zip(&want).zip(&mag))
    {
        for (i, ((&g, &w), &m)) in g.iter().zip(w).zip(m).enumerate() {
            let err = (g as f64 - w).abs();
            let tol = 1e-5 * (1.0 + w.abs()) + 1e-6 * m;
            worst = worst.max(err / tol);
            assert!(err <= tol, "{name}[{i}]: {g} vs {w} (terms {m:e}) in {c:?}");
        }
    }
    worst
}

/// The lengths that cross the 128-row/128-key tiles.
const LENS: [usize; 10] = [1, 2, 7, 33, 64, 100, 127, 128, 129, 200];

#[test]
fn backward_matches_the_f64_reference() {
    let mut rng = SmallRng::seed_from_u64(1717);
    let mut worst = 0.0f64;
    for case in 0..60 {
        let (hq, hkv) = *[(1, 1), (2, 2), (4, 2), (6, 1), (8, 2)]
            .choose(&mut rng)
            .unwrap();
        let d = *[1, 3, 8, 16, 24, 64].choose(&mut rng).unwrap();
        let dims = Dims {
            b: *[1, 2, 8].choose(&mut rng).unwrap(),
            hq,
            hkv,
            lq: *LENS.choose(&mut rng).unwrap(),
            lk: *LENS.choose(&mut rng).unwrap(),
            d,
            dv: if rng.gen_bool(0.5) {
                d
            } else {
                *[5, 16, 40].choose(&mut rng).unwrap()
            },
        };
        let causal = *[
            None,
            Some(Causal::TopLeft),
            Some(Causal::BottomRight),
            Some(Causal::BottomRightAtLk),
        ]
        .choose(&mut rng)
        .unwrap();
        let c = Case {
            dims,
            causal,
            window: (causal.is_some() && rng.gen_bool(0.3)).then(|| rng.gen_range(1..=dims.lk + 1)),
            lens: rng.gen_bool(0.3).then(|| {
                (0..dims.b)
                    .map(|_| {
                        *[0, dims.lk, rng.gen_range(0..=dims.lk)]
                            .choose(&mut rng)
                            .unwrap()
                    })
                    .collect()
            }),
            mask: rng.gen_range(0..3),
            alibi: rng.gen_bool(0.25),
            softcap: rng.gen_bool(0.25).then_some(5.0),
            sinks: rng.gen_bool(0.2),
            blhd: rng.gen_bool(0.3),
        };
        worst = worst.max(check(&c, 100 + case));
    }
    eprintln!("worst gradient error / tolerance: {worst:.3}");
}

/// dQ, dK, dV are bitwise the same on one thread and on pools of 2, 3 and 8 (the tasks own their
/// outputs and accumulate in a fixed order).
#[test]
fn backward_does_not_depend_on_the_thread_count() {
    let dims = Dims {
        b: 1,
        hq: 4,
        hkv: 2,
        lq: 300,
        lk: 260,
        d: 64,
        dv: 48,
    };
    let mut rng = SmallRng::seed_from_u64(3);
    let q = randn(&mut rng, dims.q().iter().product(), 1.0);
    let k = randn(&mut rng, dims.k().iter().product(), 1.0);
    let v = randn(&mut rng, dims.v().iter().product(), 1.0);
    let dout = randn(&mut rng, dims.out().iter().product(), 1.0);
    let (qt, kt, vt) = (
        Tensor::bhld(&q, dims.q()),
        Tensor::bhld(&k, dims.k()),
        Tensor::bhld(&v, dims.v()),
    );
    let opts = SdpaOptions::new().causal(Causal::BottomRight);
    let want_lse = Returns {
        lse: true,
        weights: false,
    };
    let fwd = sdpa_ext_vec(&qt, &kt, &vt, &opts, want_lse).unwrap();
    let lse = fwd.lse.unwrap();
    let saved = Saved {
        q: qt,
        k: kt,
        v: vt,
        out: Tensor::bhld(&fwd.out, dims.out()),
        lse: &lse,
    };
    let go = Tensor::bhld(&dout, dims.out());
    let seq = sdpa_backward_vec(&saved, &go, &opts.par(Par::Seq)).unwrap();
    for threads in [1, 2, 3, 8] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let got = pool.install(|| sdpa_backward_vec(&saved, &go, &opts).unwrap());
        assert!(got == seq, "{threads} threads differ from one");
    }
}

#[test]
fn backward_refusals_name_the_argument() {
    let (b, h, l, d) = (2, 2, 5, 4);
    let x = vec![0.5f32; b * h * l * d];
    let t = Tensor::bhld(&x, [b, h, l, d]);
    let lse = vec![0.0f32; b * h * l];
    let saved = Saved {
        q: t,
        k: t,
        v: t,
        out: t,
        lse: &lse,
    };
    let short = Tensor::bhld(&x[..b * h * (l - 1) * d], [b, h, l - 1, d]);
    let r = sdpa_backward_vec(&saved, &short, &SdpaOptions::new());
    assert_eq!(
        r.err(),
        Some(AttnError::ShapeMismatch {
            arg: "dout",
            dim: "L",
            expected: l,
            got: l - 1
        })
    );
    let bad = Saved {
        lse: &lse[1..],
        ..saved
    };
    let r = sdpa_backward_vec(&bad, &t, &SdpaOptions::new());
    assert_eq!(
        r.err(),
        Some(AttnError::BufferLength {
            arg: "lse",
            needed: b * h * l,
            got: b * h * l - 1
        })
    );
    let mut nan = lse.clone();
    nan[3] = f32::NAN;
    let r = sdpa_backward_vec(&Saved { lse: &nan, ..saved }, &t, &SdpaOptions::new());
    assert!(
        matches!(r, Err(AttnError::BadParam { arg: "lse", .. })),
        "{r:?}"
    );
    // −inf says "fully masked": refused on a row that sees keys, accepted (zero gradients) on
    // one that sees none.
    let mut neg = lse.clone();
    neg[3] = f32::NEG_INFINITY;
    let r = sdpa_backward_vec(&Saved { lse: &neg, ..saved }, &t, &SdpaOptions::new());
    assert!(
        matches!(r, Err(AttnError::BadParam { arg: "lse", .. })),
        "{r:?}"
    );
    let lens = vec![0; b];
    let masked = SdpaOptions::new().key_lengths(&lens);
    let all_neg = vec![f32::NEG_INFINITY; lse.len()];
    let g = sdpa_backward_vec(
        &Saved {
            lse: &all_neg,
            ..saved
        },
        &t,
        &masked,
    )
    .expect("-inf lse of fully masked rows");
    assert!(g.dq.iter().chain(&g.dk).chain(&g.dv).all(|&x| x == 0.0));
    // Gradient rows on top of each other.
    let (mut dq, mut dk, mut dv) = (x.clone(), x.clone(), x.clone());
    let before = dq.clone();
    let r = sdpa_backward(
        &saved,
        &t,
        &mut TensorMut::strided(&mut dq, [b, h, l, d], [0, l * d, d]),
        &mut TensorMut::bhld(&mut dk, [b, h, l, d]),
        &mut TensorMut::bhld(&mut dv, [b, h, l, d]),
        &SdpaOptions::new(),
    );
    assert!(
        matches!(r, Err(AttnError::BadStride { arg: "dq", .. })),
        "{r:?}"
    );
    assert_eq!(dq, before, "a refused call writes nothing");
    // A mask index past its own end is the forward's error, named the same way.
    let m = vec![true; l];
    let r = sdpa_backward_vec(
        &saved,
        &t,
        &SdpaOptions::new().bool_mask(MaskRef::new(&m, [1, 1, 1, l + 1])),
    );
    assert!(
        matches!(
            r,
            Err(AttnError::ShapeMismatch {
                arg: "bool_mask",
                ..
            })
        ),
        "{r:?}"
    );
    let _ = mask_index;
}

/// With many (batch, KV head) pairs the backward runs one task per pair in one pass; with few it
/// splits the keys and takes a second pass for dQ. Both add the same tiles in the same order:
/// 16 batches in one call (one pass) equal, bitwise, the same batches one call each (two).
#[test]
fn one_pass_and_two_passes_agree_bitwise() {
    let (b, hq, hkv, lq, lk, d, dv) = (8, 4, 2, 70, 150, 24, 16);
    let mut rng = SmallRng::seed_from_u64(8);
    let q = randn(&mut rng, b * hq * lq * d, 1.0);
    let k = randn(&mut rng, b * hkv * lk * d, 1.0);
    let v = randn(&mut rng, b * hkv * lk * dv, 1.0);
    let dout = randn(&mut rng, b * hq * lq * dv, 1.0);
    let lens: Vec<usize> = (0..b).map(|i| 150 - 17 * i).collect();
    let want_lse = Returns {
        lse: true,
        weights: false,
    };
    // One pass whenever a single thread runs it; two passes for 2 (batch, KV head) pairs on 8
    // threads (`one_pass_wins` in src/backward.rs).
    let run = |b0: usize, nb: usize, threads: usize| {
        let sl = |x: &[f32], per: usize| x[b0 * per..(b0 + nb) * per].to_vec();
        let (q, k, v, g) = (
            sl(&q, hq * lq * d),
            sl(&k, hkv * lk * d),
            sl(&v, hkv * lk * dv),
            sl(&dout, hq * lq * dv),
        );
        let l = &lens[b0..b0 + nb];
        let opts = SdpaOptions::new()
            .causal(Causal::BottomRight)
            .key_lengths(l);
        let (qt, kt, vt) = (
            Tensor::bhld(&q, [nb, hq, lq, d]),
            Tensor::bhld(&k, [nb, hkv, lk, d]),
            Tensor::bhld(&v, [nb, hkv, lk, dv]),
        );
        let fwd = sdpa_ext_vec(&qt, &kt, &vt, &opts, want_lse).unwrap();
        let lse = fwd.lse.unwrap();
        let saved = Saved {
            q: qt,
            k: kt,
            v: vt,
            out: Tensor::bhld(&fwd.out, [nb, hq, lq, dv]),
            lse: &lse,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            sdpa_backward_vec(&saved, &Tensor::bhld(&g, [nb, hq, lq, dv]), &opts).unwrap()
        })
    };
    let whole = run(0, b, 1);
    for bi in 0..b {
        let one = run(bi, 1, 8);
        let sl = |x: &[f32], per: usize| x[bi * per..(bi + 1) * per].to_vec();
        assert!(one.dq == sl(&whole.dq, hq * lq * d), "dq of batch {bi}");
        assert!(one.dk == sl(&whole.dk, hkv * lk * d), "dk of batch {bi}");
        assert!(one.dv == sl(&whole.dv, hkv * lk * dv), "dv of batch {bi}");
    }
}

/// The f64 backward above is checked against central finite differences of the f64 reference
/// forward itself, for the options no PyTorch golden covers (softcap, ALiBi, sinks, a window, a
/// bias with −inf, key lengths), so the property test's yardstick is right. Steps of 2⁻⁷ are
/// exact in f32; the O(h²) error of a central difference (≈ 1e-6 here) stays below 1e-4.
#[test]
fn reference_backward_matches_finite_differences() {
    let dims = Dims {
        b: 2,
        hq: 4,
        hkv: 2,
        lq: 6,
        lk: 9,
        d: 5,
        dv: 3,
    };
    let mut rng = SmallRng::seed_from_u64(99);
    let q = randn(&mut rng, dims.q().iter().product(), 1.0);
    let k = randn(&mut rng, dims.k().iter().product(), 1.0);
    let v = randn(&mut rng, dims.v().iter().product(), 1.0);
    let dout = randn(&mut rng, dims.out().iter().product(), 1.0);
    let ms = [dims.b, 1, dims.lq, dims.lk];
    let bias: Vec<f32> = (0..ms.iter().product::<usize>())
        .map(|i| {
            if i % 11 == 4 {
                f32::NEG_INFINITY
            } else {
                (i % 7) as f32 * 0.3 - 1.0
            }
        })
        .collect();
    let slopes = alibi_slopes(dims.hq, 8.0);
    let sinks = [0.5f32, -1.0, f32::NEG_INFINITY, 2.0];
    let lens = [9usize, 6];
    let problem = |q: &[f32], k: &[f32], v: &[f32]| {
        let p = Problem {
            dims,
            q,
            k,
            v,
            scale: 0.7,
            causal: Some(Causal::BottomRight),
            window: Some(5),
            mask: RefMask::Bias(&bias, ms),
            key_lengths: Some(&lens),
            alibi: Some(&slopes),
            softcap: Some(3.0),
            sinks: Some(&sinks),
        };
        let r = reference(&p);
        let loss: f64 = r.out.iter().zip(&dout).map(|(o, g)| o * *g as f64).sum();
        (p.clone_grads(&r, &dout), loss)
    };
    let ([dq, dk, dv], _) = problem(&q, &k, &v);
    let h = 1.0 / 128.0;
    let mut worst = 0.0f64;
    for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
        let n = grad.len();
        for idx in (0..n).step_by(n / 12 + 1) {
            let mut xs = [q.clone(), k.clone(), v.clone()];
            xs[which][idx] += h;
            let (_, up) = problem(&xs[0], &xs[1], &xs[2]);
            xs[which][idx] -= 2.0 * h;
            let (_, down) = problem(&xs[0], &xs[1], &xs[2]);
            let fd = (up - down) / (2.0 * h as f64);
            let err = (fd - grad[idx]).abs();
            worst = worst.max(err / (1.0 + grad[idx].abs()));
            assert!(
                err <= 1e-4 * (1.0 + grad[idx].abs()),
                "input {which}[{idx}]: finite difference {fd} vs {}",
                grad[idx]
            );
        }
    }
    eprintln!("worst finite-difference gap: {worst:e}");
}

trait Grads {
    fn clone_grads(&self, r: &common::RefOut, dout: &[f32]) -> [Vec<f64>; 3];
}

impl Grads for Problem<'_> {
    fn clone_grads(&self, r: &common::RefOut, dout: &[f32]) -> [Vec<f64>; 3] {
        let [g, _] = reference_backward(self, &r.w, &r.out, dout);
        g
    }
}

/// `sinks_gradient` (and `Gradients::dsinks`) equals central finite differences of the f64
/// reference forward with respect to each head's sink logit; a `-inf` sink gets 0.
#[test]
fn sinks_gradient_matches_finite_differences() {
    use attnkit::sinks_gradient;
    let dims = Dims {
        b: 2,
        hq: 4,
        hkv: 2,
        lq: 9,
        lk: 70,
        d: 8,
        dv: 6,
    };
    let mut rng = SmallRng::seed_from_u64(4);
    let q = randn(&mut rng, dims.q().iter().product(), 1.0);
    let k = randn(&mut rng, dims.k().iter().product(), 1.0);
    let v = randn(&mut rng, dims.v().iter().product(), 1.0);
    let dout = randn(&mut rng, dims.out().iter().product(), 1.0);
    let sinks = [0.5f32, -1.0, f32::NEG_INFINITY, 2.0];
    let lens = [70usize, 0];
    let loss = |sinks: &[f32]| {
        let p = Problem {
            dims,
            q: &q,
            k: &k,
            v: &v,
            scale: 1.0 / (dims.d as f64).sqrt(),
            causal: Some(Causal::BottomRight),
            window: None,
            mask: RefMask::None,
            key_lengths: Some(&lens),
            alibi: None,
            softcap: None,
            sinks: Some(sinks),
        };
        let r = reference(&p);
        r.out
            .iter()
            .zip(&dout)
            .map(|(o, g)| o * *g as f64)
            .sum::<f64>()
    };
    let opts = SdpaOptions::new()
        .causal(Causal::BottomRight)
        .key_lengths(&lens)
        .sinks(&sinks);
    let (qt, kt, vt) = (
        Tensor::bhld(&q, dims.q()),
        Tensor::bhld(&k, dims.k()),
        Tensor::bhld(&v, dims.v()),
    );
    let want_lse = Returns {
        lse: true,
        weights: false,
    };
    let fwd = sdpa_ext_vec(&qt, &kt, &vt, &opts, want_lse).unwrap();
    let lse = fwd.lse.unwrap();
    let saved = Saved {
        q: qt,
        k: kt,
        v: vt,
        out: Tensor::bhld(&fwd.out, dims.out()),
        lse: &lse,
    };
    let go = Tensor::bhld(&dout, dims.out());
    let got = sinks_gradient(&saved, &go, &opts).unwrap();
    assert_eq!(
        sdpa_backward_vec(&saved, &go, &opts).unwrap().dsinks,
        Some(got.clone())
    );
    let h = 1.0 / 128.0;
    for head in 0..dims.hq {
        if sinks[head] == f32::NEG_INFINITY {
            assert_eq!(got[head], 0.0);
            continue;
        }
        let (mut up, mut down) = (sinks, sinks);
        up[head] += h;
        down[head] -= h;
        let fd = (loss(&up) - loss(&down)) / (2.0 * h as f64);
        assert!(
            (got[head] as f64 - fd).abs() <= 1e-4 * (1.0 + fd.abs()),
            "head {head}: {} vs finite difference {fd}",
            got[head]
        );
    }
    assert!(got.iter().any(|&g| g.abs() > 1e-3), "{got:?}");
}

/// `bias_gradient` equals `Σ P·(dP − D)` (the f64 reference's `dS` before the scale and without
/// the softcap's derivative) summed over the bias's broadcast dimensions, for a full, a
/// per-batch and a `(1, 1, 1, Lk)` bias, with GQA, causal masking, a softcap and key lengths, and
/// is bitwise the same on 1 and 3 threads.
#[test]
fn bias_gradient_matches_the_reference() {
    use attnkit::bias_gradient;
    let dims = Dims {
        b: 2,
        hq: 4,
        hkv: 2,
        lq: 70,
        lk: 90,
        d: 16,
        dv: 8,
    };
    let mut rng = SmallRng::seed_from_u64(31);
    let q = randn(&mut rng, dims.q().iter().product(), 1.0);
    let k = randn(&mut rng, dims.k().iter().product(), 1.0);
    let v = randn(&mut rng, dims.v().iter().product(), 1.0);
    let dout = randn(&mut rng, dims.out().iter().product(), 1.0);
    let lens = [90usize, 41];
    let (qt, kt, vt) = (
        Tensor::bhld(&q, dims.q()),
        Tensor::bhld(&k, dims.k()),
        Tensor::bhld(&v, dims.v()),
    );
    for bs in [
        [dims.b, dims.hq, dims.lq, dims.lk],
        [dims.b, 1, dims.lq, dims.lk],
        [1, 1, 1, dims.lk],
    ] {
        let bias = randn(&mut rng, bs.iter().product(), 1.0);
        let opts = SdpaOptions::new()
            .causal(Causal::BottomRightAtLk)
            .key_lengths(&lens)
            .softcap(3.0)
            .bias(MaskRef::new(&bias, bs));
        let p = Problem {
            dims,
            q: &q,
            k: &k,
            v: &v,
            scale: 1.0 / (dims.d as f64).sqrt(),
            causal: Some(Causal::BottomRightAtLk),
            window: None,
            mask: RefMask::Bias(&bias, bs),
            key_lengths: Some(&lens),
            alibi: None,
            softcap: Some(3.0),
            sinks: None,
        };
        let r = reference(&p);
        let mut want = vec![0.0f64; bias.len()];
        let mut mag = vec![0.0f64; bias.len()];
        for b in 0..dims.b {
            for h in 0..dims.hq {
                let kh = h / (dims.hq / dims.hkv);
                for i in 0..dims.lq {
                    let row = (b * dims.hq + h) * dims.lq + i;
                    let go = &dout[row * dims.dv..][..dims.dv];
                    let delta: f64 = (0..dims.dv)
                        .map(|c| go[c] as f64 * r.out[row * dims.dv + c])
                        .sum();
                    for j in 0..dims.lk {
                        let w = r.w[row * dims.lk + j];
                        let vr = ((b * dims.hkv + kh) * dims.lk + j) * dims.dv;
                        let dp: f64 = (0..dims.dv).map(|c| go[c] as f64 * v[vr + c] as f64).sum();
                        let at = mask_index(bs, b, h, i, j);
                        want[at] += w * (dp - delta);
                        mag[at] += w * (dp.abs() + delta.abs());
                    }
                }
            }
        }
        let fwd = sdpa_ext_vec(
            &qt,
            &kt,
            &vt,
            &opts,
            Returns {
                lse: true,
                weights: false,
            },
        )
        .unwrap();
        let lse = fwd.lse.unwrap();
        let saved = Saved {
            q: qt,
            k: kt,
            v: vt,
            out: Tensor::bhld(&fwd.out, dims.out()),
            lse: &lse,
        };
        let go = Tensor::bhld(&dout, dims.out());
        let got = bias_gradient(&saved, &go, &opts.par(Par::Seq)).unwrap();
        for (i, ((&g, &w), &m)) in got.iter().zip(&want).zip(&mag).enumerate() {
            let tol = 1e-5 * (1.0 + w.abs()) + 1e-6 * m;
            assert!((g as f64 - w).abs() <= tol, "{bs:?}[{i}]: {g} vs {w}");
        }
        assert!(got.iter().any(|&g| g.abs() > 1e-3), "{bs:?}");
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        assert!(pool.install(|| bias_gradient(&saved, &go, &opts).unwrap()) == got);
    }
}

/// K and V of a batch of one cannot get one gradient per query batch: refused by name. A zero
/// B stride over B batches is fine (each batch has its own dK/dV rows, equal to what a copy per
/// batch gets), and so are empty rows (`D = 0`, which the fuzzer found refused as a broadcast).
#[test]
fn backward_kv_batches() {
    let (b, h, l, d) = (2, 2, 9, 4);
    let mut rng = SmallRng::seed_from_u64(12);
    let q = randn(&mut rng, b * h * l * d, 1.0);
    let k1 = randn(&mut rng, h * l * d, 1.0);
    let dout = randn(&mut rng, b * h * l * d, 1.0);
    let kb = k1.repeat(b);
    let qt = Tensor::bhld(&q, [b, h, l, d]);
    let want_lse = Returns {
        lse: true,
        weights: false,
    };
    let run = |k: Tensor| {
        let fwd = sdpa_ext_vec(&qt, &k, &k, &SdpaOptions::new(), want_lse).unwrap();
        let lse = fwd.lse.unwrap();
        let saved = Saved {
            q: qt,
            k,
            v: k,
            out: Tensor::bhld(&fwd.out, [b, h, l, d]),
            lse: &lse,
        };
        sdpa_backward_vec(
            &saved,
            &Tensor::bhld(&dout, [b, h, l, d]),
            &SdpaOptions::new(),
        )
    };
    let copied = run(Tensor::bhld(&kb, [b, h, l, d])).unwrap();
    let strided = run(Tensor::strided(&k1, [b, h, l, d], [0, l * d, d])).unwrap();
    assert!(strided == copied);
    let one = run(Tensor::bhld(&k1, [1, h, l, d]));
    assert!(
        matches!(one, Err(AttnError::BadParam { arg: "k", .. })),
        "{one:?}"
    );
    // Empty rows: nothing to broadcast, nothing refused.
    let e: [f32; 0] = [];
    let (qe, ke) = (
        Tensor::bhld(&e, [b, h, l, 0]),
        Tensor::bhld(&e, [b, h, l, 0]),
    );
    let fwd = sdpa_ext_vec(&qe, &ke, &ke, &SdpaOptions::new(), want_lse).unwrap();
    let lse = fwd.lse.unwrap();
    let saved = Saved {
        q: qe,
        k: ke,
        v: ke,
        out: Tensor::bhld(&fwd.out, [b, h, l, 0]),
        lse: &lse,
    };
    let g = sdpa_backward_vec(&saved, &Tensor::bhld(&e, [b, h, l, 0]), &SdpaOptions::new());
    assert!(g.is_ok(), "{g:?}");
}

/// bf16 and f16 inputs get the f32 gradients of their own values: bitwise those of f32 inputs
/// holding the same (rounded) values, read dense or through (B, L, H, ·) strides, with GQA,
/// Lq ≠ Lk, odd D, key lengths and sinks. (The f32 path is checked against f64 above.)
#[test]
fn low_precision_inputs_get_the_gradients_of_their_values() {
    lowp_case::<attnkit::bf16>(attnkit::bf16::from_f32, attnkit::bf16::to_f32);
    lowp_case::<attnkit::f16>(attnkit::f16::from_f32, attnkit::f16::to_f32);
}

fn lowp_case<E: attnkit::Elem>(to: fn(f32) -> E, from: fn(E) -> f32) {
    let shapes = [
        (2, 4, 2, 37, 150, 13, 7),
        (1, 2, 2, 130, 129, 64, 32),
        (3, 3, 1, 1, 40, 16, 24),
    ];
    for (i, &(b, hq, hkv, lq, lk, d, dv)) in shapes.iter().enumerate() {
        let dims = Dims {
            b,
            hq,
            hkv,
            lq,
            lk,
            d,
            dv,
        };
        let mut rng = SmallRng::seed_from_u64(40 + i as u64);
        let round = |x: Vec<f32>| -> (Vec<E>, Vec<f32>) {
            let e: Vec<E> = x.into_iter().map(to).collect();
            let f = e.iter().map(|&y| from(y)).collect();
            (e, f)
        };
        let (qe, qf) = round(randn(&mut rng, dims.q().iter().product(), 1.0));
        let (ke, kf) = round(randn(&mut rng, dims.k().iter().product(), 1.0));
        let (ve, vf) = round(randn(&mut rng, dims.v().iter().product(), 1.0));
        let (ge, gf) = round(randn(&mut rng, dims.out().iter().product(), 1.0));
        let lens: Vec<usize> = (0..b).map(|j| lk - j * lk / 3).collect();
        let sinks: Vec<f32> = (0..hq).map(|h| h as f32 - 1.0).collect();
        let opts = SdpaOptions::new()
            .causal(Causal::BottomRight)
            .key_lengths(&lens)
            .sinks(&sinks);
        let fwd = sdpa_ext_vec(
            &Tensor::bhld(&qf, dims.q()),
            &Tensor::bhld(&kf, dims.k()),
            &Tensor::bhld(&vf, dims.v()),
            &opts,
            Returns {
                lse: true,
                weights: false,
            },
        )
        .unwrap();
        let lse = fwd.lse.unwrap();
        let (oe, of) = round(fwd.out);
        let want = sdpa_backward_vec(
            &Saved {
                q: Tensor::bhld(&qf, dims.q()),
                k: Tensor::bhld(&kf, dims.k()),
                v: Tensor::bhld(&vf, dims.v()),
                out: Tensor::bhld(&of, dims.out()),
                lse: &lse,
            },
            &Tensor::bhld(&gf, dims.out()),
            &opts,
        )
        .unwrap();
        let dense = sdpa_backward_vec(
            &Saved {
                q: Tensor::bhld(&qe, dims.q()),
                k: Tensor::bhld(&ke, dims.k()),
                v: Tensor::bhld(&ve, dims.v()),
                out: Tensor::bhld(&oe, dims.out()),
                lse: &lse,
            },
            &Tensor::bhld(&ge, dims.out()),
            &opts,
        )
        .unwrap();
        assert!(
            dense == want,
            "{} dense, shape {i}",
            std::any::type_name::<E>()
        );

        // The same values in (B, L, H, ·) memory; gradients written through strides too.
        let lh = |s: [usize; 4]| [s[0], s[2], s[1], s[3]];
        let t = |x: &[E], s: [usize; 4]| -> Vec<E> {
            let f: Vec<f32> = x.iter().map(|&y| from(y)).collect();
            to_blhd(&f, s).into_iter().map(to).collect()
        };
        let (qb, kb, vb, ob, gb) = (
            t(&qe, dims.q()),
            t(&ke, dims.k()),
            t(&ve, dims.v()),
            t(&oe, dims.out()),
            t(&ge, dims.out()),
        );
        let mut g = [
            vec![0.0f32; qf.len()],
            vec![0.0f32; kf.len()],
            vec![0.0f32; vf.len()],
        ];
        let [dq, dk, dv] = &mut g;
        sdpa_backward(
            &Saved {
                q: Tensor::blhd(&qb, lh(dims.q())),
                k: Tensor::blhd(&kb, lh(dims.k())),
                v: Tensor::blhd(&vb, lh(dims.v())),
                out: Tensor::blhd(&ob, lh(dims.out())),
                lse: &lse,
            },
            &Tensor::blhd(&gb, lh(dims.out())),
            &mut TensorMut::blhd(dq, lh(dims.q())),
            &mut TensorMut::blhd(dk, lh(dims.k())),
            &mut TensorMut::blhd(dv, lh(dims.v())),
            &opts,
        )
        .unwrap();
        for (name, (got, (w, s))) in ["dq", "dk", "dv"].iter().zip(g.iter().zip([
            (&want.dq, dims.q()),
            (&want.dk, dims.k()),
            (&want.dv, dims.v()),
        ])) {
            assert!(
                *got == to_blhd(w, s),
                "{} strided {name}, shape {i}",
                std::any::type_name::<E>()
            );
        }
        // Refusals are checked before anything is widened, on the caller's own views.
        let short = &ge[..ge.len() - dims.dv];
        let err = sdpa_backward_vec(
            &Saved {
                q: Tensor::bhld(&qe, dims.q()),
                k: Tensor::bhld(&ke, dims.k()),
                v: Tensor::bhld(&ve, dims.v()),
                out: Tensor::bhld(&oe, dims.out()),
                lse: &lse,
            },
            &Tensor::bhld(short, dims.out()),
            &opts,
        );
        assert!(
            matches!(err, Err(AttnError::BufferLength { arg: "dout", .. })),
            "{err:?}"
        );
    }
}
