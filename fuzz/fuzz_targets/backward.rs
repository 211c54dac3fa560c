//! Fuzzes the backward pass (`sdpa_backward_vec`, `bias_gradient`, `sinks_gradient`): small
//! problems with every option combination the forward fuzzer draws, dense inputs.
//!
//! Checked on every input: no panic, abort or hang; the backward accepts what the forward
//! accepted (unless the forward's logsumexp overflowed, which it must refuse) and refuses what
//! the forward refused, with the same error; `Par::Seq` and `Par::Rayon` agree bit for bit; on a
//! reference-tame problem an identity of softmax attention holds: each row's weights sum to one
//! minus its sink's share, so `Σ_j dV_j` is the dO rows weighted by that, within a rounding bound
//! from their magnitudes; bf16 or f16 inputs (1 in 2) give bitwise the gradients of their values
//! in f32. (Agreement with an f64 reference is the unit tests' job.)
#![no_main]

use arbitrary::{Result, Unstructured};
use attnkit::{
    bias_gradient, sdpa_backward_vec, sdpa_ext_vec, sinks_gradient, Par, Returns, Saved, Tensor,
};
use attnkit_fuzz::expect::Expect;
use attnkit_fuzz::gen::Rng;
use attnkit_fuzz::problem::{Dims, OptSpec, MAX_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});

fn run(u: &mut Unstructured) -> Result<()> {
    let dims = Dims::decode(u, false)?;
    let mut expect = Expect::default();
    dims.check_heads(&mut expect);
    let mut rng = Rng::decode(u)?;
    let opts = OptSpec::decode(u, &dims, false, &mut rng, &mut expect, MAX_LEN)?;
    let (q, k, v) = (
        rng.values(dims.q().iter().product()),
        rng.values(dims.k().iter().product()),
        rng.values(dims.v().iter().product()),
    );
    let dout = rng.values(dims.out().iter().product());
    let (qt, kt, vt) = (
        Tensor::bhld(&q, dims.q()),
        Tensor::bhld(&k, dims.k()),
        Tensor::bhld(&v, dims.v()),
    );
    let want = Returns {
        lse: true,
        weights: false,
    };
    let o = opts.options(Par::Seq);
    let fwd = sdpa_ext_vec(&qt, &kt, &vt, &o, want);
    expect.check("forward", &fwd);
    let fwd = match fwd {
        Ok(f) => f,
        Err(e) => {
            // The backward validates the same inputs and options: the same refusal.
            let out = vec![0.0f32; dims.out().iter().product()];
            let lse = vec![0.0f32; dims.b * dims.hq * dims.lq];
            let saved = Saved {
                q: qt,
                k: kt,
                v: vt,
                out: Tensor::bhld(&out, dims.out()),
                lse: &lse,
            };
            let r = sdpa_backward_vec(&saved, &Tensor::bhld(&dout, dims.out()), &o);
            assert_eq!(
                r.err(),
                Some(e),
                "the backward accepts what the forward refused"
            );
            return Ok(());
        }
    };
    let lse = fwd.lse.expect("lse asked for");
    let saved = Saved {
        q: qt,
        k: kt,
        v: vt,
        out: Tensor::bhld(&fwd.out, dims.out()),
        lse: &lse,
    };
    let go = Tensor::bhld(&dout, dims.out());
    if lse.iter().any(|l| l.is_nan() || *l == f32::INFINITY) {
        // Scores past f32's range (any scale bits): no gradient, a refusal naming the lse.
        let r = sdpa_backward_vec(&saved, &go, &o);
        assert!(
            matches!(r, Err(attnkit::AttnError::BadParam { arg: "lse", .. })),
            "{r:?}"
        );
        return Ok(());
    }
    let seq = match sdpa_backward_vec(&saved, &go, &o) {
        // A row whose logits all overflowed to −inf has an lse of −inf although it sees keys:
        // no gradient exists, and the backward refuses it (fully masked rows are accepted:
        // tests/backward.rs).
        Err(attnkit::AttnError::BadParam { arg: "lse", .. })
            if lse.contains(&f32::NEG_INFINITY) =>
        {
            return Ok(());
        }
        r => r.expect("backward of an accepted forward"),
    };
    let par = sdpa_backward_vec(&saved, &go, &opts.options(Par::Rayon)).expect("rayon");
    // Bit patterns: a gradient may hold NaN (scores that overflow f32 in dP), and NaN != NaN.
    let bits = |g: &attnkit::Gradients| -> Vec<u32> {
        [&g.dq, &g.dk, &g.dv]
            .into_iter()
            .chain(g.dsinks.as_ref())
            .flat_map(|x| x.iter().map(|v| v.to_bits()))
            .collect()
    };
    assert!(bits(&seq) == bits(&par), "Par::Seq and Par::Rayon differ");
    // 16-bit inputs get the gradients of their own values: bitwise those of the same (rounded)
    // values in f32. Drawn last, so the committed corpus keeps its meaning.
    let vals = [&q[..], &k[..], &v[..], &fwd.out[..], &dout[..]];
    match u.int_in_range(0..=3u8)? {
        1 => lowp(
            &dims,
            vals,
            &lse,
            &o,
            attnkit::bf16::from_f32,
            attnkit::bf16::to_f32,
            bits,
        ),
        2 => lowp(
            &dims,
            vals,
            &lse,
            &o,
            attnkit::f16::from_f32,
            attnkit::f16::to_f32,
            bits,
        ),
        _ => {}
    }
    if opts
        .mask
        .as_ref()
        .is_some_and(|m| matches!(m.data, attnkit_fuzz::problem::MaskData::Bias(_)))
    {
        let a = bias_gradient(&saved, &go, &o).expect("bias gradient");
        let b = bias_gradient(&saved, &go, &opts.options(Par::Rayon)).expect("bias gradient");
        let (a, b): (Vec<u32>, Vec<u32>) = (
            a.iter().map(|x| x.to_bits()).collect(),
            b.iter().map(|x| x.to_bits()).collect(),
        );
        assert!(a == b, "bias gradient: Par::Seq and Par::Rayon differ");
    }
    if opts.sinks.is_some() {
        sinks_gradient(&saved, &go, &o).expect("sinks gradient");
    }
    if opts.reference_applies(dims.d) && fwd.out.iter().all(|x| x.is_finite()) {
        identity(&dims, &opts, &saved, (&q, &k, &dout), &seq);
    }
    Ok(())
}

