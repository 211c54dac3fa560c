//! The backward pass's element-wise step: one row of a score tile turned into probabilities and
//! `dS`, in vector registers, between the tile products.

use crate::score::ScoreSpec;
use crate::simd::{exp2, Simd, SimdDiv};
use core::f32::consts::LOG2_E;

/// Row `r` of a backward tile, keys `j0 + [0, s.len())`: the raw scores `s` (`q·k`) become
/// `p = exp(spec(scale·s) − lse)` (the forward's score rule, so `p` is its softmax weight) and the
/// row of `dP` (`dO·vᵀ`) becomes `dS = p·(dP − delta)`, times the softcap's derivative
/// `1 − tanh²` when `deriv` (without it, `dS` by the logit: what a bias's gradient takes).
/// Vector passes: scale; the softcap (and the factor `(dP − delta)·(1 − t²)` from its result);
/// the rest of the score rule; exponent and `dS` fused.
///
/// # Safety
/// `dp.len() ≥ s.len()`; the spec's bias and mask rows readable at keys `< j0 + s.len()`; the
/// ISA of `S` is enabled.
#[inline(always)]
pub(crate) unsafe fn probs_and_ds<S: SimdDiv>(
    spec: &ScoreSpec,
    r: usize,
    j0: usize,
    scale: f32,
    lse: f32,
    mut delta: f32,
    s: &mut [f32],
    dp: &mut [f32],
    deriv: bool,
) {
    let n = s.len();
    let dp = &mut dp[..n];
    let full = n / S::W * S::W;
    // SAFETY: vector accesses below `full`, a lane multiple of both slices; the tail goes
    // through W-long stack buffers; the spec's rows per the contract.
    unsafe {
        let k = S::splat(scale);
        for c in (0..full).step_by(S::W) {
            let p = s.as_mut_ptr().add(c);
            S::store(p, S::mul(S::load(p), k));
        }
        for x in &mut s[full..] {
            *x *= scale;
        }
        let mut rest = *spec;
        if let Some(cap) = spec.softcap {
            // The softcap alone (a spec that hides nothing), then its derivative from the
            // capped value `cap·t`, folded into `dP − delta`.
            let only = ScoreSpec {
                softcap: Some(cap),
                ..ScoreSpec::new(j0 + n)
            };
            only.apply_row::<S>(0, j0, s, 1.0);
            if deriv {
                let inv = 1.0 / cap;
                let (iv, one, dv) = (S::splat(inv), S::splat(1.0), S::splat(delta));
                for c in (0..full).step_by(S::W) {
                    let (ps, pd) = (s.as_ptr().add(c), dp.as_mut_ptr().add(c));
                    let t = S::mul(S::load(ps), iv);
                    let g = S::sub(one, S::mul(t, t));
                    S::store(pd, S::mul(S::sub(S::load(pd), dv), g));
                }
                for c in full..n {
                    let t = s[c] * inv;
                    dp[c] = (dp[c] - delta) * (1.0 - t * t);
                }
                delta = 0.0;
            }
            rest.softcap = None;
        }
        rest.apply_row::<S>(r, j0, s, 1.0);
        let (lv, dv) = (S::splat(lse), S::splat(delta));
        for c in (0..full).step_by(S::W) {
            let (ps, pd) = (s.as_mut_ptr().add(c), dp.as_mut_ptr().add(c));
            let (e, g) = step::<S>(S::load(ps), S::load(pd), lv, dv);
            S::store(ps, e);
            S::store(pd, g);
        }
        let tail = n - full;
        if tail > 0 {
            let (mut bx, mut bg) = ([f32::NEG_INFINITY; 16], [0.0f32; 16]);
            bx[..tail].copy_from_slice(&s[full..]);
            bg[..tail].copy_from_slice(&dp[full..]);
            let (e, g) = step::<S>(S::load(bx.as_ptr()), S::load(bg.as_ptr()), lv, dv);
            S::store(bx.as_mut_ptr(), e);
            S::store(bg.as_mut_ptr(), g);
            s[full..].copy_from_slice(&bx[..tail]);
            dp[full..].copy_from_slice(&bg[..tail]);
        }
    }
}

/// `p = 2^((x − lse)·log2 e)` and `p·(g − delta)` of one vector (a function, not a closure: a
/// closure may stay out of line, without the ISA's target features).
///
/// # Safety
/// The ISA of `S` is enabled.
#[inline(always)]
unsafe fn step<S: Simd>(x: S::V, g: S::V, lse: S::V, delta: S::V) -> (S::V, S::V) {
    // SAFETY: register-only arithmetic.
    unsafe {
        let e = exp2::<S>(S::mul(S::sub(x, lse), S::splat(LOG2_E)));
        (e, S::mul(e, S::sub(g, delta)))
    }
}
