//! Every way of calling `sdpa` wrongly returns the right `AttnError`, naming the argument and
//! the sizes, before anything is written; zero-sized dimensions are valid and do the documented
//! thing.

mod common;

use attnkit::{
    sdpa, sdpa_ext, sdpa_vec, unfused, AttnError, Causal, Extras, MaskRef, SdpaOptions, Tensor,
    TensorMut,
};
use common::{isas, randn, reference, Dims, Problem, RefMask};
use rand::rngs::SmallRng;
use rand::SeedableRng;

const BIG: usize = 1 << 32;

/// One call, described by shapes and buffer lengths, run through `sdpa_ext` (and through
/// `sdpa_unfused` when no extras are asked for).
#[derive(Clone, Debug)]
struct Call {
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    out: [usize; 4],
    /// Buffer lengths; `None` = the dense size.
    lens: [Option<usize>; 4],
    /// Strides of q, k, v, out; `None` = dense BHLD.
    strides: [Option<[usize; 3]>; 4],
    scale: Option<f32>,
    causal: Option<Causal>,
    window: Option<usize>,
    key_lengths: Option<Vec<usize>>,
    /// (is_bias, shape, buffer length)
    mask: Option<(bool, [usize; 4], usize)>,
    lse: Option<usize>,
    weights: Option<usize>,
    alibi: Option<Vec<f32>>,
    softcap: Option<f32>,
    sinks: Option<Vec<f32>>,
}

fn dense(s: [usize; 4]) -> usize {
    s.iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .unwrap_or(0)
}

impl Call {
    /// A valid call: B = 2, Hq = 4, Hkv = 2, Lq = 5, Lk = 7, D = 8, Dv = 6.
    fn base() -> Call {
        Call {
            q: [2, 4, 5, 8],
            k: [2, 2, 7, 8],
            v: [2, 2, 7, 6],
            out: [2, 4, 5, 6],
            lens: [None; 4],
            strides: [None; 4],
            scale: None,
            causal: None,
            window: None,
            key_lengths: None,
            mask: None,
            lse: None,
            weights: None,
            alibi: None,
            softcap: None,
            sinks: None,
        }
    }

    /// Runs the call. On error, checks that the output buffer was not touched and that the unfused
    /// path reports the same error.
    fn run(&self) -> Result<(), AttnError> {
        let shapes = [self.q, self.k, self.v, self.out];
        let len = |i: usize| self.lens[i].unwrap_or_else(|| dense(shapes[i]));
        let (q, k, v) = (
            vec![0.5f32; len(0)],
            vec![0.25f32; len(1)],
            vec![1.0f32; len(2)],
        );
        fn view(x: &[f32], shape: [usize; 4], strides: Option<[usize; 3]>) -> Tensor<'_> {
            match strides {
                Some(s) => Tensor::strided(x, shape, s),
                None => Tensor::bhld(x, shape),
            }
        }
        let (qt, kt, vt) = (
            view(&q, self.q, self.strides[0]),
            view(&k, self.k, self.strides[1]),
            view(&v, self.v, self.strides[2]),
        );
        let mask_bool: Vec<bool>;
        let mask_bias: Vec<f32>;
        let mut opts = SdpaOptions::new();
        if let Some(s) = self.scale {
            opts = opts.scale(s);
        }
        if let Some(c) = self.causal {
            opts = opts.causal(c);
        }
        if let Some(w) = self.window {
            opts = opts.window(w);
        }
        if let Some(l) = &self.key_lengths {
            opts = opts.key_lengths(l);
        }
        if let Some(a) = &self.alibi {
            opts = opts.alibi(a);
        }
        if let Some(c) = self.softcap {
            opts = opts.softcap(c);
        }
        if let Some(x) = &self.sinks {
            opts = opts.sinks(x);
        }
        if let Some((is_bias, shape, n)) = self.mask {
            if is_bias {
                mask_bias = vec![0.0; n];
                opts = opts.bias(MaskRef::new(&mask_bias, shape));
            } else {
                mask_bool = vec![true; n];
                opts = opts.bool_mask(MaskRef::new(&mask_bool, shape));
            }
        }
        let mut results = Vec::new();
        for fused in [true, false] {
            if !fused && (self.lse.is_some() || self.weights.is_some()) {
                continue;
            }
            let mut out = vec![f32::NAN; len(3)];
            let mut lse = self.lse.map(|n| vec![f32::NAN; n]);
            let mut w = self.weights.map(|n| vec![f32::NAN; n]);
            let r = {
                let mut ot = match self.strides[3] {
                    Some(s) => TensorMut::strided(&mut out, self.out, s),
                    None => TensorMut::bhld(&mut out, self.out),
                };
                if fused {
                    let extras = Extras {
                        lse: lse.as_deref_mut(),
                        weights: w.as_deref_mut(),
                    };
                    sdpa_ext(&qt, &kt, &vt, &mut ot, &opts, extras)
                } else {
                    unfused::sdpa_unfused(&qt, &kt, &vt, &mut ot, &opts)
                }
            };
            if r.is_err() {
                assert!(
                    out.iter().all(|x| x.is_nan()),
                    "an error must leave `out` untouched: {self:?}"
                );
                for buf in lse.iter().chain(w.iter()) {
                    assert!(
                        buf.iter().all(|x| x.is_nan()),
                        "an error must leave the extras untouched"
                    );
                }
            }
            results.push(r);
        }
        if results.len() == 2 {
            assert_eq!(
                results[0], results[1],
                "fused and unfused disagree on {self:?}"
            );
        }
        results.swap_remove(0)
    }
}

