//! The element-type seam: the flash and decode kernels read Q, K and V as bf16 or f16 through
//! the same kernels, widening on load (the `Operand` instances compiled in the crate). Widening is exact, so a kernel given bf16/f16 operands
//! must return *bitwise* what it returns for f32 operands holding the widened values, on every
//! ISA and on every path (both transposes, the direct one-block output, every decode walk and
//! row count, the tails of D and Dv); one f64 check guards against both being wrong together.
//! Set `ATTNKIT_REQUIRE_ISAS` to fail (not skip) when a path is missing.

use attnkit_kernels::{
    bf16, decode_partial, decode_partial_as, decode_scratch_len, f16, flash_forward,
    flash_forward_as, flash_path, merge_partials, partial_len, reference, scratch_len_as,
    DecodeArgs, DecodeRow, DecodeWalk, Dtype, Elem, FlashArgs, Isa, KvPages, Operand, ScoreSpec,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

mod common;
use common::isas;

/// Random values of `E`, and the same values widened to f32.
fn values<E: Elem>(rng: &mut SmallRng, n: usize) -> (Vec<E>, Vec<f32>) {
    let e: Vec<E> = (0..n)
        .map(|_| E::from_f32(rng.gen_range(-1.5..1.5)))
        .collect();
    let f = e.iter().map(|x| x.to_f32()).collect();
    (e, f)
}

struct Shape {
    m: usize,
    n: usize,
    d: usize,
    dv: usize,
    causal: Option<isize>,
}

/// Output and lse of the flash kernel for one head, Q as `Q` and K, V as `KV`, run by `kernel`
/// (the generic entry, or the f32 one compiled in the kernels crate).
fn flash<Q: Elem, KV: Elem>(
    kernel: impl Fn(&FlashArgs<Q, KV>, &mut [f32]),
    s: &Shape,
    q: &[Q],
    k: &[KV],
    v: &[KV],
    lds: (usize, usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let (ldq, ldk, ldv) = lds;
    let mut o = vec![f32::NAN; s.m * s.dv];
    let mut lse = vec![0.0f32; s.m];
    let args = FlashArgs {
        m: s.m,
        n: s.n,
        d: s.d,
        dv: s.dv,
        scale: 1.0 / (s.d as f32).sqrt(),
        spec: ScoreSpec {
            causal: s.causal,
            ..ScoreSpec::new(s.n)
        },
        q: q.as_ptr(),
        ldq,
        k: k.as_ptr(),
        ldk,
        v: v.as_ptr(),
        ldv,
        k_scale: std::ptr::null(),
        v_scale: std::ptr::null(),
        o: o.as_mut_ptr(),
        ldo: s.dv,
        lse: lse.as_mut_ptr(),
        weights: std::ptr::null_mut(),
        ldw: 0,
        pages: KvPages::contiguous(),
    };
    let mut scratch = vec![0.0f32; scratch_len_as::<Q, KV>(s.m, s.d, s.dv)];
    kernel(&args, &mut scratch);
    (o, lse)
}

fn flash_case<E: Operand + Elem>(isa: Isa, rng: &mut SmallRng, s: &Shape) {
    let lds = (s.d + 3, s.d + 1, s.dv + 2);
    let (q, qf) = values::<E>(rng, s.m * lds.0);
    let (k, kf) = values::<E>(rng, s.n * lds.1);
    let (v, vf) = values::<E>(rng, s.n * lds.2);
    // SAFETY (both closures): `flash` passes buffers covering `m` rows of Q and O and `n` rows
    // of K and V at the strides given; the ISA is supported.
    let generic = |a: &FlashArgs<E, E>, sc: &mut [f32]| unsafe { flash_forward_as(isa, a, sc) };
    let got = flash(generic, s, &q, &k, &v, lds);
    let f32 = |a: &FlashArgs, sc: &mut [f32]| unsafe { flash_forward(isa, a, sc) };
    let f32s = flash(f32, s, &qf, &kf, &vf, lds);
    let ctx = format!(
        "{isa} Q={:?} KV={:?} m={} n={} d={} dv={} causal={:?}",
        E::DTYPE,
        E::DTYPE,
        s.m,
        s.n,
        s.d,
        s.dv,
        s.causal
    );
    // The pair path rounds P to bf16 (see `FlashPath`): checked against f64 below instead.
    let pairs = flash_path(isa, E::DTYPE, E::DTYPE, s.d).rounds_weights();
    if !pairs {
        for (i, (g, w)) in got.0.iter().zip(&f32s.0).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{ctx}: out[{i}] {g} vs f32 {w}");
        }
        for (i, (g, w)) in got.1.iter().zip(&f32s.1).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{ctx}: lse[{i}] {g} vs f32 {w}");
        }
    }
    let spec = ScoreSpec {
        causal: s.causal,
        ..ScoreSpec::new(s.n)
    };
    let scale = 1.0 / (s.d as f64).sqrt();
    let logit = |i: usize, j: usize| {
        let dot: f64 = (0..s.d)
            .map(|p| qf[i * lds.0 + p] as f64 * kf[j * lds.1 + p] as f64)
            .sum();
        reference::logit(&spec, i, j, dot * scale, 0.0, true)
    };
    let (want, want_lse, _) =
        reference::attention_head(s.m, s.n, s.dv, logit, |j, c| vf[j * lds.2 + c] as f64);
    // The pair path's bound: each weight rounded to bf16 (relative 2⁻⁸), so Σⱼ pⱼ·|vⱼ|·2⁻⁸.
    let (spread, _, _) = reference::attention_head(s.m, s.n, s.dv, logit, |j, c| {
        (vf[j * lds.2 + c] as f64).abs()
    });
    for (i, (g, w)) in got.0.iter().zip(&want).enumerate() {
        let tol = 1e-5 + 1e-5 * w.abs() + if pairs { spread[i] / 256.0 } else { 0.0 };
        assert!(
            (*g as f64 - w).abs() <= tol,
            "{ctx}: out[{i}] {g} vs f64 {w} (tolerance {tol:e})"
        );
    }
    for (i, (g, w)) in got.1.iter().zip(&want_lse).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= 1e-5 + 1e-5 * w.abs(),
            "{ctx}: lse[{i}] {g} vs f64 {w}"
        );
    }
}

