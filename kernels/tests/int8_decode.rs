//! Decode over int8 K and V (row scales beside the data) on every ISA against the f64 reference
//! on the dequantised values: groups of one to three rows, contiguous and paged (paged equal to
//! contiguous bitwise), with every score rule, split into chunks; and a query or scale that is
//! not finite propagates alike on every ISA.

use attnkit_kernels::{
    decode_partial_as, decode_scratch_len, merge_partials, partial_len, reference, DecodeArgs,
    DecodeRow, DecodeWalk, Isa, KvPages, ScoreSpec,
};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

mod common;
use common::{decode_spec, isas};

/// `n` logical int8 rows of K (`d`) and V (`dv`) with their scales, laid out contiguously
/// (padded rows) or in shuffled pages of `2^shift` rows.
struct Cache {
    k: Vec<i8>,
    v: Vec<i8>,
    ks: Vec<f32>,
    vs: Vec<f32>,
    ldk: usize,
    ldv: usize,
    table: Vec<u32>,
    shift: Option<u32>,
}

impl Cache {
    fn new(rng: &mut SmallRng, rows: &Logical, shift: Option<u32>) -> Cache {
        let (n, d, dv) = (rows.n, rows.d, rows.dv);
        let (ldk, ldv) = (d + rng.gen_range(0..3), dv + rng.gen_range(0..3));
        let ps = shift.map_or(n.max(1), |s| 1 << s);
        let pages = n.div_ceil(ps).max(1);
        // Pool pages in a shuffled order, one spare page between them.
        let mut table: Vec<u32> = (0..pages as u32).map(|p| 2 * p + 1).collect();
        table.shuffle(rng);
        if shift.is_none() {
            table = vec![0];
        }
        let slots = 2 * pages + 1;
        let mut c = Cache {
            k: vec![0; slots * ps * ldk],
            v: vec![0; slots * ps * ldv],
            ks: vec![f32::NAN; slots * ps],
            vs: vec![f32::NAN; slots * ps],
            ldk,
            ldv,
            table,
            shift,
        };
        for j in 0..n {
            let row = c.table[j / ps] as usize * ps + j % ps;
            c.k[row * ldk..][..d].copy_from_slice(&rows.k[j * d..][..d]);
            c.v[row * ldv..][..dv].copy_from_slice(&rows.v[j * dv..][..dv]);
            c.ks[row] = rows.ks[j];
            c.vs[row] = rows.vs[j];
        }
        c
    }

    fn pages(&self) -> KvPages {
        match self.shift {
            None => KvPages::contiguous(),
            Some(s) => KvPages {
                table: self.table.as_ptr(),
                shift: s,
                k_stride: (1 << s) * self.ldk,
                v_stride: (1 << s) * self.ldv,
                scale_stride: 1 << s,
            },
        }
    }
}

/// Dense logical rows.
struct Logical {
    n: usize,
    d: usize,
    dv: usize,
    k: Vec<i8>,
    v: Vec<i8>,
    ks: Vec<f32>,
    vs: Vec<f32>,
}

impl Logical {
    fn random(rng: &mut SmallRng, n: usize, d: usize, dv: usize, extreme: bool) -> Logical {
        let byte = |rng: &mut SmallRng| {
            if extreme {
                127
            } else {
                rng.gen_range(-127..=127i32) as i8
            }
        };
        let scale = |rng: &mut SmallRng| {
            if rng.gen_bool(0.05) {
                0.0
            } else {
                rng.gen_range(0.002..0.05f32)
            }
        };
        Logical {
            n,
            d,
            dv,
            k: (0..n * d).map(|_| byte(rng)).collect(),
            v: (0..n * dv)
                .map(|_| rng.gen_range(-127..=127i32) as i8)
                .collect(),
            ks: (0..n).map(|_| scale(rng)).collect(),
            vs: (0..n).map(|_| scale(rng)).collect(),
        }
    }
}