/// Asserts `r` is exactly `want`, and that its message names the argument and the sizes.
fn expect(r: Result<(), AttnError>, want: AttnError) {
    let err = match r {
        Err(e) => e,
        Ok(()) => panic!("expected {want:?}, got Ok"),
    };
    assert_eq!(err, want);
    let msg = err.to_string();
    let must_contain: Vec<String> = match &err {
        AttnError::ShapeMismatch {
            arg,
            dim,
            expected,
            got,
        } => {
            vec![
                format!("`{arg}`"),
                dim.to_string(),
                expected.to_string(),
                got.to_string(),
            ]
        }
        AttnError::BufferLength { arg, needed, got } => {
            vec![format!("`{arg}`"), needed.to_string(), got.to_string()]
        }
        AttnError::BadStride {
            arg,
            dim,
            stride,
            min,
        } => {
            vec![
                format!("`{arg}`"),
                dim.to_string(),
                stride.to_string(),
                min.to_string(),
            ]
        }
        AttnError::HeadRatio { hq, hkv } => vec![hq.to_string(), hkv.to_string()],
        AttnError::KeyLength { batch, len, lk } => {
            vec![
                "key_lengths".into(),
                batch.to_string(),
                len.to_string(),
                lk.to_string(),
            ]
        }
        AttnError::Overflow { arg } => vec![format!("`{arg}`")],
        AttnError::BadParam { arg, .. } => vec![format!("`{arg}`")],
        _ => vec![],
    };
    for s in must_contain {
        assert!(msg.contains(&s), "message {msg:?} should contain {s:?}");
    }
}

fn mismatch(arg: &'static str, dim: &'static str, expected: usize, got: usize) -> AttnError {
    AttnError::ShapeMismatch {
        arg,
        dim,
        expected,
        got,
    }
}

#[test]
fn the_base_call_is_valid() {
    Call::base().run().unwrap();
    let mut c = Call::base();
    c.lse = Some(40);
    c.weights = Some(280);
    c.key_lengths = Some(vec![7, 0]);
    c.mask = Some((true, [2, 4, 5, 7], 280));
    c.causal = Some(Causal::BottomRight);
    c.run().unwrap();
}

