//! The additive-attention kernel and its vectorised tanh, on every ISA this CPU has, against
//! their f64 specifications (`reference_additive_score` + `reference::attention_head`, exact
//! `f64::tanh`).

mod common;

use attnkit::kernels::{
    additive_forward, additive_scratch_len, reference, reference_additive_score, tanh_slice,
    AdditiveArgs, Isa, ScoreSpec, ADDITIVE_KEY_PAD,
};
use common::{isas, randn};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Distance from `got` to the exact value in units of the f32 spacing at the exact value.
fn ulps(got: f32, want: f64) -> f64 {
    let w = want as f32;
    if got == w {
        return 0.0;
    }
    let a = w.abs();
    let spacing = if a == 0.0 {
        f32::from_bits(1) as f64
    } else {
        f32::from_bits(a.to_bits() + 1) as f64 - a as f64
    };
    (got as f64 - want).abs() / spacing
}

/// Max ulp error of `tanh_slice(isa)` over `xs`, with the worst input.
fn tanh_error(isa: Isa, xs: &[f32]) -> (f64, f32, f64) {
    let mut y = xs.to_vec();
    tanh_slice(isa, &mut y);
    let (mut worst, mut at, mut abs) = (0.0f64, 0.0f32, 0.0f64);
    for (&x, &g) in xs.iter().zip(&y) {
        let want = (x as f64).tanh();
        let e = ulps(g, want);
        assert!(e.is_finite(), "{isa}: tanh({x:e}) = {g}, want {want}");
        if e > worst {
            (worst, at) = (e, x);
        }
        abs = abs.max((g as f64 - want).abs());
    }
    (worst, at, abs)
}

/// Every 509th bit pattern of the whole f32 range (both signs, zeros, subnormals, up to MAX),
/// plus the edges of each binade that matter: about 8.4 million inputs per ISA.
fn tanh_inputs() -> Vec<f32> {
    let mut xs: Vec<f32> = (0..0x7f80_0000u32)
        .step_by(509)
        .map(f32::from_bits)
        .collect();
    for &x in &[
        0.0f32,
        f32::from_bits(1),
        f32::MIN_POSITIVE,
        1e-30,
        3.9e-4,
        4e-4,
        0.5,
        1.0,
        7.905_311,
        8.5,
        9.0,
        9.01,
        f32::MAX,
    ] {
        xs.push(x);
        xs.push(f32::from_bits(x.to_bits() - (x.to_bits() > 0) as u32));
        xs.push(f32::from_bits(x.to_bits() + 1));
    }
    let neg: Vec<f32> = xs.iter().map(|x| -x).collect();
    xs.extend(neg);
    xs
}

#[test]
fn tanh_full_range_every_isa() {
    let xs = tanh_inputs();
    for isa in isas() {
        let (worst, at, abs) = tanh_error(isa, &xs);
        eprintln!(
            "tanh {isa}: max {worst:.2} ulp at x = {at:e}, max abs {abs:.2e} over {} inputs",
            xs.len()
        );
        // The documented bounds (exhaustive): 5.4 ulp / 3.2e-7 with FMA, 6.7 ulp / 4.0e-7 without.
        let (bound, abs_bound) = if isa == Isa::Scalar {
            (6.7, 4.0e-7)
        } else {
            (5.4, 3.2e-7)
        };
        assert!(worst <= bound, "{isa}: tanh error {worst} ulp at {at:e}");
        assert!(abs <= abs_bound, "{isa}: tanh absolute error {abs:e}");
    }
}

