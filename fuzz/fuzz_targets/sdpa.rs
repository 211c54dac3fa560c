//! Fuzzes `sdpa`, `sdpa_ext` and `sdpa_vec`: small problems in every view form and option
//! combination, compared with an f64 reference, and wild sizes that must be refused (or do
//! nothing) without a panic, an abort or a hang.
//!
//! Checked on every input: a call refuses every deliberately invalid input and accepts every
//! valid one it was built to accept; a refused call writes nothing; an accepted one writes every
//! element of its output view and nothing outside it; `Par::Seq` and `Par::Rayon` agree bit
//! for bit; with finite inputs, results match the reference.
#![no_main]

use arbitrary::{Result, Unstructured};
use attnkit::{sdpa, sdpa_ext, sdpa_vec, AttnError, Extras, Par};
use attnkit_fuzz::expect::Expect;
use attnkit_fuzz::gen::{chance, inject_specials, product, small, Rng};
use attnkit_fuzz::operand::{
    assert_same_bits, assert_untouched, is_written, Budget, Operand, Role, SENTINEL,
};
use attnkit_fuzz::problem::{perturb, Dims, OptSpec, ALL_DIMS, MAX_LEN, WILD_MAX_LEN};
use attnkit_fuzz::reference::{Expected, Spec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(case) = Case::decode(&mut Unstructured::new(data)) {
        case.run();
    }
});

/// The entry point under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Sdpa,
    Ext,
    Vec,
}

/// One call: its operands, options and what it must return.
struct Case {
    api: Api,
    dims: Dims,
    /// Sizes may be huge: no reference, either outcome.
    wild: bool,
    /// NaN or infinity in an input: no reference.
    special: bool,
    q: Operand,
    k: Operand,
    v: Operand,
    /// The output view (`None` for `sdpa_vec`).
    out: Option<Operand>,
    opts: OptSpec,
    lse: Option<Vec<f32>>,
    weights: Option<Vec<f32>>,
    expect: Expect,
}

/// What a call left in its output buffers (for `sdpa_vec`, the returned vector).
#[derive(Debug)]
struct Outcome {
    out: Vec<f32>,
    lse: Option<Vec<f32>>,
    weights: Option<Vec<f32>>,
}

impl Case {
    fn decode(u: &mut Unstructured) -> Result<Self> {
        let api = *u.choose(&[Api::Sdpa, Api::Ext, Api::Vec, Api::Sdpa])?;
        let wild = chance(u, 1, 8)?;
        let dims = Dims::decode(u, wild)?;
        let mut expect = Expect::default();
        if wild {
            expect.unsure("wild sizes");
        }
        dims.check_heads(&mut expect);
        let mut rng = Rng::decode(u)?;
        let budget = Budget {
            max_len: if wild { WILD_MAX_LEN } else { MAX_LEN },
            wild_strides: wild,
        };
        // With wild sizes, inputs get memory of their own per element, so that a valid call's
        // work stays bounded by the buffers (a broadcast K with Lk = 2^62 is valid, and slow).
        let role = if wild { Role::DenseInput } else { Role::Input };
        let mut input = |u: &mut Unstructured, shape, checked, expect: &mut Expect| {
            let shape = perturb(u, shape, checked, expect)?;
            Operand::decode(u, shape, role, budget, &mut rng, expect)
        };
        // sdpa_vec's output takes Hq and Lq from q and Dv from v: those are not compared.
        let vec = api == Api::Vec;
        let (q_checked, v_checked): (&[usize], &[usize]) = if vec {
            (&[0, 3], &[0, 1, 2])
        } else {
            (ALL_DIMS, ALL_DIMS)
        };
        let mut q = input(u, dims.q(), q_checked, &mut expect)?;
        let mut k = input(u, dims.k(), ALL_DIMS, &mut expect)?;
        let mut v = input(u, dims.v(), v_checked, &mut expect)?;
        let special = chance(u, 1, 16)?;
        if special {
            let target = match u.choose_index(3)? {
                0 => &mut q,
                1 => &mut k,
                _ => &mut v,
            };
            inject_specials(u, &mut target.data)?;
        }
        let out = match api {
            Api::Vec => None,
            _ => {
                let shape = perturb(u, dims.out(), ALL_DIMS, &mut expect)?;
                Some(Operand::decode_output(
                    u,
                    shape,
                    budget,
                    &mut rng,
                    &mut expect,
                )?)
            }
        };
        let mut opts = OptSpec::decode(u, &dims, false, &mut rng, &mut expect, budget.max_len)?;
        opts.decode_precision(u, &mut expect)?;
        let (mut lse, mut weights) = (None, None);
        if api == Api::Ext {
            // Nothing bounds Lk when rows are empty (D = Dv = 0): a valid lse would make the call
            // walk all of a wild Lk. Only wrong lengths then.
            let exact_ok = !wild || dims.d != 0 || dims.dv != 0 || dims.lk <= 1 << 16;
            let rows = product(&[dims.b, dims.hq, dims.lq]);
            let scores = rows.and_then(|r| r.checked_mul(dims.lk));
            let max_len = if exact_ok { budget.max_len } else { 0 };
            lse = decode_extra(u, rows, max_len, &mut expect)?;
            weights = decode_extra(u, scores, max_len, &mut expect)?;
        }
        Ok(Case {
            api,
            dims,
            wild,
            special,
            q,
            k,
            v,
            out,
            opts,
            lse,
            weights,
            expect,
        })
    }