#[test]
fn shape_mismatch_names_argument_and_dimension() {
    type Edit = fn(&mut Call);
    let cases: Vec<(Edit, AttnError)> = vec![
        (|c| c.k[0] = 3, mismatch("k", "B", 2, 3)),
        (|c| c.k[3] = 9, mismatch("k", "D", 8, 9)),
        (|c| c.v[0] = 3, mismatch("v", "B", 2, 3)),
        (|c| c.v[1] = 1, mismatch("v", "H", 2, 1)),
        (|c| c.v[2] = 8, mismatch("v", "Lk", 7, 8)),
        (|c| c.out[0] = 3, mismatch("out", "B", 2, 3)),
        (|c| c.out[1] = 2, mismatch("out", "H", 4, 2)),
        (|c| c.out[2] = 6, mismatch("out", "Lq", 5, 6)),
        (|c| c.out[3] = 8, mismatch("out", "Dv", 6, 8)),
    ];
    for (edit, want) in cases {
        let mut c = Call::base();
        edit(&mut c);
        expect(c.run(), want);
    }
}

#[test]
fn buffers_too_short() {
    for (i, arg) in ["q", "k", "v", "out"].into_iter().enumerate() {
        let mut c = Call::base();
        let shapes = [c.q, c.k, c.v, c.out];
        let n = dense(shapes[i]);
        c.lens[i] = Some(n - 1);
        expect(
            c.run(),
            AttnError::BufferLength {
                arg,
                needed: n,
                got: n - 1,
            },
        );
        c.lens[i] = Some(0);
        expect(
            c.run(),
            AttnError::BufferLength {
                arg,
                needed: n,
                got: 0,
            },
        );
    }
    // A strided view needs its last offset plus one row, not the dense size.
    let mut c = Call::base();
    c.strides[3] = Some([300, 70, 11]);
    let needed = 300 + 3 * 70 + 4 * 11 + 6;
    c.lens[3] = Some(needed - 1);
    expect(
        c.run(),
        AttnError::BufferLength {
            arg: "out",
            needed,
            got: needed - 1,
        },
    );
    c.lens[3] = Some(needed);
    c.run().unwrap();
    // Longer buffers than needed are fine for the tensors.
    let mut c = Call::base();
    c.lens = [Some(1000), Some(1000), Some(1000), Some(1000)];
    c.run().unwrap();
}

#[test]
fn overlapping_output_strides() {
    // Rows overlap: L stride 5 < Dv = 6.
    let mut c = Call::base();
    c.strides[3] = Some([120, 30, 5]);
    c.lens[3] = Some(1000);
    expect(
        c.run(),
        AttnError::BadStride {
            arg: "out",
            dim: "L",
            stride: 5,
            min: 6,
        },
    );
    // Heads overlap rows: H stride 6 equals the L stride, so the L rows of one head run into the
    // next head.
    c.strides[3] = Some([120, 6, 6]);
    expect(
        c.run(),
        AttnError::BadStride {
            arg: "out",
            dim: "L",
            stride: 6,
            min: 24,
        },
    );
    // Batches on top of each other (stride 0).
    c.strides[3] = Some([0, 30, 6]);
    expect(
        c.run(),
        AttnError::BadStride {
            arg: "out",
            dim: "B",
            stride: 0,
            min: 6,
        },
    );
    // Valid but unusual: heads innermost (BLHD-like with padding) is fine.
    c.strides[3] = Some([200, 7, 40]);
    c.run().unwrap();
}

#[test]
fn input_views_may_overlap() {
    // Reads may alias: K and V broadcast over the batch with a zero stride give the result of
    // an explicit copy.
    let dims = Dims {
        b: 3,
        hq: 2,
        hkv: 1,
        lq: 9,
        lk: 20,
        d: 16,
        dv: 8,
    };
    let mut rng = SmallRng::seed_from_u64(1);
    let q = randn(&mut rng, dims.q().iter().product(), 1.0);
    let k1 = randn(&mut rng, 20 * 16, 1.0);
    let v1 = randn(&mut rng, 20 * 8, 1.0);
    let k3 = k1.repeat(3);
    let v3 = v1.repeat(3);
    for isa in isas() {
        let o = SdpaOptions::new().isa(isa);
        let a = sdpa_vec(
            &Tensor::bhld(&q, dims.q()),
            &Tensor::strided(&k1, dims.k(), [0, 0, 16]),
            &Tensor::strided(&v1, dims.v(), [0, 0, 8]),
            &o,
        )
        .unwrap();
        let b = sdpa_vec(
            &Tensor::bhld(&q, dims.q()),
            &Tensor::bhld(&k3, dims.k()),
            &Tensor::bhld(&v3, dims.v()),
            &o,
        )
        .unwrap();
        assert_eq!(a, b, "{isa}");
    }
}