#[test]
fn tanh_special_values_every_isa() {
    for isa in isas() {
        let mut x = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::from_bits(1),
            -f32::from_bits(1),
            1e-20,
            -1e-20,
            20.0,
            -20.0,
        ];
        let src = x;
        tanh_slice(isa, &mut x);
        assert_eq!(x[0].to_bits(), 0.0f32.to_bits(), "{isa}: tanh(+0)");
        assert_eq!(x[1].to_bits(), (-0.0f32).to_bits(), "{isa}: tanh(-0)");
        assert_eq!((x[2], x[3]), (1.0, -1.0), "{isa}: tanh(±inf)");
        assert!(x[4].is_nan(), "{isa}: tanh(NaN)");
        assert_eq!((x[5], x[6]), (1.0, -1.0), "{isa}: tanh(±MAX)");
        for i in 7..11 {
            assert!(
                ulps(x[i], (src[i] as f64).tanh()) <= 2.0,
                "{isa}: tanh({:e}) = {:e}",
                src[i],
                x[i]
            );
            assert_eq!(x[i].is_sign_negative(), src[i].is_sign_negative());
        }
        assert_eq!((x[11], x[12]), (1.0, -1.0), "{isa}: tanh(±20)");
        // Every length (tails through the padded buffer) and odd symmetry.
        for len in 0..40 {
            let src: Vec<f32> = (0..len).map(|i| (i as f32 - 20.0) * 0.37).collect();
            let mut y = src.clone();
            tanh_slice(isa, &mut y);
            for (a, b) in src.iter().zip(&y) {
                assert!(
                    ulps(*b, (*a as f64).tanh()) <= 6.7,
                    "{isa}: len {len}, tanh({a})"
                );
            }
        }
    }
}

/// Exhaustive: every finite f32 (2·2^31 inputs, ~1 minute per ISA). `cargo test --release --
/// --ignored tanh_exhaustive` to reproduce the documented bound.
#[test]
#[ignore]
fn tanh_exhaustive() {
    for isa in isas() {
        let (mut worst, mut abs) = (0.0f64, 0.0f64);
        let mut start = 0u32;
        while start < 0x7f80_0000 {
            let end = (start + (1 << 22)).min(0x7f80_0000);
            let xs: Vec<f32> = (start..end).map(f32::from_bits).collect();
            let (w, _, a) = tanh_error(isa, &xs);
            (worst, abs) = (worst.max(w), abs.max(a));
            start = end;
        }
        eprintln!("tanh {isa}: exhaustive max {worst:.3} ulp, {abs:.3e} absolute");
    }
}

// ---------------------------------------------------------------------------------------------
// The fused kernel.

struct Case {
    m: usize,
    n: usize,
    a: usize,
    dv: usize,
    key_len: usize,
    mask: bool,
    bias: bool,
}

