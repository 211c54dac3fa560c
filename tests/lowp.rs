//! bf16 and f16 operands through the public API. The kernels widen them exactly, so a call on
//! 16-bit Q, K, V must return *bitwise* what the f32 call returns on the widened values: output
//! (f32), logsumexp and weights, on every ISA and kernel, over odd shapes, GQA, Lq ≠ Lk, one
//! row, D and Dv tails, strided views, masks, key lengths and every score modifier; a 16-bit
//! output is that f32 result rounded once. The exceptions are the bf16 pair and tile paths
//! (`FlashPath::Bf16Pairs`, `FlashPath::AmxTiles`), which round the softmax weights to bf16:
//! there the output must stay within that rounding's bound of the f32 result, the logsumexp and weights within f32
//! rounding. (tests/golden.rs holds the f64 goldens of these
//! inputs; this file checks that nothing on the path treats 16-bit data differently.)

mod common;

use attnkit::kernels::flash_path;
use attnkit::{
    bf16, choose_kernel, f16, sdpa, sdpa_ext, sdpa_vec, AttnError, Causal, Elem, Extras, Kernel,
    MaskRef, Operand, SdpaOptions, Tensor, TensorMut,
};
use common::{decode_reorders, isas, lh, randn, same_values};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// `(B, Hq, Hkv, Lq, Lk, D, Dv)`: one element; GQA with odd sizes; decode shapes (one chunk and
/// two split-KV chunks); D and Dv tails past a key block.
const SHAPES: [[usize; 7]; 7] = [
    [1, 1, 1, 1, 1, 1, 1],
    [2, 4, 2, 7, 13, 5, 3],
    [1, 8, 2, 1, 389, 128, 128],
    [1, 2, 2, 33, 70, 64, 64],
    [2, 3, 1, 17, 17, 24, 40],
    [1, 2, 1, 130, 300, 80, 17],
    [1, 4, 4, 3, 600, 64, 64],
];

/// Values of `E` and the same values widened.
fn values<E: Elem>(rng: &mut SmallRng, n: usize) -> (Vec<E>, Vec<f32>) {
    let e: Vec<E> = randn(rng, n, 1.0).into_iter().map(E::from_f32).collect();
    let f = e.iter().map(|x| x.to_f32()).collect();
    (e, f)
}

/// Every option set of this file for a problem of `b` batches, `hq` heads, `lq × lk` scores.
struct Mods {
    bias: Vec<f32>,
    mask: Vec<bool>,
    lens: Vec<usize>,
    slopes: Vec<f32>,
    sinks: Vec<f32>,
}

impl Mods {
    fn new(rng: &mut SmallRng, b: usize, hq: usize, lq: usize, lk: usize) -> Mods {
        Mods {
            bias: randn(rng, hq * lq * lk, 1.0),
            // Keep key 0 visible so no row is fully masked by chance (those are tested apart).
            mask: (0..lq * lk)
                .map(|i| i % lk == 0 || rng.gen_bool(0.7))
                .collect(),
            lens: (0..b).map(|i| lk - (i * 3).min(lk - 1)).collect(),
            slopes: attnkit::alibi_slopes(hq, 8.0),
            sinks: (0..hq).map(|i| i as f32 * 0.5 - 1.0).collect(),
        }
    }

    fn options(&self, which: usize, hq: usize, lq: usize, lk: usize) -> SdpaOptions<'_> {
        let o = SdpaOptions::new();
        match which {
            0 => o,
            1 => o.causal(Causal::TopLeft),
            2 => o.causal(Causal::BottomRight).key_lengths(&self.lens),
            3 => o
                .bias(MaskRef::new(&self.bias, [1, hq, lq, lk]))
                .bool_mask(MaskRef::lq_lk(&self.mask, lq, lk)),
            4 => o.softcap(20.0).alibi(&self.slopes).sinks(&self.sinks),
            _ => o.causal(Causal::BottomRight).window(5),
        }
    }
}

const OPTION_SETS: usize = 6;