#[test]
fn head_ratio() {
    let mut c = Call::base();
    c.k[1] = 3;
    c.v[1] = 3;
    expect(c.run(), AttnError::HeadRatio { hq: 4, hkv: 3 });
    c.k[1] = 8;
    c.v[1] = 8;
    expect(c.run(), AttnError::HeadRatio { hq: 4, hkv: 8 });
    c.k[1] = 0;
    c.v[1] = 0;
    expect(c.run(), AttnError::HeadRatio { hq: 4, hkv: 0 });
}

#[test]
fn key_lengths_errors() {
    let mut c = Call::base();
    c.key_lengths = Some(vec![7]);
    expect(c.run(), mismatch("key_lengths", "B", 2, 1));
    c.key_lengths = Some(vec![7, 7, 7]);
    expect(c.run(), mismatch("key_lengths", "B", 2, 3));
    c.key_lengths = Some(vec![7, 8]);
    expect(
        c.run(),
        AttnError::KeyLength {
            batch: 1,
            len: 8,
            lk: 7,
        },
    );
    c.key_lengths = Some(vec![usize::MAX, 0]);
    expect(
        c.run(),
        AttnError::KeyLength {
            batch: 0,
            len: usize::MAX,
            lk: 7,
        },
    );
    c.key_lengths = Some(vec![7, 0]);
    c.run().unwrap();
}

#[test]
fn mask_errors() {
    for is_bias in [false, true] {
        let arg = if is_bias { "bias" } else { "bool_mask" };
        let cases = [
            ([3, 1, 5, 7], mismatch(arg, "B", 2, 3)),
            ([2, 3, 5, 7], mismatch(arg, "H", 4, 3)),
            ([2, 2, 5, 7], mismatch(arg, "H", 4, 2)),
            ([1, 1, 4, 7], mismatch(arg, "Lq", 5, 4)),
            ([1, 1, 5, 8], mismatch(arg, "Lk", 7, 8)),
            ([1, 1, 1, 1], mismatch(arg, "Lk", 7, 1)),
            ([2, 4, 5, 6], mismatch(arg, "Lk", 7, 6)),
        ];
        for (shape, want) in cases {
            let mut c = Call::base();
            c.mask = Some((is_bias, shape, dense(shape)));
            expect(c.run(), want);
        }
        // Every broadcastable shape is accepted...
        for shape in [
            [1, 1, 1, 7],
            [2, 1, 1, 7],
            [1, 4, 1, 7],
            [1, 1, 5, 7],
            [2, 4, 5, 7],
            [2, 1, 5, 7],
        ] {
            let mut c = Call::base();
            c.mask = Some((is_bias, shape, dense(shape)));
            c.run().unwrap_or_else(|e| panic!("{shape:?}: {e}"));
            // ...and its buffer must have exactly the dense length.
            for n in [dense(shape) - 1, dense(shape) + 1, 0] {
                c.mask = Some((is_bias, shape, n));
                expect(
                    c.run(),
                    AttnError::BufferLength {
                        arg,
                        needed: dense(shape),
                        got: n,
                    },
                );
            }
        }
    }
}

#[test]
fn extras_of_wrong_length() {
    for n in [39, 41, 0] {
        let mut c = Call::base();
        c.lse = Some(n);
        expect(
            c.run(),
            AttnError::BufferLength {
                arg: "lse",
                needed: 40,
                got: n,
            },
        );
    }
    for n in [279, 281, 40] {
        let mut c = Call::base();
        c.weights = Some(n);
        expect(
            c.run(),
            AttnError::BufferLength {
                arg: "weights",
                needed: 280,
                got: n,
            },
        );
    }
}