/// Runs the kernel once on `isa` (strided output with NaN padding, NaN-filled key padding) and
/// checks out, scores and weights against the f64 spec.
fn check(isa: Isa, c: &Case, rng: &mut SmallRng) {
    let (m, n, a, dv) = (c.m, c.n, c.a, c.dv);
    let qp = randn(rng, m * a, 1.0);
    let kp = randn(rng, n * a, 1.0); // (n, a) row-major, for the reference
    let wv = randn(rng, a, 1.0);
    let v = randn(rng, n * dv, 1.0);
    // k′ᵀ with padded rows; padding is NaN: the kernel must ignore it.
    let ldkt = n.div_ceil(ADDITIVE_KEY_PAD) * ADDITIVE_KEY_PAD + 3;
    let mut kpt = vec![f32::NAN; a * ldkt];
    for j in 0..n {
        for p in 0..a {
            kpt[p * ldkt + j] = kp[j * a + p];
        }
    }
    let mask: Vec<bool> = (0..m * n).map(|_| rng.gen_bool(0.7)).collect();
    let bias = randn(rng, m * n, 2.0);
    let ldo = dv + 5;
    let mut o = vec![f32::NAN; m * ldo];
    let ldw = n + 2;
    let mut scores = vec![f32::NAN; m * ldw];
    let mut weights = vec![f32::NAN; m * ldw];
    let dummy = [0.0f32; 1];
    let ptr = |x: &[f32]| {
        if x.is_empty() {
            dummy.as_ptr()
        } else {
            x.as_ptr()
        }
    };
    let args = AdditiveArgs {
        m,
        n,
        a,
        dv,
        qp: ptr(&qp),
        ldq: a,
        kpt: ptr(&kpt),
        ldkt,
        wv: ptr(&wv),
        v: ptr(&v),
        ldv: dv,
        o: o.as_mut_ptr(),
        ldo,
        spec: ScoreSpec {
            bias: if c.bias {
                bias.as_ptr()
            } else {
                core::ptr::null()
            },
            ldbias: n,
            mask: if c.mask {
                mask.as_ptr().cast::<u8>()
            } else {
                core::ptr::null()
            },
            ldmask: n,
            ..ScoreSpec::new(c.key_len)
        },
        scores: scores.as_mut_ptr(),
        weights: weights.as_mut_ptr(),
        ldw,
    };
    let mut scratch = vec![0.0f32; additive_scratch_len(dv)];
    // SAFETY: every buffer above covers the extents in `args`; the ISA comes from `isas()`.
    unsafe { additive_forward(isa, &args, &mut scratch) };

    let logit = |i: usize, j: usize| -> Option<f64> {
        if j >= c.key_len || (c.mask && !mask[i * n + j]) {
            return None;
        }
        let s = reference_additive_score(&qp[i * a..], &kp[j * a..], &wv);
        Some(s + if c.bias { bias[i * n + j] as f64 } else { 0.0 })
    };
    let (want, _, want_w) =
        reference::attention_head(m, n, dv, logit, |j, col| v[j * dv + col] as f64);
    // Per-score error bound: tanh ≤ 3.5e-7 absolute per term, times Σ|w|, plus f32 summation.
    let wsum: f64 = wv.iter().map(|x| x.abs() as f64).sum();
    let s_tol = 4e-7 * wsum + 1e-6;
    let tag = format!(
        "{isa} m={m} n={n} a={a} dv={dv} key_len={} mask={} bias={}",
        c.key_len, c.mask, c.bias
    );
    for i in 0..m {
        for j in 0..n {
            let got = scores[i * ldw + j];
            match logit(i, j) {
                None => assert_eq!(got, f32::NEG_INFINITY, "{tag}: masked score ({i},{j})"),
                Some(s) => assert!(
                    (got as f64 - s).abs() <= s_tol * (1.0 + s.abs() * 1e-3),
                    "{tag}: score ({i},{j}) {got} vs {s}"
                ),
            }
            let (gw, ww) = (weights[i * ldw + j] as f64, want_w[i * n + j]);
            assert!(
                (gw - ww).abs() <= 1e-5 + ww * 10.0 * s_tol,
                "{tag}: weight ({i},{j}) {gw} vs {ww}"
            );
        }
        for j in n..ldw {
            assert!(
                scores[i * ldw + j].is_nan() && weights[i * ldw + j].is_nan(),
                "{tag}: padding written"
            );
        }
        for col in 0..dv {
            let (g, w) = (o[i * ldo + col] as f64, want[i * dv + col]);
            assert!(
                (g - w).abs() <= 1e-5 + 10.0 * s_tol * (1.0 + w.abs()),
                "{tag}: out ({i},{col}) {g} vs {w}"
            );
        }
        for col in dv..ldo {
            assert!(
                o[i * ldo + col].is_nan(),
                "{tag}: output padding written at ({i},{col})"
            );
        }
    }
}

#[test]
fn kernel_matches_f64_reference_across_tails() {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut count = 0;
    for isa in isas() {
        for &n in &[
            0usize, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 257,
        ] {
            for &(m, a, dv) in &[
                (1usize, 1usize, 1usize),
                (3, 5, 7),
                (2, 16, 16),
                (5, 33, 17),
                (1, 24, 40),
                (4, 8, 65),
            ] {
                for variant in 0..3 {
                    let key_len = match variant {
                        0 => n,
                        1 => n / 2,
                        _ => n.saturating_sub(1),
                    };
                    let c = Case {
                        m,
                        n,
                        a,
                        dv,
                        key_len,
                        mask: variant == 1,
                        bias: variant == 2,
                    };
                    check(isa, &c, &mut rng);
                    count += 1;
                }
            }
        }
        // m = 0 writes nothing.
        check(
            isa,
            &Case {
                m: 0,
                n: 9,
                a: 4,
                dv: 3,
                key_len: 9,
                mask: false,
                bias: false,
            },
            &mut rng,
        );
    }
    eprintln!("{count} kernel cases");
}