fn check<E: Operand + Elem>(rng: &mut SmallRng, shape: [usize; 7]) {
    let [b, hq, hkv, lq, lk, d, dv] = shape;
    let (q, qf) = values::<E>(rng, b * hq * lq * d);
    let (k, kf) = values::<E>(rng, b * hkv * lk * d);
    let (v, vf) = values::<E>(rng, b * hkv * lk * dv);
    let (qs, ks, vs, os) = (
        [b, hq, lq, d],
        [b, hkv, lk, d],
        [b, hkv, lk, dv],
        [b, hq, lq, dv],
    );
    let mods = Mods::new(rng, b, hq, lq, lk);
    let n_out = b * hq * lq * dv;
    for isa in isas() {
        for which in 0..OPTION_SETS {
            for kernel in [Kernel::Auto, Kernel::Prefill, Kernel::Decode] {
                // Q and out as (B, L, H, D) memory in one of the two layouts, to cover strides.
                for blhd in [false, true] {
                    let opts = mods.options(which, hq, lq, lk).isa(isa).kernel(kernel);
                    let at = format!(
                        "{:?} {isa} {kernel:?} shape {shape:?} options {which} blhd {blhd}",
                        E::DTYPE
                    );
                    let (tq, tqf) = if blhd {
                        (Tensor::blhd(&q, lh(qs)), Tensor::blhd(&qf, lh(qs)))
                    } else {
                        (Tensor::bhld(&q, qs), Tensor::bhld(&qf, qs))
                    };
                    // Weights only where they cannot change the kernel (Auto would pick prefill).
                    let weights = kernel == Kernel::Prefill;
                    let pairs = choose_kernel(qs, ks, &opts) == Kernel::Prefill
                        && flash_path(isa, E::DTYPE, E::DTYPE, d).rounds_weights();
                    let run_f32 =
                        |v: &[f32], out: &mut Vec<f32>, lse: &mut Vec<f32>, w: &mut Vec<f32>| {
                            let o = if blhd {
                                &mut TensorMut::blhd(out, lh(os))
                            } else {
                                &mut TensorMut::bhld(out, os)
                            };
                            let extras = Extras {
                                lse: Some(lse),
                                weights: weights.then_some(w.as_mut_slice()),
                            };
                            let (tk, tv) = (Tensor::bhld(&kf, ks), Tensor::bhld(v, vs));
                            sdpa_ext(&tqf, &tk, &tv, o, &opts, extras).unwrap();
                        };
                    let lens = (n_out, b * hq * lq, b * hq * lq * lk);
                    let (mut want, mut want_lse, mut want_w) = (
                        vec![f32::NAN; lens.0],
                        vec![f32::NAN; lens.1],
                        vec![0.0; lens.2],
                    );
                    run_f32(&vf, &mut want, &mut want_lse, &mut want_w);
                    let (mut got, mut got_lse, mut got_w) = (
                        vec![f32::NAN; lens.0],
                        vec![f32::NAN; lens.1],
                        vec![0.0; lens.2],
                    );
                    {
                        let o = if blhd {
                            &mut TensorMut::blhd(&mut got, lh(os))
                        } else {
                            &mut TensorMut::bhld(&mut got, os)
                        };
                        let extras = Extras {
                            lse: Some(&mut got_lse),
                            weights: weights.then_some(got_w.as_mut_slice()),
                        };
                        let (tk, tv) = (Tensor::bhld(&k, ks), Tensor::bhld(&v, vs));
                        sdpa_ext(&tq, &tk, &tv, o, &opts, extras).unwrap();
                    }
                    let reordered = decode_reorders(E::DTYPE, isa, kernel);
                    let same = |a: &[f32], b: &[f32], what: &str| {
                        same_values(a, b, reordered, &format!("{at}: {what} vs f32"));
                    };
                    if pairs {
                        // Σⱼ pⱼ·|vⱼ| per output, from the f32 call on |V|: each weight is
                        // rounded to bf16 (relative 2⁻⁸).
                        let vabs: Vec<f32> = vf.iter().map(|x| x.abs()).collect();
                        let mut spread = vec![f32::NAN; lens.0];
                        let (mut l, mut w) = (vec![0.0; lens.1], vec![0.0; lens.2]);
                        run_f32(&vabs, &mut spread, &mut l, &mut w);
                        let near = |a: &[f32], b: &[f32], bound: &dyn Fn(usize) -> f32, what| {
                            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                                let tol = 1e-5 + 1e-5 * y.abs() + bound(i);
                                assert!(
                                    (x - y).abs() <= tol || x == y,
                                    "{at}: {what}[{i}] {x} vs f32 {y} (tolerance {tol:e})"
                                );
                            }
                        };
                        near(&got, &want, &|i| spread[i] / 256.0, "out");
                        near(&got_lse, &want_lse, &|_| 0.0, "lse");
                        near(&got_w, &want_w, &|_| 0.0, "weights");
                    } else {
                        same(&got, &want, "out");
                        same(&got_lse, &want_lse, "lse");
                        same(&got_w, &want_w, "weights");
                    }
                    // The same call writing E: its f32 result rounded once, in the same layout.
                    let mut half = vec![E::from_f32(f32::NAN); n_out];
                    {
                        let o = if blhd {
                            &mut TensorMut::blhd(&mut half, lh(os))
                        } else {
                            &mut TensorMut::bhld(&mut half, os)
                        };
                        let (tk, tv) = (Tensor::bhld(&k, ks), Tensor::bhld(&v, vs));
                        sdpa(&tq, &tk, &tv, o, &opts).unwrap();
                    }
                    for (i, (x, y)) in half.iter().zip(&got).enumerate() {
                        assert_eq!(
                            x.to_f32().to_bits(),
                            E::from_f32(*y).to_f32().to_bits(),
                            "{at}: out[{i}] in {:?} is not the f32 result {y} rounded",
                            E::DTYPE
                        );
                    }
                }
            }
        }
    }
    // The allocating entry point returns the same f32 output (dense (B, H, L, Dv)), on the
    // widest widening path (whatever `ATTNKIT_ISA` says: the pair and tile paths are not
    // bitwise).
    let widening = attnkit::Isa::available()
        .into_iter()
        .rfind(|&i| !matches!(i, attnkit::Isa::Avx512Bf16 | attnkit::Isa::Amx))
        .unwrap();
    let opts = SdpaOptions::new().isa(widening);
    let dense = sdpa_vec(
        &Tensor::bhld(&q, qs),
        &Tensor::bhld(&k, ks),
        &Tensor::bhld(&v, vs),
        &opts,
    )
    .unwrap();
    let dense_f32 = sdpa_vec(
        &Tensor::bhld(&qf, qs),
        &Tensor::bhld(&kf, ks),
        &Tensor::bhld(&vf, vs),
        &opts,
    )
    .unwrap();
    let reordered = decode_reorders(E::DTYPE, widening, Kernel::Auto);
    same_values(
        &dense,
        &dense_f32,
        reordered,
        &format!("{:?} sdpa_vec", E::DTYPE),
    );
}