    /// Calls the entry point on copies of the output buffers.
    fn call(&self, par: Par) -> (core::result::Result<(), AttnError>, Outcome) {
        let opts = self.opts.options(par);
        let (q, k, v) = (self.q.tensor(), self.k.tensor(), self.v.tensor());
        let (mut lse, mut weights) = (self.lse.clone(), self.weights.clone());
        let Some(out) = &self.out else {
            let (res, out) = match sdpa_vec(&q, &k, &v, &opts) {
                Ok(out) => (Ok(()), out),
                Err(e) => (Err(e), Vec::new()),
            };
            return (res, Outcome { out, lse, weights });
        };
        let mut out = out.clone();
        let res = match self.api {
            Api::Ext => {
                let extras = Extras {
                    lse: lse.as_deref_mut(),
                    weights: weights.as_deref_mut(),
                };
                sdpa_ext(&q, &k, &v, &mut out.tensor_mut(), &opts, extras)
            }
            _ => sdpa(&q, &k, &v, &mut out.tensor_mut(), &opts),
        };
        let out = out.data;
        (res, Outcome { out, lse, weights })
    }

    fn run(&self) {
        let (res, got) = self.call(self.opts.par);
        self.expect.check("sdpa", &res);
        if res.is_err() {
            return self.check_untouched(&got);
        }
        self.check_written(&got);
        if let Some(want) = self.reference() {
            self.compare(&want, &got);
        }
        let other = match self.opts.par {
            Par::Seq => Par::Rayon,
            _ => Par::Seq,
        };
        let (res, again) = self.call(other);
        assert!(
            res.is_ok(),
            "Par::{other:?} refused what Par::{:?} accepted: {res:?}",
            self.opts.par
        );
        let pairs = [
            (Some(&got.out), Some(&again.out)),
            (got.lse.as_ref(), again.lse.as_ref()),
            (got.weights.as_ref(), again.weights.as_ref()),
        ];
        for (what, pair) in ["out", "lse", "weights"].into_iter().zip(pairs) {
            if let (Some(a), Some(b)) = pair {
                assert_same_bits(&format!("Par::Seq vs Par::Rayon: {what}"), a, b);
            }
        }
    }

    /// A refused call must leave every buffer as it was.
    fn check_untouched(&self, got: &Outcome) {
        assert_untouched("out", &got.out);
        got.lse.iter().for_each(|b| assert_untouched("lse", b));
        got.weights
            .iter()
            .for_each(|b| assert_untouched("weights", b));
    }

    /// An accepted call writes every element of its outputs, and nothing outside the view.
    fn check_written(&self, got: &Outcome) {
        match &self.out {
            None => assert_eq!(
                Some(got.out.len()),
                product(&self.dims.out()),
                "sdpa_vec's length"
            ),
            Some(out) => out.assert_written(&got.out),
        }
        for (what, buf) in [("lse", &got.lse), ("weights", &got.weights)] {
            let all = buf
                .as_ref()
                .is_none_or(|b| b.iter().all(|&x| is_written(x)));
            assert!(all, "{what} not fully written");
        }
    }

    /// The f64 reference, for small problems with finite inputs and a moderate scale.
    fn reference(&self) -> Option<Expected> {
        if self.wild || self.special || !self.opts.reference_applies(self.dims.d) {
            return None;
        }
        let spec = Spec {
            dims: self.dims,
            scale: self.opts.scale_for(self.dims.d),
            causal: self.opts.causal,
            window: self.opts.window,
            key_lengths: self.opts.key_lengths.as_deref(),
            mask: self.opts.mask.as_ref(),
            alibi: self.opts.alibi.as_deref(),
            softcap: self.opts.softcap,
            sinks: self.opts.sinks.as_deref(),
        };
        Some(spec.attention(
            |b, h, i, x| self.q.at(b, h, i, x),
            |b, h, j, x| self.k.at(b, h, j, x),
            |b, h, j, x| self.v.at(b, h, j, x),
        ))
    }

    fn compare(&self, want: &Expected, got: &Outcome) {
        let Dims { hq, lq, dv, .. } = self.dims;
        match &self.out {
            Some(out) => want.check_out("out", |b, h, i, x| got.out[out.row(b, h, i) + x]),
            None => want.check_out("sdpa_vec", |b, h, i, x| {
                got.out[((b * hq + h) * lq + i) * dv + x]
            }),
        }
        if let Some(lse) = &got.lse {
            want.check_lse(lse);
        }
        if let Some(w) = &got.weights {
            want.check_weights(w);
        }
    }
}

/// An optional dense extra output (lse or weights) that needs `exact` elements (`None`: the
/// size overflows): that many if at most `max_len` (15 times in 16), else a wrong length, which
/// the call must refuse.
fn decode_extra(
    u: &mut Unstructured,
    exact: Option<usize>,
    max_len: usize,
    expect: &mut Expect,
) -> Result<Option<Vec<f32>>> {
    if !chance(u, 1, 2)? {
        return Ok(None);
    }
    let allowed = exact.filter(|&n| n <= max_len);
    let len = match allowed {
        Some(n) if !chance(u, 1, 16)? => n,
        _ => small(u, 16)?,
    };
    // A length beyond `max_len` is never given, not even by chance.
    let len = if allowed.is_none() && exact == Some(len) {
        len + 1
    } else {
        len
    };
    if exact != Some(len) {
        expect.fault("an extra output of the wrong length");
    }
    Ok(Some(vec![SENTINEL; len]))
}