#[test]
fn flash_reads_bf16_and_f16_operands_exactly_as_their_f32_values() {
    let mut rng = SmallRng::seed_from_u64(11);
    // (m, n, d, dv): the direct one-block path (n ≤ 128, Dv a lane multiple), the Oᵀ path with
    // several key blocks, D and Dv tails, one row, one key.
    let shapes = [
        (1, 1, 1, 1),
        (5, 7, 3, 16),
        (17, 100, 24, 32),
        (33, 300, 64, 64),
        (9, 129, 80, 17),
        (64, 200, 128, 48),
        (3, 70, 256, 8),
        // The pair path: odd key blocks (odd `n` past a block), causal diagonals over several
        // lane vectors, D not a multiple of 16, a direct block with Dv = 64.
        (96, 333, 64, 64),
        (40, 130, 18, 33),
        (50, 77, 96, 64),
        // The tile path (D a multiple of 32): one key, whole and partial key tiles, Dv tails,
        // odd lane tiles, several key blocks with a causal diagonal.
        (1, 1, 32, 1),
        (16, 16, 32, 16),
        (17, 15, 32, 5),
        (47, 513, 128, 100),
        (60, 140, 64, 20),
        (96, 290, 128, 128),
    ];
    for isa in isas() {
        for (c, &(m, n, d, dv)) in shapes.iter().enumerate() {
            let causal = match c % 3 {
                0 => None,
                1 => Some(0),
                _ => Some(n as isize - m as isize),
            };
            let s = Shape {
                m,
                n,
                d,
                dv,
                causal,
            };
            // One type for Q, K and V, as the public API uses them (decode: the `Operand`
            // instances compiled in the kernels crate).
            flash_case::<bf16>(isa, &mut rng, &s);
            flash_case::<f16>(isa, &mut rng, &s);
        }
    }
}

/// The merged decode output and lse of `rows` query rows over `n` keys in two chunks.
fn decode<Q: Elem, KV: Elem>(
    kernel: impl Fn(&DecodeArgs<Q, KV>, *mut f32, usize, &mut [f32]),
    walk: DecodeWalk,
    q: &[Q],
    rows: usize,
    k: &[KV],
    v: &[KV],
    (n, d, dv): (usize, usize, usize),
) -> Vec<f32> {
    let rs: Vec<DecodeRow<Q>> = (0..rows)
        .map(|r| DecodeRow {
            q: q[r * d..].as_ptr(),
            spec: ScoreSpec::new(n),
        })
        .collect();
    let pl = partial_len(dv);
    let mut parts = vec![f32::NAN; 2 * rows * pl];
    let mut scratch = vec![0.0; decode_scratch_len(d, dv)];
    let half = n / 2;
    for (c, (j_begin, j_end)) in [(0, half), (half, n)].into_iter().enumerate() {
        let args = DecodeArgs {
            rows: &rs,
            d,
            dv,
            k: k.as_ptr(),
            ldk: d,
            v: v.as_ptr(),
            ldv: dv,
            k_scale: std::ptr::null(),
            v_scale: std::ptr::null(),
            j_begin,
            j_end,
            scale: 1.0 / (d as f32).sqrt(),
            walk,
            pages: KvPages::contiguous(),
        };
        kernel(&args, parts[c * rows * pl..].as_mut_ptr(), pl, &mut scratch);
    }
    let mut res = Vec::new();
    for r in 0..rows {
        let mut out = vec![0.0; dv];
        let lse = merge_partials(&parts[r * pl..], rows * pl, 2, None, &mut out);
        res.extend(out);
        res.push(lse);
    }
    res
}