/// `Σ_j dV[b, hk, j] = Σ_{h, i} (1 − sink share)·dO[b, h, i]`, within the rounding of the
/// probabilities: an f32 logit `x` carries an error up to about `(D + 2)·u·|scale|·Σ_c |q_c·k_c|`
/// (plus `u` times the bias, ALiBi term and lse it meets), and `exp(x − lse)` turns that absolute
/// error into a relative one, so rows with logits in the thousands (scale 16, D 30) sum to one
/// only within ~1e-3. Each dO row is weighted by its row's bound.
fn identity(
    dims: &Dims,
    opts: &OptSpec,
    saved: &Saved,
    (q, k, dout): (&[f32], &[f32], &[f32]),
    g: &attnkit::Gradients,
) {
    const U: f64 = f32::EPSILON as f64 / 2.0;
    let group = dims.hq / dims.hkv.max(1);
    let scale = opts.scale_for(dims.d).abs();
    let bias = match opts.mask.as_ref().map(|m| &m.data) {
        Some(attnkit_fuzz::problem::MaskData::Bias(m)) => m
            .iter()
            .filter(|x| x.is_finite())
            .fold(0.0f64, |a, &x| a.max(f64::from(x).abs())),
        _ => 0.0,
    };
    let alibi = opts.alibi.as_ref().map_or(0.0, |a| {
        let slope = a.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
        slope * (dims.lq + dims.lk) as f64
    });
    // The rounding bound of row `row` (query head `h`, KV head `hk`): 2 × the logit error (the
    // logit's and the lse's) plus a few ulps of the exponent and the accumulation.
    let row_bound = |row: usize, hk: usize, b: usize| -> f64 {
        let qr = &q[row * dims.d..(row + 1) * dims.d];
        let dot = (0..dims.lk)
            .map(|j| {
                let kr = &k[((b * dims.hkv + hk) * dims.lk + j) * dims.d..][..dims.d];
                qr.iter()
                    .zip(kr)
                    .map(|(&x, &y)| f64::from(x * y).abs())
                    .sum::<f64>()
            })
            .fold(0.0f64, f64::max);
        let l = f64::from(saved.lse[row]).abs();
        2.0 * ((dims.d + 2) as f64 * U * scale * dot + 4.0 * U * (bias + alibi + l)) + 1e-4
    };
    for b in 0..dims.b {
        for hk in 0..dims.hkv {
            let mut bound = Vec::with_capacity(group * dims.lq);
            for h in hk * group..(hk + 1) * group {
                for i in 0..dims.lq {
                    bound.push(row_bound((b * dims.hq + h) * dims.lq + i, hk, b));
                }
            }
            for c in 0..dims.dv {
                let (mut want, mut tol) = (0.0f64, 1e-4);
                for (n, h) in (hk * group..(hk + 1) * group).enumerate() {
                    for i in 0..dims.lq {
                        let row = (b * dims.hq + h) * dims.lq + i;
                        let l = saved.lse[row];
                        if l == f32::NEG_INFINITY {
                            continue;
                        }
                        let sink = opts.sinks.as_ref().map_or(f32::NEG_INFINITY, |s| s[h]);
                        let share = 1.0 - f64::from((sink - l).exp());
                        let d = f64::from(dout[row * dims.dv + c]);
                        want += share * d;
                        tol += d.abs() * bound[n * dims.lq + i];
                    }
                }
                let got: f64 = (0..dims.lk)
                    .map(|j| f64::from(g.dv[((b * dims.hkv + hk) * dims.lk + j) * dims.dv + c]))
                    .sum();
                assert!(
                    (got - want).abs() <= tol,
                    "Σ dV of batch {b}, KV head {hk}, column {c}: {got} vs {want} (bound {tol})"
                );
            }
        }
    }
}