#[test]
fn bf16_operands_compute_what_f32_computes_on_their_values() {
    let mut rng = SmallRng::seed_from_u64(31);
    for shape in SHAPES {
        check::<bf16>(&mut rng, shape);
    }
}

#[test]
fn f16_operands_compute_what_f32_computes_on_their_values() {
    let mut rng = SmallRng::seed_from_u64(32);
    for shape in SHAPES {
        check::<f16>(&mut rng, shape);
    }
}

/// Large logits stay finite and fully masked rows are zeros, as in f32; f16's range ends at
/// 65504, so the inputs are large but representable.
#[test]
fn huge_logits_and_fully_masked_rows_in_16_bits() {
    let (b, h, l, d) = (1, 2, 9, 16);
    let q: Vec<f16> = (0..b * h * l * d)
        .map(|i| f16::from_f32(if i % 2 == 0 { 300.0 } else { -250.0 }))
        .collect();
    let mask: Vec<bool> = (0..l * l).map(|i| i / l != 4).collect(); // row 4 sees nothing
    for isa in isas() {
        for kernel in [Kernel::Prefill, Kernel::Decode] {
            let opts = SdpaOptions::new()
                .isa(isa)
                .kernel(kernel)
                .bool_mask(MaskRef::lq_lk(&mask, l, l));
            let t = Tensor::bhld(&q, [b, h, l, d]);
            let mut out = vec![f16::from_f32(f32::NAN); b * h * l * d];
            sdpa(
                &t,
                &t,
                &t,
                &mut TensorMut::bhld(&mut out, [b, h, l, d]),
                &opts,
            )
            .unwrap();
            for (i, x) in out.iter().enumerate() {
                let row = (i / d) % l;
                assert!(x.to_f32().is_finite(), "{isa} {kernel:?}: out[{i}] = {x}");
                if row == 4 {
                    assert_eq!(x.to_f32(), 0.0, "{isa} {kernel:?}: masked row {i}");
                }
            }
        }
    }
}

/// A 16-bit buffer shorter than its view is refused, naming it, and the output is untouched.
#[test]
fn short_16_bit_buffers_are_refused_by_name() {
    let shape = [1, 2, 5, 8];
    let n: usize = shape.iter().product();
    let x = vec![bf16::from_f32(0.5); n];
    let short = &x[..n - 1];
    let mut out = vec![bf16::from_f32(7.0); n];
    for (arg, q, k, v) in [
        ("q", short, &x[..], &x[..]),
        ("k", &x[..], short, &x[..]),
        ("v", &x[..], &x[..], short),
    ] {
        let err = sdpa(
            &Tensor::bhld(q, shape),
            &Tensor::bhld(k, shape),
            &Tensor::bhld(v, shape),
            &mut TensorMut::bhld(&mut out, shape),
            &SdpaOptions::new(),
        )
        .unwrap_err();
        assert!(
            matches!(err, AttnError::BufferLength { arg: a, needed, got } if a == arg && needed == n && got == n - 1),
            "{arg}: {err:?}"
        );
        assert!(out.iter().all(|o| o.to_f32() == 7.0), "{arg}: out changed");
    }
    let mut short_out = vec![f16::from_f32(7.0); n - 1];
    let t = Tensor::bhld(&x, shape);
    let err = sdpa(
        &t,
        &t,
        &t,
        &mut TensorMut::bhld(&mut short_out, shape),
        &SdpaOptions::new(),
    )
    .unwrap_err();
    assert!(
        matches!(err, AttnError::BufferLength { arg: "out", .. }),
        "{err:?}"
    );
    assert!(short_out.iter().all(|o| o.to_f32() == 7.0), "out changed");
}
