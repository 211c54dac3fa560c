//! `Precision::Medium`: f32 Q, K and V through the bf16 pair products. Where an ISA has them the
//! call must return bitwise what bf16 operands holding the rounded values return on the pair
//! path (the same kernel and products: output, logsumexp and weights), over odd shapes, GQA,
//! Lq ≠ Lk, D and Dv tails, strided queries, masks and every score modifier, and stay within the
//! weight rounding's bound of the f32 result on those values. Where it does not apply (odd D,
//! the decode kernel, 16-bit operands) the call is bitwise the default one; a forced ISA without
//! bf16 products is refused by name and writes nothing.

mod common;

use attnkit::{
    bf16, sdpa, sdpa_ext, AttnError, Causal, Extras, Isa, Kernel, MaskRef, Precision, SdpaOptions,
    Tensor, TensorMut,
};
use common::{isas, lh, randn};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// `(B, Hq, Hkv, Lq, Lk, D, Dv)`, D even: one row and one key; D = 0 (V still read, rounded);
/// GQA with odd sizes; D and Dv tails; several key blocks; one query block of more than 96 rows.
const SHAPES: [[usize; 7]; 7] = [
    [1, 1, 1, 1, 1, 2, 1],
    [1, 2, 1, 3, 5, 0, 4],
    [2, 4, 2, 7, 13, 6, 3],
    [1, 2, 2, 33, 70, 64, 64],
    [2, 3, 1, 17, 17, 24, 40],
    [1, 2, 1, 130, 300, 80, 17],
    [1, 2, 2, 9, 600, 128, 128],
];

/// The ISA where Medium takes the pair products.
fn has_pairs(isa: Isa) -> bool {
    isa == Isa::Avx512Bf16
}

/// The ISAs that accept Medium when forced: those with bf16 products (on `Amx` it keeps the
/// f32 products).
fn accepts(isa: Isa) -> bool {
    matches!(isa, Isa::Avx512Bf16 | Isa::Amx)
}