/// The backward of `E` inputs against the f32 backward of the same values.
fn lowp<E: attnkit::Elem>(
    dims: &Dims,
    [q, k, v, out, dout]: [&[f32]; 5],
    lse: &[f32],
    o: &attnkit::SdpaOptions,
    to: fn(f32) -> E,
    from: fn(E) -> f32,
    bits: impl Fn(&attnkit::Gradients) -> Vec<u32>,
) {
    let round = |x: &[f32]| -> (Vec<E>, Vec<f32>) {
        let e: Vec<E> = x.iter().map(|&y| to(y)).collect();
        let f = e.iter().map(|&y| from(y)).collect();
        (e, f)
    };
    let ((qe, qf), (ke, kf), (ve, vf), (oe, of), (ge, gf)) =
        (round(q), round(k), round(v), round(out), round(dout));
    let wide = sdpa_backward_vec(
        &Saved {
            q: Tensor::bhld(&qf, dims.q()),
            k: Tensor::bhld(&kf, dims.k()),
            v: Tensor::bhld(&vf, dims.v()),
            out: Tensor::bhld(&of, dims.out()),
            lse,
        },
        &Tensor::bhld(&gf, dims.out()),
        o,
    )
    .expect("f32 backward of rounded values");
    let narrow = sdpa_backward_vec(
        &Saved {
            q: Tensor::bhld(&qe, dims.q()),
            k: Tensor::bhld(&ke, dims.k()),
            v: Tensor::bhld(&ve, dims.v()),
            out: Tensor::bhld(&oe, dims.out()),
            lse,
        },
        &Tensor::bhld(&ge, dims.out()),
        o,
    )
    .expect("16-bit backward");
    assert!(
        bits(&wide) == bits(&narrow),
        "{} inputs differ from their f32 values",
        std::any::type_name::<E>()
    );
}