#[test]
fn non_finite_scale() {
    for s in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut c = Call::base();
        c.scale = Some(s);
        let r = c.run();
        assert!(
            matches!(r, Err(AttnError::BadParam { arg: "scale", .. })),
            "scale {s}: {r:?}"
        );
        expect(r.clone(), r.unwrap_err());
    }
    let mut c = Call::base();
    c.scale = Some(0.0);
    c.run().unwrap();
}

#[test]
fn bad_window() {
    // A sliding window needs causal masking, and must be at least 1.
    let mut c = Call::base();
    c.window = Some(3);
    let r = c.run();
    assert!(
        matches!(r, Err(AttnError::BadParam { arg: "window", .. })),
        "window without causal: {r:?}"
    );
    expect(r.clone(), r.unwrap_err());
    c.causal = Some(Causal::TopLeft);
    c.run().unwrap();
    c.window = Some(0);
    let r = c.run();
    assert!(
        matches!(r, Err(AttnError::BadParam { arg: "window", .. })),
        "window 0: {r:?}"
    );
    expect(r.clone(), r.unwrap_err());
}

#[test]
fn strides_whose_extent_overflows() {
    for (i, arg) in ["q", "k", "v", "out"].into_iter().enumerate() {
        let mut c = Call::base();
        // B and H offsets each fit, their sum does not (or H·stride itself overflows).
        c.strides[i] = Some([usize::MAX / 2 + 1, usize::MAX / 2 + 1, 16]);
        c.lens[i] = Some(64);
        expect(c.run(), AttnError::Overflow { arg });
        // (L − 1)·stride overflows (L − 1 ≥ 4).
        c.strides[i] = Some([64, 64, usize::MAX / 3]);
        expect(c.run(), AttnError::Overflow { arg });
    }
}

/// Sizes whose products overflow `usize` give `Overflow`, not a panic or a wrapped size. The
/// tensors have D = 0 or Dv = 0, so their buffers are empty and valid. B·Hq = 2⁶⁴ is refused as
/// `q` itself (task counts multiply it); with M = 2¹⁶ per dimension, B·Hq·Lq and Lq·Lk fit, and
/// the overflowing product is that of the mask, the weights or `sdpa_vec`'s output.
#[test]
fn size_products_that_overflow() {
    let mut c = Call::base();
    (c.q, c.k, c.v, c.out) = (
        [BIG, BIG, 1, 0],
        [BIG, 1, 1, 0],
        [BIG, 1, 1, 0],
        [BIG, BIG, 1, 0],
    );
    c.lens = [Some(0); 4];
    expect(c.run(), AttnError::Overflow { arg: "q" });
    const M: usize = 1 << 16;
    (c.q, c.k, c.v, c.out) = ([M, M, M, 0], [M, 1, M, 0], [M, 1, M, 0], [M, M, M, 0]);
    c.mask = Some((false, [M, M, M, M], 0));
    expect(c.run(), AttnError::Overflow { arg: "bool_mask" });
    c.mask = Some((true, [M, M, M, M], 0));
    expect(c.run(), AttnError::Overflow { arg: "bias" });
    c.mask = None;
    c.weights = Some(0);
    expect(c.run(), AttnError::Overflow { arg: "weights" });

    let q: [f32; 0] = [];
    let r = sdpa_vec(
        &Tensor::bhld(&q, [BIG, BIG, 1, 0]),
        &Tensor::bhld(&q, [BIG, 1, 0, 0]),
        &Tensor::bhld(&q, [BIG, 1, 0, 1]),
        &SdpaOptions::new(),
    );
    // The inputs are validated before the output is sized: B·Hq already overflows in `q`.
    assert_eq!(r, Err(AttnError::Overflow { arg: "q" }));
}