fn rounded(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

struct Case {
    shape: [usize; 7],
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    bias: Vec<f32>,
    mask: Vec<bool>,
    slopes: Vec<f32>,
    sinks: Vec<f32>,
}

impl Case {
    fn new(rng: &mut SmallRng, shape: [usize; 7], q_scale: f32) -> Case {
        let [b, hq, hkv, lq, lk, d, dv] = shape;
        Case {
            shape,
            q: randn(rng, b * hq * lq * d, q_scale),
            k: randn(rng, b * hkv * lk * d, 1.0),
            v: randn(rng, b * hkv * lk * dv, 1.0),
            bias: randn(rng, hq * lq * lk, 1.0),
            // Key 0 stays visible: no row is fully masked by chance (one is, on purpose, below).
            mask: (0..lq * lk)
                .map(|i| i % lk == 0 || rng.gen_bool(0.7))
                .collect(),
            slopes: attnkit::alibi_slopes(hq, 8.0),
            sinks: (0..hq).map(|i| i as f32 * 0.5 - 1.0).collect(),
        }
    }

    fn options(&self, which: usize) -> SdpaOptions<'_> {
        let [_, hq, _, lq, lk, ..] = self.shape;
        let o = SdpaOptions::new();
        match which {
            0 => o,
            1 => o.causal(Causal::TopLeft),
            2 => o
                .bias(MaskRef::new(&self.bias, [1, hq, lq, lk]))
                .bool_mask(MaskRef::lq_lk(&self.mask, lq, lk)),
            3 => o.softcap(20.0).alibi(&self.slopes).sinks(&self.sinks),
            _ => o.causal(Causal::BottomRight).window(5),
        }
    }

    fn dims(&self) -> [[usize; 4]; 4] {
        let [b, hq, hkv, lq, lk, d, dv] = self.shape;
        [
            [b, hq, lq, d],
            [b, hkv, lk, d],
            [b, hkv, lk, dv],
            [b, hq, lq, dv],
        ]
    }

    /// Output, logsumexp and weights of one call on Q, K, V of type `E` (Q as (B, L, H, D)
    /// memory when `blhd`).
    fn run<E: attnkit::Elem + attnkit::Operand>(
        &self,
        q: &[E],
        k: &[E],
        v: &[E],
        blhd: bool,
        opts: &SdpaOptions,
    ) -> Result<[Vec<f32>; 3], AttnError> {
        let [qs, ks, vs, os] = self.dims();
        let [b, hq, _, lq, lk, ..] = self.shape;
        let mut out = vec![f32::NAN; os.iter().product()];
        let mut lse = vec![f32::NAN; b * hq * lq];
        let mut w = vec![f32::NAN; b * hq * lq * lk];
        let tq = if blhd {
            Tensor::blhd(q, lh(qs))
        } else {
            Tensor::bhld(q, qs)
        };
        let extras = Extras {
            lse: Some(&mut lse),
            weights: (opts.kernel == Kernel::Prefill).then_some(w.as_mut_slice()),
        };
        sdpa_ext(
            &tq,
            &Tensor::bhld(k, ks),
            &Tensor::bhld(v, vs),
            &mut TensorMut::bhld(&mut out, os),
            opts,
            extras,
        )?;
        Ok([out, lse, w])
    }
}

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn medium_is_the_pair_path_on_rounded_values() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0015);
    let pair_isas: Vec<Isa> = isas().into_iter().filter(|&i| has_pairs(i)).collect();
    if pair_isas.is_empty() {
        eprintln!("no ISA with bf16 products here: Medium is checked by the fallback test only");
        return;
    }
    for shape in SHAPES {
        // Huge logits on the last pass: the outputs stay finite.
        for q_scale in [1.0, 3e3] {
            let c = Case::new(&mut rng, shape, q_scale);
            let (qr, kr, vr) = (rounded(&c.q), rounded(&c.k), rounded(&c.v));
            let to_bf16 = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
            let (qb, kb, vb) = (to_bf16(&c.q), to_bf16(&c.k), to_bf16(&c.v));
            let vabs: Vec<f32> = vr.iter().map(|x| x.abs()).collect();
            for which in 0..5 {
                for blhd in [false, true] {
                    // The pair path on bf16 operands.
                    let base = c.options(which).kernel(Kernel::Prefill);
                    let want = c
                        .run(&qb, &kb, &vb, blhd, &base.isa(Isa::Avx512Bf16))
                        .unwrap();
                    for &isa in &pair_isas {
                        let at = format!(
                            "{isa} shape {shape:?} options {which} blhd {blhd} q×{q_scale}"
                        );
                        let opts = base.isa(isa).precision(Precision::Medium);
                        let got = c.run(&c.q, &c.k, &c.v, blhd, &opts).unwrap();
                        for (g, w, what) in [(0, 0, "out"), (1, 1, "lse"), (2, 2, "weights")] {
                            same_bits(&got[g], &want[w], &format!("{at}: {what}"));
                        }
                        assert!(got[0].iter().all(|x| x.is_finite()), "{at}: out not finite");
                        // Against the f32 products on the rounded values: the weights rounded
                        // to bf16 (relative 2⁻⁸) bound the output by Σⱼ pⱼ·|vⱼ| / 256.
                        let exact = base.isa(isa);
                        let f = c.run(&qr, &kr, &vr, blhd, &exact).unwrap();
                        let spread = c.run(&qr, &kr, &vabs, blhd, &exact).unwrap();
                        for (i, (x, y)) in got[0].iter().zip(&f[0]).enumerate() {
                            let tol = 1e-5 + 1e-5 * y.abs() + spread[0][i] / 256.0;
                            assert!(
                                (x - y).abs() <= tol,
                                "{at}: out[{i}] {x} vs f32 {y} (tolerance {tol:e})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn medium_falls_back_where_it_does_not_apply() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0016);
    for isa in isas() {
        // Odd D (no whole pairs), the decode kernel, bf16 operands, and every call on `Amx`:
        // the default call, bitwise.
        for (shape, kernel) in [
            ([2, 4, 2, 7, 13, 7, 5], Kernel::Prefill),
            ([1, 8, 2, 1, 389, 128, 128], Kernel::Decode),
            ([1, 4, 4, 3, 600, 64, 64], Kernel::Decode),
            ([1, 2, 2, 33, 70, 64, 64], Kernel::Prefill),
        ] {
            if has_pairs(isa) && shape[5] % 2 == 0 && kernel == Kernel::Prefill {
                continue; // the pair products: the test above
            }
            let c = Case::new(&mut rng, shape, 1.0);
            let at = format!("{isa} shape {shape:?} {kernel:?}");
            let base = c.options(1).isa(isa).kernel(kernel);
            let want = c.run(&c.q, &c.k, &c.v, false, &base).unwrap();
            let medium = base.precision(Precision::Medium);
            match c.run(&c.q, &c.k, &c.v, false, &medium) {
                Ok(got) => {
                    assert!(accepts(isa), "{at}: Medium accepted without bf16 products");
                    for i in 0..3 {
                        same_bits(&got[i], &want[i], &at);
                    }
                }
                Err(e) => {
                    assert!(!accepts(isa), "{at}: Medium refused: {e}");
                    assert!(
                        matches!(
                            e,
                            AttnError::BadParam {
                                arg: "precision",
                                ..
                            }
                        ),
                        "{at}: {e:?}"
                    );
                }
            }
            let to_bf16 = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
            let (qb, kb, vb) = (to_bf16(&c.q), to_bf16(&c.k), to_bf16(&c.v));
            let want = c.run(&qb, &kb, &vb, false, &base).unwrap();
            let got = c.run(&qb, &kb, &vb, false, &medium).unwrap();
            for i in 0..3 {
                same_bits(&got[i], &want[i], &format!("{at} bf16 operands"));
            }
        }
    }
}

#[test]
fn a_refused_medium_call_writes_nothing_and_a_masked_row_is_zero() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_0017);
    let c = Case::new(&mut rng, [1, 2, 1, 5, 40, 16, 16], 1.0);
    let [qs, ks, vs, os] = c.dims();
    // Row 0 sees no key.
    let mask: Vec<bool> = (0..5 * 40).map(|i| i >= 40).collect();
    for isa in isas() {
        let opts = SdpaOptions::new()
            .isa(isa)
            .precision(Precision::Medium)
            .bool_mask(MaskRef::lq_lk(&mask, 5, 40));
        let mut out = vec![7.0f32; os.iter().product()];
        let r = sdpa(
            &Tensor::bhld(&c.q, qs),
            &Tensor::bhld(&c.k, ks),
            &Tensor::bhld(&c.v, vs),
            &mut TensorMut::bhld(&mut out, os),
            &opts,
        );
        if accepts(isa) {
            r.unwrap();
            for h in 0..2 {
                let row = &out[h * 5 * 16..][..16];
                assert!(row.iter().all(|&x| x == 0.0), "{isa}: masked row {row:?}");
            }
            assert!(out.iter().all(|x| x.is_finite()), "{isa}: not finite");
        } else {
            assert!(
                matches!(
                    r,
                    Err(AttnError::BadParam {
                        arg: "precision",
                        ..
                    })
                ),
                "{isa}: {r:?}"
            );
            assert!(out.iter().all(|&x| x == 7.0), "{isa}: a refused call wrote");
        }
    }
}