#[test]
fn kernel_isas_agree_with_portable() {
    // Same inputs on every ISA: scores within a few f32 roundings of the portable path's.
    let (m, n, a, dv) = (6usize, 150usize, 64usize, 20usize);
    let mut rng = SmallRng::seed_from_u64(11);
    let qp = randn(&mut rng, m * a, 0.5);
    let kpt = randn(&mut rng, a * 160, 0.5);
    let wv = randn(&mut rng, a, 0.5);
    let v = randn(&mut rng, n * dv, 1.0);
    let run = |isa: Isa| {
        let mut o = vec![0.0f32; m * dv];
        let mut s = vec![0.0f32; m * n];
        let args = AdditiveArgs {
            m,
            n,
            a,
            dv,
            qp: qp.as_ptr(),
            ldq: a,
            kpt: kpt.as_ptr(),
            ldkt: 160,
            wv: wv.as_ptr(),
            v: v.as_ptr(),
            ldv: dv,
            o: o.as_mut_ptr(),
            ldo: dv,
            spec: ScoreSpec {
                bias: core::ptr::null(),
                ldbias: 0,
                mask: core::ptr::null(),
                ldmask: 0,
                ..ScoreSpec::new(n)
            },
            scores: s.as_mut_ptr(),
            weights: core::ptr::null_mut(),
            ldw: n,
        };
        let mut scratch = vec![0.0f32; additive_scratch_len(dv)];
        // SAFETY: buffers cover the extents; the ISA comes from `isas()`.
        unsafe { additive_forward(isa, &args, &mut scratch) };
        (o, s)
    };
    let (o0, s0) = run(Isa::Scalar);
    for isa in isas() {
        let (o, s) = run(isa);
        let ds = s
            .iter()
            .zip(&s0)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        let dout = o
            .iter()
            .zip(&o0)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        eprintln!("{isa} vs portable: scores {ds:.2e}, out {dout:.2e}");
        assert!(ds < 2e-5 && dout < 2e-6, "{isa}: scores {ds}, out {dout}");
    }
}

#[test]
fn kernel_nan_propagates_and_fully_masked_rows_are_zero() {
    for isa in isas() {
        let (m, n, a, dv) = (2usize, 20usize, 3usize, 4usize);
        let mut qp = vec![0.1f32; m * a];
        qp[a] = f32::NAN; // row 1 sees a NaN in every score
        let kpt = vec![0.2f32; a * 32];
        let wv = vec![1.0f32; a];
        let v = vec![1.0f32; n * dv];
        let mut o = vec![7.0f32; m * dv];
        let mut w = vec![7.0f32; m * n];
        let mask = vec![false; n]; // broadcast row: everything masked
        let mut args = AdditiveArgs {
            m,
            n,
            a,
            dv,
            qp: qp.as_ptr(),
            ldq: a,
            kpt: kpt.as_ptr(),
            ldkt: 32,
            wv: wv.as_ptr(),
            v: v.as_ptr(),
            ldv: dv,
            o: o.as_mut_ptr(),
            ldo: dv,
            spec: ScoreSpec {
                bias: core::ptr::null(),
                ldbias: 0,
                mask: core::ptr::null(),
                ldmask: 0,
                ..ScoreSpec::new(n)
            },
            scores: core::ptr::null_mut(),
            weights: w.as_mut_ptr(),
            ldw: n,
        };
        let mut scratch = vec![0.0f32; additive_scratch_len(dv)];
        // SAFETY: buffers cover the extents; the ISA comes from `isas()`.
        unsafe { additive_forward(isa, &args, &mut scratch) };
        assert!(
            o[..dv].iter().all(|&x| (x - 1.0).abs() < 1e-6),
            "{isa}: row 0 {:?}",
            &o[..dv]
        );
        assert!(
            o[dv..].iter().all(|x| x.is_nan()),
            "{isa}: NaN must propagate"
        );
        args.spec.mask = mask.as_ptr().cast::<u8>();
        // SAFETY: as above.
        unsafe { additive_forward(isa, &args, &mut scratch) };
        assert!(
            o.iter().all(|&x| x == 0.0),
            "{isa}: fully masked rows give zeros"
        );
        assert!(
            w.iter().all(|&x| x == 0.0),
            "{isa}: fully masked rows give zero weights"
        );
        args.spec.mask = core::ptr::null();
        args.spec.key_len = 0;
        // SAFETY: as above.
        unsafe { additive_forward(isa, &args, &mut scratch) };
        assert!(o.iter().all(|&x| x == 0.0), "{isa}: key_len 0 gives zeros");
    }
}