/// A dense view whose element count overflows is reported as `Overflow` by the call, rather than
/// panicking (debug builds) or wrapping (release builds) while the view computes its strides.
#[test]
fn dense_view_of_overflowing_shape_is_an_error_not_a_panic() {
    let r = std::panic::catch_unwind(|| {
        let empty: [f32; 0] = [];
        let mut none: [f32; 0] = [];
        let shape = [1, BIG, BIG, 2];
        sdpa(
            &Tensor::bhld(&empty, shape),
            &Tensor::strided(&empty, [1, 1, 1, 2], [0, 0, 0]),
            &Tensor::strided(&empty, [1, 1, 1, 2], [0, 0, 0]),
            &mut TensorMut::strided(&mut none, shape, [0, 0, 0]),
            &SdpaOptions::new(),
        )
    });
    match r {
        Ok(res) => assert_eq!(res, Err(AttnError::Overflow { arg: "q" })),
        Err(_) => panic!("Tensor::bhld / sdpa panicked on a shape whose size overflows usize"),
    }
}

/// B·H·Lq overflowing while every buffer is empty (D = Dv = Lk = 0): nothing can be written, so
/// the call must not panic (it may return Ok or Overflow).
#[test]
fn huge_empty_problem_does_not_panic() {
    let r = std::panic::catch_unwind(|| {
        let mut c = Call::base();
        (c.q, c.k, c.v, c.out) = (
            [BIG, BIG, 1, 0],
            [BIG, 1, 0, 0],
            [BIG, 1, 0, 0],
            [BIG, BIG, 1, 0],
        );
        c.lens = [Some(0); 4];
        c.run()
    });
    match r {
        Ok(Ok(())) | Ok(Err(AttnError::Overflow { .. })) => {}
        Ok(Err(e)) => panic!("unexpected error {e:?}"),
        Err(_) => panic!("sdpa panicked on B·H·Lq = 2^64 with empty buffers"),
    }
}

// ---------------------------------------------------------------------------------------------
// Zero-sized dimensions.

/// Dense random q, k, v of `dims`.
fn zero_data(dims: Dims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = SmallRng::seed_from_u64(2);
    let q = randn(&mut rng, dims.q().iter().product(), 1.0);
    let k = randn(&mut rng, dims.k().iter().product(), 1.0);
    let v = randn(&mut rng, dims.v().iter().product(), 1.0);
    (q, k, v)
}

/// Runs fused (with lse and weights) and unfused on every ISA; returns (out, lse, weights) of the
/// fused call after checking the unfused output is equal.
fn run_zero(
    dims: Dims,
    causal: Option<Causal>,
    key_lengths: Option<&[usize]>,
    out_len: usize,
) -> Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (q, k, v) = zero_data(dims);
    let rows = dims.b * dims.hq * dims.lq;
    let mut res = Vec::new();
    for isa in isas() {
        let mut o = SdpaOptions::new().isa(isa);
        if let Some(c) = causal {
            o = o.causal(c);
        }
        if let Some(l) = key_lengths {
            o = o.key_lengths(l);
        }
        let mut out = vec![f32::NAN; out_len];
        let mut lse = vec![f32::NAN; rows];
        let mut w = vec![f32::NAN; rows * dims.lk];
        let (qt, kt, vt) = (
            Tensor::bhld(&q, dims.q()),
            Tensor::bhld(&k, dims.k()),
            Tensor::bhld(&v, dims.v()),
        );
        sdpa_ext(
            &qt,
            &kt,
            &vt,
            &mut TensorMut::bhld(&mut out, dims.out()),
            &o,
            Extras {
                lse: Some(&mut lse),
                weights: Some(&mut w),
            },
        )
        .unwrap_or_else(|e| panic!("{isa} {dims:?}: {e}"));
        let mut out2 = vec![f32::NAN; out_len];
        unfused::sdpa_unfused(
            &qt,
            &kt,
            &vt,
            &mut TensorMut::bhld(&mut out2, dims.out()),
            &o,
        )
        .unwrap();
        for (a, b) in out.iter().zip(&out2) {
            let same = (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-5 + 1e-5 * a.abs();
            assert!(same, "{isa} {dims:?}: fused {a} and unfused {b} differ");
        }
        res.push((out, lse, w));
    }
    res
}