/// The merged outputs and logsumexps of `rows` over the cache, in `chunks` key ranges.
fn run(
    isa: Isa,
    cache: &Cache,
    rows: &[DecodeRow],
    (n, d, dv): (usize, usize, usize),
    chunks: usize,
    walk: DecodeWalk,
) -> (Vec<f32>, Vec<f32>) {
    let pl = partial_len(dv);
    let rn = rows.len();
    let step = n.div_ceil(chunks).max(1);
    let mut parts = vec![f32::NAN; chunks * rn * pl];
    let mut scratch = vec![0.0; decode_scratch_len(d, dv)];
    for c in 0..chunks {
        let args = DecodeArgs::<f32, i8> {
            rows,
            d,
            dv,
            k: cache.k.as_ptr(),
            ldk: cache.ldk,
            v: cache.v.as_ptr(),
            ldv: cache.ldv,
            k_scale: cache.ks.as_ptr(),
            v_scale: cache.vs.as_ptr(),
            j_begin: (c * step).min(n),
            j_end: ((c + 1) * step).min(n),
            scale: 1.0 / (d as f32).sqrt(),
            walk,
            pages: cache.pages(),
        };
        // SAFETY: the cache holds every row `< n` of every page in its table, with scales;
        // `parts` and `scratch` have the sizes the contract asks; the ISA is supported.
        unsafe {
            decode_partial_as(
                isa,
                &args,
                parts[c * rn * pl..].as_mut_ptr(),
                pl,
                &mut scratch,
            )
        };
    }
    let mut out = vec![0.0; rn * dv];
    let mut lse = vec![0.0; rn];
    for r in 0..rn {
        lse[r] = merge_partials(
            &parts[r * pl..],
            rn * pl,
            chunks,
            rows[r].spec.sink,
            &mut out[r * dv..(r + 1) * dv],
        );
    }
    (out, lse)
}