fn decode_case<E: Operand + Elem>(
    isa: Isa,
    rng: &mut SmallRng,
    walk: DecodeWalk,
    rows: usize,
    ext: (usize, usize, usize),
) {
    let (n, d, dv) = ext;
    let (q, qf) = values::<E>(rng, rows * d);
    let (k, kf) = values::<E>(rng, n * d);
    let (v, vf) = values::<E>(rng, n * dv);
    // SAFETY (both closures): `decode` passes K, V covering `n` rows, Q `rows` rows and a
    // partial buffer of two chunks of `rows` partials; the ISA is supported.
    let generic = |a: &DecodeArgs<E, E>, p: *mut f32, ldp: usize, sc: &mut [f32]| unsafe {
        decode_partial_as(isa, a, p, ldp, sc)
    };
    let got = decode(generic, walk, &q, rows, &k, &v, ext);
    // The compiled instance: f32 queries (the widened ones) over K and V of `E`.
    // SAFETY: as the closures above (`decode` passes the same extents; the ISA is supported).
    let instance = |a: &DecodeArgs<f32, E>, p: *mut f32, ldp: usize, sc: &mut [f32]| unsafe {
        E::decode_partial(isa, a, p, ldp, sc)
    };
    let got_instance = decode(instance, walk, &qf, rows, &k, &v, ext);
    let f32 = |a: &DecodeArgs, p: *mut f32, ldp: usize, sc: &mut [f32]| unsafe {
        decode_partial(isa, a, p, ldp, sc)
    };
    let f32s = decode(f32, walk, &qf, rows, &kf, &vf, ext);
    let ctx = format!(
        "{isa} {walk:?} Q={:?} KV={:?} rows={rows} n={n} d={d} dv={dv}",
        E::DTYPE,
        E::DTYPE
    );
    // Bitwise what f32 operands give, except that SIMD ISAs read bf16 K and V as pairs (even and
    // odd elements in separate registers), which sums in another order: then within rounding
    // (and both within the f64 bound below). The two bf16 instances agree bitwise.
    let reordered = E::DTYPE == Dtype::Bf16 && isa != Isa::Scalar;
    for (i, ((g, gi), w)) in got.iter().zip(&got_instance).zip(&f32s).enumerate() {
        if reordered {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{ctx}: [{i}] {g} vs f32 {w}"
            );
        } else {
            assert_eq!(g.to_bits(), w.to_bits(), "{ctx}: [{i}] {g} vs f32 {w}");
        }
        assert_eq!(
            gi.to_bits(),
            g.to_bits(),
            "{ctx}: [{i}] f32 Q: {gi} vs bf16 Q {g}"
        );
    }
    let scale = 1.0 / (d as f64).sqrt();
    for r in 0..rows {
        let (want, _, _) = reference::attention_head(
            1,
            n,
            dv,
            |_, j| {
                let dot: f64 = (0..d)
                    .map(|p| qf[r * d + p] as f64 * kf[j * d + p] as f64)
                    .sum();
                Some(dot * scale)
            },
            |j, c| vf[j * dv + c] as f64,
        );
        for (c, w) in want.iter().enumerate() {
            let g = got[r * (dv + 1) + c] as f64;
            assert!(
                (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                "{ctx}: row {r} out[{c}] {g} vs f64 {w}"
            );
        }
    }
}

#[test]
fn decode_reads_bf16_and_f16_operands_exactly_as_their_f32_values() {
    let mut rng = SmallRng::seed_from_u64(12);
    let exts = [
        (1, 1, 1),
        (40, 17, 9),
        (77, 64, 64),
        (200, 128, 128),
        (33, 80, 24),
    ];
    for isa in isas() {
        for walk in [DecodeWalk::Streams, DecodeWalk::Prefetch] {
            for rows in 1..=9 {
                let ext = exts[rows % exts.len()];
                decode_case::<bf16>(isa, &mut rng, walk, rows, ext);
                decode_case::<f16>(isa, &mut rng, walk, rows, ext);
            }
        }
    }
}