#[test]
fn empty_batch_heads_or_queries_write_nothing() {
    for dims in [
        Dims {
            b: 0,
            hq: 4,
            hkv: 2,
            lq: 5,
            lk: 7,
            d: 8,
            dv: 6,
        },
        Dims {
            b: 2,
            hq: 0,
            hkv: 0,
            lq: 5,
            lk: 7,
            d: 8,
            dv: 6,
        },
        Dims {
            b: 2,
            hq: 0,
            hkv: 2,
            lq: 5,
            lk: 7,
            d: 8,
            dv: 6,
        },
        Dims {
            b: 2,
            hq: 4,
            hkv: 2,
            lq: 0,
            lk: 7,
            d: 8,
            dv: 6,
        },
    ] {
        // A non-empty output buffer: nothing in it may be written.
        for (out, lse, w) in run_zero(dims, Some(Causal::BottomRight), None, 17) {
            assert!(out.iter().all(|x| x.is_nan()), "{dims:?}: output written");
            assert!(lse.is_empty() && w.is_empty());
        }
    }
}

#[test]
fn no_keys_gives_zeros() {
    let dims = Dims {
        b: 2,
        hq: 4,
        hkv: 2,
        lq: 5,
        lk: 0,
        d: 8,
        dv: 6,
    };
    for causal in [None, Some(Causal::TopLeft), Some(Causal::BottomRight)] {
        for (out, lse, w) in run_zero(dims, causal, Some(&[0, 0]), 240) {
            assert!(
                out.iter().all(|&x| x == 0.0),
                "Lk = 0 must give zeros, got {out:?}"
            );
            assert!(
                lse.iter().all(|&x| x == f32::NEG_INFINITY),
                "Lk = 0: lse must be -inf, got {lse:?}"
            );
            assert!(w.is_empty());
        }
    }
}