#[test]
fn int8_decode_matches_f64_on_dequantised_values() {
    let mut rng = SmallRng::seed_from_u64(21);
    for isa in isas() {
        for case in 0..180 {
            let rows_n = [1, 1, 1, 2, 3][case % 5];
            let n = [1usize, 5, 15, 16, 17, 31, 32, 33, 100, 777][case % 10];
            let d = [1usize, 3, 16, 63, 64, 65, 128, 200, 256][case % 9];
            let dv = [1usize, 7, 64, 65, 128, 130][(case / 2) % 6];
            let walk = if case % 2 == 0 {
                DecodeWalk::Streams
            } else {
                DecodeWalk::Prefetch
            };
            let extreme = case % 17 == 3;
            let rows_data = Logical::random(&mut rng, n, d, dv, extreme);
            // Queries: plain, all zero, large, tiny, or one large value among small ones.
            let mut q: Vec<f32> = (0..rows_n * d)
                .map(|_| rng.gen_range(-1.0..1.0f32))
                .collect();
            match case % 7 {
                1 => q.fill(0.0),
                2 => q.iter_mut().for_each(|x| *x *= 4.0),
                3 => q.iter_mut().for_each(|x| *x *= 1e-30),
                4 => {
                    q.iter_mut().for_each(|x| *x *= 1e-3);
                    q[0] = 2.0;
                }
                _ if extreme => q.iter_mut().for_each(|x| *x = x.abs()),
                _ => {}
            }
            let bias: Vec<f32> = (0..rows_n * n).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let mask: Vec<bool> = (0..rows_n * n).map(|_| rng.gen_bool(0.8)).collect();
            let (use_bias, use_mask) = (case % 4 == 1, case % 5 == 2);
            let rows: Vec<DecodeRow> = (0..rows_n)
                .map(|r| {
                    let spec = decode_spec(
                        &mut rng,
                        case,
                        n,
                        use_bias.then(|| &bias[r * n..]),
                        use_mask.then(|| &mask[r * n..]),
                        case % 9 == 2,
                    );
                    DecodeRow {
                        q: q[r * d..].as_ptr(),
                        spec,
                    }
                })
                .collect();
            let chunks = 1 + case % 4;
            let contiguous = Cache::new(&mut rng, &rows_data, None);
            let shift = rng.gen_range(0..6);
            let paged = Cache::new(&mut rng, &rows_data, Some(shift));
            let dims = (n, d, dv);
            let (out, lse) = run(isa, &contiguous, &rows, dims, chunks, walk);
            let (pout, plse) = run(isa, &paged, &rows, dims, chunks, walk);
            let ctx = format!(
                "{isa} {walk:?} case {case}: rows={rows_n} n={n} d={d} dv={dv} chunks={chunks}"
            );
            assert!(
                out.iter()
                    .zip(&pout)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                    && lse
                        .iter()
                        .zip(&plse)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ctx}: paged differs from contiguous: {out:?} {pout:?} {lse:?} {plse:?}"
            );
            let scale = 1.0 / (d as f64).sqrt();
            for (r, row) in rows.iter().enumerate() {
                let spec = row.spec;
                let (want, want_lse, _) = reference::attention_head_with_sink(
                    1,
                    n,
                    dv,
                    spec.sink.map(f64::from),
                    |_, j| {
                        let dot: f64 = (0..d)
                            .map(|p| {
                                q[r * d + p] as f64
                                    * rows_data.k[j * d + p] as f64
                                    * rows_data.ks[j] as f64
                            })
                            .sum();
                        let b = if use_bias {
                            bias[r * n + j] as f64
                        } else {
                            0.0
                        };
                        let attend = !use_mask || mask[r * n + j];
                        reference::logit(&spec, 0, j, dot * scale, b, attend)
                    },
                    |j, c| rows_data.v[j * dv + c] as f64 * rows_data.vs[j] as f64,
                );
                for c in 0..dv {
                    let (g, w) = (out[r * dv + c] as f64, want[c]);
                    assert!(
                        (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                        "{ctx} row {r}: out[{c}] {g} vs {w}"
                    );
                }
                let (g, w) = (lse[r] as f64, want_lse[0]);
                assert!(
                    g == w || (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                    "{ctx} row {r}: lse {g} vs {w}"
                );
            }
        }
    }
}

/// A query or a scale that is not finite: every ISA gives the AVX-512 kernel's NaN and
/// infinity pattern.
#[test]
fn int8_decode_non_finite_inputs_propagate_alike_on_every_isa() {
    let mut rng = SmallRng::seed_from_u64(22);
    let (n, d, dv) = (70, 40, 24);
    for case in 0..4 {
        let mut data = Logical::random(&mut rng, n, d, dv, false);
        let mut q: Vec<f32> = (0..d).map(|_| rng.gen_range(-1.0..1.0f32)).collect();
        match case {
            0 => q[7] = f32::NAN,
            1 => q[3] = f32::INFINITY,
            2 => data.vs[40] = f32::NAN,
            _ => data.vs[5] = f32::INFINITY,
        }
        let cache = Cache::new(&mut rng, &data, None);
        let rows = [DecodeRow {
            q: q.as_ptr(),
            spec: ScoreSpec::new(n),
        }];
        let pattern = |isa: Isa| {
            let (out, _) = run(isa, &cache, &rows, (n, d, dv), 2, DecodeWalk::Streams);
            out.iter()
                .map(|x| (x.is_nan(), x.is_infinite()))
                .collect::<Vec<_>>()
        };
        let isas = isas();
        let Some(&base) = isas.iter().find(|&&i| i == Isa::Avx512) else {
            continue;
        };
        let want = pattern(base);
        assert!(want.iter().any(|&(a, b)| a || b), "case {case}: finite");
        for isa in isas {
            assert_eq!(pattern(isa), want, "case {case} {isa}");
        }
    }
}