#[test]
fn zero_head_dim_gives_uniform_average_of_v() {
    // D = 0: every logit is 0, so each row is the mean of V over its visible keys.
    let dims = Dims {
        b: 2,
        hq: 4,
        hkv: 2,
        lq: 70,
        lk: 133,
        d: 0,
        dv: 6,
    };
    let lens = [133usize, 50];
    for causal in [
        None,
        Some(Causal::TopLeft),
        Some(Causal::BottomRight),
        Some(Causal::BottomRightAtLk),
    ] {
        let (_, _, v) = zero_data(dims);
        for (out, lse, w) in run_zero(dims, causal, Some(&lens), 2 * 4 * 70 * 6) {
            for b in 0..dims.b {
                for h in 0..dims.hq {
                    for i in 0..dims.lq {
                        let lim = match causal {
                            None => lens[b],
                            Some(Causal::TopLeft) => lens[b].min(i + 1),
                            // Bottom-right aligns to each batch's own key length.
                            Some(Causal::BottomRight) => {
                                (i + 1 + lens[b]).saturating_sub(dims.lq).min(lens[b])
                            }
                            // At Lk: the diagonal of the full buffer, then the padding.
                            Some(Causal::BottomRightAtLk) => {
                                (i + 1 + dims.lk).saturating_sub(dims.lq).min(lens[b])
                            }
                        };
                        let row = (b * dims.hq + h) * dims.lq + i;
                        let kh = h / 2;
                        for c in 0..dims.dv {
                            // A row with no visible key (bottom-right, short sequence) is 0.
                            let sum: f64 = (0..lim)
                                .map(|j| v[((b * 2 + kh) * dims.lk + j) * dims.dv + c] as f64)
                                .sum();
                            let mean = if lim == 0 { 0.0 } else { sum / lim as f64 };
                            let g = out[row * dims.dv + c] as f64;
                            assert!(
                                (g - mean).abs() <= 1e-5 + 1e-5 * mean.abs(),
                                "D=0 row {row} col {c}: {g} vs mean {mean}"
                            );
                        }
                        let want_lse = (lim as f64).ln();
                        let lse_ok = if lim == 0 {
                            lse[row] == f32::NEG_INFINITY
                        } else {
                            (lse[row] as f64 - want_lse).abs() <= 1e-5 * (1.0 + want_lse)
                        };
                        assert!(lse_ok, "D=0 row {row}: lse {} vs {want_lse}", lse[row]);
                        for j in 0..dims.lk {
                            let want = if j < lim { 1.0 / lim as f32 } else { 0.0 };
                            assert!(
                                (w[row * dims.lk + j] - want).abs() <= 1e-6,
                                "D=0 weight ({row},{j})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn zero_value_dim_is_ok_and_lse_still_computed() {
    let dims = Dims {
        b: 2,
        hq: 4,
        hkv: 2,
        lq: 9,
        lk: 11,
        d: 8,
        dv: 0,
    };
    let (q, k, _) = zero_data(dims);
    let r = reference(&Problem {
        dims,
        q: &q,
        k: &k,
        v: &[],
        scale: 1.0 / 8f64.sqrt(),
        causal: Some(Causal::TopLeft),
        window: None,
        mask: RefMask::None,
        key_lengths: None,
        alibi: None,
        softcap: None,
        sinks: None,
    });
    for (out, lse, w) in run_zero(dims, Some(Causal::TopLeft), None, 5) {
        assert!(out.iter().all(|x| x.is_nan()), "Dv = 0 must write nothing");
        for (g, want) in lse.iter().zip(&r.lse) {
            assert!(
                (*g as f64 - want).abs() <= 1e-5 + 1e-5 * want.abs(),
                "Dv = 0: lse {g} vs {want}"
            );
        }
        for (g, want) in w.iter().zip(&r.w) {
            assert!(
                (*g as f64 - want).abs() <= 1e-5,
                "Dv = 0: weight {g} vs {want}"
            );
        }
    }
}

#[test]
fn bad_score_modifiers() {
    // Base: Hq = 4. Slopes and sinks need one value per query head.
    for n in [0usize, 2, 3, 5] {
        let mut c = Call::base();
        c.alibi = Some(vec![0.5; n]);
        expect(c.run(), mismatch("alibi", "Hq", 4, n));
        let mut c = Call::base();
        c.sinks = Some(vec![0.5; n]);
        expect(c.run(), mismatch("sinks", "Hq", 4, n));
    }
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut c = Call::base();
        c.alibi = Some(vec![0.5, bad, 0.1, 0.2]);
        let r = c.run();
        assert!(
            matches!(r, Err(AttnError::BadParam { arg: "alibi", .. })),
            "slope {bad}: {r:?}"
        );
        expect(r.clone(), r.unwrap_err());
    }
    for bad in [f32::NAN, f32::INFINITY] {
        let mut c = Call::base();
        c.sinks = Some(vec![0.5, bad, 0.1, 0.2]);
        let r = c.run();
        assert!(
            matches!(r, Err(AttnError::BadParam { arg: "sinks", .. })),
            "sink {bad}: {r:?}"
        );
        expect(r.clone(), r.unwrap_err());
    }
    for bad in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut c = Call::base();
        c.softcap = Some(bad);
        let r = c.run();
        assert!(
            matches!(r, Err(AttnError::BadParam { arg: "softcap", .. })),
            "softcap {bad}: {r:?}"
        );
        expect(r.clone(), r.unwrap_err());
    }
    // Valid: −inf sinks (no sink for that head), negative slopes, tiny caps, all at once.
    let mut c = Call::base();
    c.alibi = Some(vec![-0.5, 0.0, 0.25, 1e-3]);
    c.sinks = Some(vec![f32::NEG_INFINITY, 0.0, -3.0, 8.0]);
    c.softcap = Some(1e-3);
    c.causal = Some(Causal::BottomRight);
    c.window = Some(2);
    c.run().unwrap();
}
