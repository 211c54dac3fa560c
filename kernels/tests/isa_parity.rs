//! Every kernel on every ISA this CPU has, against its f64 twin in `reference`.
//! Set `ATTNKIT_REQUIRE_ISAS=avx2,avx512` to fail (not skip) when a path is missing.

use attnkit_kernels::{
    flash_forward, reference, scratch_len, Alibi, FlashArgs, KvPages, ScoreSpec,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{decode_spec, isas, range_spec};

fn ulps(a: f32, b: f64) -> f64 {
    let ulp = (b.abs() as f32).max(f32::MIN_POSITIVE);
    let ulp = (f32::from_bits(ulp.to_bits() + 1) - ulp) as f64;
    (a as f64 - b).abs() / ulp
}

#[test]
fn exp2_matches_f64_over_the_whole_range() {
    // Dense grid over [-130, 130] plus the special values.
    let mut xs: Vec<f32> = (0..=2_600_000).map(|i| -130.0 + i as f32 * 1e-4).collect();
    xs.extend([
        f32::NEG_INFINITY,
        -1e30,
        -150.0,
        -126.4,
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        126.9,
    ]);
    for isa in isas() {
        let mut y = xs.clone();
        attnkit_kernels::exp2_slice(isa, &mut y);
        let mut worst = 0.0f64;
        for (&x, &got) in xs.iter().zip(&y) {
            let want = reference::exp2(x as f64);
            if x < -126.5 {
                assert_eq!(got, 0.0, "{isa}: exp2({x}) must flush to 0, got {got}");
            } else if (-126.0..=127.0).contains(&x) {
                let u = ulps(got, want);
                worst = worst.max(u);
                assert!(u <= 3.0, "{isa}: exp2({x}) = {got}, want {want} ({u} ulp)");
            }
        }
        let mut nan = [f32::NAN; 3];
        attnkit_kernels::exp2_slice(isa, &mut nan);
        assert!(nan.iter().all(|v| v.is_nan()), "{isa}: NaN must propagate");
        assert_eq!(y[xs.len() - 5], 1.0, "{isa}: exp2(0) must be exact");
        eprintln!("{isa}: exp2 worst error {worst:.2} ulp");
    }
}

#[test]
fn softmax_row_matches_f64() {
    let mut rng = SmallRng::seed_from_u64(1);
    for isa in isas() {
        for n in [1, 2, 7, 8, 9, 15, 16, 17, 35, 64, 65, 127, 257] {
            for mag in [1.0f32, 30.0, 1e3, 1e30] {
                let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0) * mag).collect();
                let mut y = x.clone();
                attnkit_kernels::softmax_row(isa, &mut y);
                let want = reference::softmax_row(&x.iter().map(|&v| v as f64).collect::<Vec<_>>());
                for (g, w) in y.iter().zip(&want) {
                    assert!(
                        (*g as f64 - w).abs() <= 2e-6 * w + 1e-7,
                        "{isa} n={n} mag={mag}: {g} vs {w}"
                    );
                }
                // Shift invariance.
                let mut z: Vec<f32> = x.iter().map(|v| v + 3.0).collect();
                attnkit_kernels::softmax_row(isa, &mut z);
                if mag <= 30.0 {
                    for (a, b) in y.iter().zip(&z) {
                        assert!((a - b).abs() <= 1e-6, "{isa}: softmax(x+c) != softmax(x)");
                    }
                }
            }
        }
        let mut masked = [f32::NEG_INFINITY; 5];
        attnkit_kernels::softmax_row(isa, &mut masked);
        assert_eq!(masked, [0.0; 5], "{isa}: fully masked row gives zeros");
        let mut nan = [0.0, f32::NAN, 1.0];
        attnkit_kernels::softmax_row(isa, &mut nan);
        assert!(nan.iter().any(|v| v.is_nan()), "{isa}: NaN must propagate");
    }
}

#[test]
fn matmul_is_exact_on_small_integers() {
    let mut rng = SmallRng::seed_from_u64(2);
    let sizes = [1usize, 2, 5, 7, 8, 9, 15, 16, 17, 35, 63, 64, 65, 129];
    for isa in isas() {
        for &m in &sizes[..10] {
            for &n in &sizes {
                for &k in &[0usize, 1, 3, 16, 24, 65] {
                    let lda = k + 3;
                    let ldb = n + 1;
                    let ldc = n + 2;
                    let a: Vec<f32> = (0..m * lda).map(|_| rng.gen_range(-4..=4) as f32).collect();
                    let b: Vec<f32> = (0..k.max(1) * ldb)
                        .map(|_| rng.gen_range(-4..=4) as f32)
                        .collect();
                    let c0: Vec<f32> = (0..m * ldc).map(|_| rng.gen_range(-4..=4) as f32).collect();
                    let want = reference::matmul(m, n, k, &a, lda, &b, ldb);
                    // Replace: C's old contents (NaN here) must not be read.
                    let mut c = vec![f32::NAN; m * ldc];
                    attnkit_kernels::matmul(isa, m, n, k, &a, lda, &b, ldb, &mut c, ldc, false);
                    let mut c2 = c0.clone();
                    attnkit_kernels::matmul(isa, m, n, k, &a, lda, &b, ldb, &mut c2, ldc, true);
                    for i in 0..m {
                        for j in 0..n {
                            assert_eq!(
                                c[i * ldc + j] as f64,
                                want[i * n + j],
                                "{isa} {m}x{n}x{k} ({i},{j})"
                            );
                            let w2 = want[i * n + j] + c0[i * ldc + j] as f64;
                            assert_eq!(c2[i * ldc + j] as f64, w2, "{isa} accumulate {m}x{n}x{k}");
                        }
                        // Padding between rows is untouched.
                        for j in n..ldc.min(c.len() - i * ldc) {
                            assert!(c[i * ldc + j].is_nan(), "{isa}: stray write in padding");
                        }
                    }
                }
            }
        }
    }
}

/// Flash kernel on one head against `reference::attention_head`.
#[test]
fn flash_forward_matches_reference() {
    let mut rng = SmallRng::seed_from_u64(3);
    let dims = [1usize, 3, 16, 24, 64, 80, 128, 256];
    for isa in isas() {
        for case in 0..120 {
            let m = [1, 5, 17, 64, 100][case % 5];
            let n = [1, 7, 128, 129, 300][(case / 5) % 5];
            let d = dims[case % dims.len()];
            let dv = dims[(case * 7 + 3) % dims.len()];
            let row0 = rng.gen_range(0..4usize);
            let causal = match case % 3 {
                0 => None,
                1 => Some(0isize),
                _ => Some(n as isize - (m + row0) as isize),
            };
            let key_len = if case % 4 == 0 {
                rng.gen_range(0..=n)
            } else {
                n
            };
            let window = if causal.is_some() && case % 7 < 3 {
                Some(rng.gen_range(1..=n + 2))
            } else {
                None
            };
            let use_bias = case % 5 == 1;
            let use_mask = case % 6 == 2;
            // Score modifiers, crossing each other and the masks above.
            let softcap = (case % 8 == 3 || case % 8 == 6).then(|| rng.gen_range(0.5..3.0f32));
            let alibi = (case % 9 == 2 || case % 9 == 5).then(|| Alibi {
                slope: rng.gen_range(-0.2..0.5f32),
                offset: rng.gen_range(-3..(n as isize + 3)),
            });
            let sink = (case % 7 == 4 || case % 7 == 1).then(|| rng.gen_range(-3.0..3.0f32));
            let (ldq, ldk, ldv, ldo) = (d + 1, d + 2, dv + 3, dv + 5);
            let q: Vec<f32> = (0..m * ldq).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let k: Vec<f32> = (0..n * ldk).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let v: Vec<f32> = (0..n * ldv).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let bias: Vec<f32> = (0..m * n).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let mask: Vec<bool> = (0..m * n).map(|_| rng.gen_bool(0.7)).collect();
            let scale = 1.0 / (d as f32).sqrt();
            let mut o = vec![f32::NAN; m * ldo];
            let mut lse = vec![0.0f32; m];
            let mut wts = vec![f32::NAN; m * n];
            let spec = ScoreSpec {
                row0,
                key_len,
                causal,
                window,
                softcap,
                alibi,
                sink,
                bias: if use_bias {
                    bias.as_ptr()
                } else {
                    std::ptr::null()
                },
                ldbias: n,
                mask: if use_mask {
                    mask.as_ptr().cast::<u8>()
                } else {
                    std::ptr::null()
                },
                ldmask: n,
            };
            let args = FlashArgs {
                m,
                n,
                d,
                dv,
                scale,
                spec,
                q: q.as_ptr(),
                ldq,
                k: k.as_ptr(),
                ldk,
                v: v.as_ptr(),
                ldv,
                k_scale: std::ptr::null(),
                v_scale: std::ptr::null(),
                o: o.as_mut_ptr(),
                ldo,
                lse: lse.as_mut_ptr(),
                weights: wts.as_mut_ptr(),
                ldw: n,
                pages: KvPages::contiguous(),
            };
            let mut scratch = vec![0.0f32; scratch_len(m, d, dv)];
            // SAFETY: every buffer above covers the extents in `args`; the ISA is supported.
            unsafe { flash_forward(isa, &args, &mut scratch) };
            let (want, want_lse, want_w) = reference::attention_head_with_sink(
                m,
                n,
                dv,
                sink.map(f64::from),
                |i, j| {
                    let dot: f64 = (0..d)
                        .map(|p| q[i * ldq + p] as f64 * k[j * ldk + p] as f64)
                        .sum();
                    let b = if use_bias {
                        bias[i * n + j] as f64
                    } else {
                        0.0
                    };
                    let attend = !use_mask || mask[i * n + j];
                    reference::logit(&spec, i, j, dot * scale as f64, b, attend)
                },
                |j, c| v[j * ldv + c] as f64,
            );
            let ctx = format!("{isa} case {case}: m={m} n={n} d={d} dv={dv} causal={causal:?} window={window:?} key_len={key_len} softcap={softcap:?} alibi={alibi:?} sink={sink:?}");
            for i in 0..m {
                for c in 0..dv {
                    let (g, w) = (o[i * ldo + c] as f64, want[i * dv + c]);
                    assert!(
                        (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                        "{ctx}: out({i},{c}) {g} vs {w}"
                    );
                }
                for c in dv..ldo {
                    if i * ldo + c < o.len() {
                        assert!(o[i * ldo + c].is_nan(), "{ctx}: stray write");
                    }
                }
                let (g, w) = (lse[i] as f64, want_lse[i]);
                assert!(
                    g == w || (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                    "{ctx}: lse({i}) {g} vs {w}"
                );
                for j in 0..n {
                    let (g, w) = (wts[i * n + j] as f64, want_w[i * n + j]);
                    assert!(
                        (g - w).abs() <= 1e-6 + 1e-5 * w,
                        "{ctx}: w({i},{j}) {g} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn split_then_merge_heads_round_trips() {
    for (b, l, h, d) in [(1, 1, 1, 1), (2, 5, 3, 7), (1, 9, 4, 16)] {
        let x: Vec<f32> = (0..b * l * h * d).map(|i| i as f32).collect();
        let mut y = vec![0.0; x.len()];
        attnkit_kernels::split_heads(&x, &mut y, b, l, h, d);
        for bi in 0..b {
            for hi in 0..h {
                for li in 0..l {
                    for di in 0..d {
                        let want = x[((bi * l + li) * h + hi) * d + di];
                        assert_eq!(y[((bi * h + hi) * l + li) * d + di], want);
                    }
                }
            }
        }
        let mut z = vec![0.0; x.len()];
        attnkit_kernels::merge_heads(&y, &mut z, b, l, h, d);
        assert_eq!(x, z);
    }
}

/// Decode kernel: a group of rows over a key range, split into chunks and merged, against the
/// f64 reference.
#[test]
fn decode_partials_merge_to_reference() {
    use attnkit_kernels::{
        decode_partial, decode_scratch_len, merge_partials, partial_len, DecodeArgs, DecodeRow,
        DecodeWalk, KvPages,
    };
    let mut rng = SmallRng::seed_from_u64(4);
    for isa in isas() {
        // 154 = 2·7·11: every (rows, keys) pair twice, once per walk (77 is odd).
        for case in 0..154 {
            let walk = if case % 2 == 0 {
                DecodeWalk::Streams
            } else {
                DecodeWalk::Prefetch
            };
            let rows_n = 1 + case % 11; // crosses DECODE_MAX_ROWS
            let n = [1usize, 5, 31, 32, 33, 200, 777][case % 7];
            let d = [1usize, 3, 16, 24, 64, 80, 128, 256][case % 8];
            let dv = [1usize, 7, 16, 64, 128, 17][(case / 3) % 6];
            let (ldk, ldv) = (d + 1, dv + 2);
            let k: Vec<f32> = (0..n * ldk).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let v: Vec<f32> = (0..n * ldv).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let q: Vec<f32> = (0..rows_n * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
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
                        case % 9 == 2 || case % 9 == 7,
                    );
                    DecodeRow {
                        q: q[r * d..].as_ptr(),
                        spec,
                    }
                })
                .collect();
            let scale = 1.0 / (d as f32).sqrt();
            let chunks = 1 + case % 4;
            let step = n.div_ceil(chunks);
            let pl = partial_len(dv);
            let mut parts = vec![f32::NAN; chunks * rows_n * pl];
            let mut scratch = vec![0.0; decode_scratch_len(d, dv)];
            for c in 0..chunks {
                let args = DecodeArgs {
                    rows: &rows,
                    d,
                    dv,
                    k: k.as_ptr(),
                    ldk,
                    v: v.as_ptr(),
                    ldv,
                    k_scale: std::ptr::null(),
                    v_scale: std::ptr::null(),
                    j_begin: (c * step).min(n),
                    j_end: ((c + 1) * step).min(n),
                    scale,
                    walk,
                    pages: KvPages::contiguous(),
                };
                // SAFETY: buffers cover every extent in `args`; the ISA is supported.
                unsafe {
                    decode_partial(
                        isa,
                        &args,
                        parts[c * rows_n * pl..].as_mut_ptr(),
                        pl,
                        &mut scratch,
                    )
                };
            }
            for r in 0..rows_n {
                let mut out = vec![0.0; dv];
                let spec = rows[r].spec;
                let lse =
                    merge_partials(&parts[r * pl..], rows_n * pl, chunks, spec.sink, &mut out);
                let (want, want_lse, _) = reference::attention_head_with_sink(
                    1,
                    n,
                    dv,
                    spec.sink.map(f64::from),
                    |_, j| {
                        let dot: f64 = (0..d)
                            .map(|p| q[r * d + p] as f64 * k[j * ldk + p] as f64)
                            .sum();
                        let b = if use_bias {
                            bias[r * n + j] as f64
                        } else {
                            0.0
                        };
                        let attend = !use_mask || mask[r * n + j];
                        reference::logit(&spec, 0, j, dot * scale as f64, b, attend)
                    },
                    |j, c| v[j * ldv + c] as f64,
                );
                let ctx = format!(
                    "{isa} {walk:?} case {case} row {r}: n={n} d={d} dv={dv} chunks={chunks} spec={spec:?}"
                );
                for c in 0..dv {
                    let (g, w) = (out[c] as f64, want[c]);
                    assert!(
                        (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                        "{ctx}: out[{c}] {g} vs {w}"
                    );
                }
                let (g, w) = (lse as f64, want_lse[0]);
                assert!(
                    g == w || (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                    "{ctx}: lse {g} vs {w}"
                );
            }
        }
    }
}

/// Split-KV: every chunk count merges to the unsplit result within 1e-6.
#[test]
fn decode_split_counts_agree_with_unsplit() {
    use attnkit_kernels::{
        decode_partial, decode_scratch_len, merge_partials, partial_len, DecodeArgs, DecodeRow,
        DecodeWalk, KvPages,
    };
    let mut rng = SmallRng::seed_from_u64(5);
    let (n, d, dv, rows_n) = (3001usize, 128usize, 128usize, 4usize);
    let k: Vec<f32> = (0..n * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let v: Vec<f32> = (0..n * dv).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let q: Vec<f32> = (0..rows_n * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let rows: Vec<DecodeRow> = (0..rows_n)
        .map(|r| DecodeRow {
            q: q[r * d..].as_ptr(),
            spec: range_spec(0, n - r, n),
        })
        .collect();
    let pl = partial_len(dv);
    for isa in isas() {
        let run = |chunks: usize| -> Vec<f32> {
            let step = n.div_ceil(chunks);
            let mut parts = vec![0.0; chunks * rows_n * pl];
            let mut scratch = vec![0.0; decode_scratch_len(d, dv)];
            for c in 0..chunks {
                let args = DecodeArgs {
                    rows: &rows,
                    d,
                    dv,
                    k: k.as_ptr(),
                    ldk: d,
                    v: v.as_ptr(),
                    ldv: dv,
                    k_scale: std::ptr::null(),
                    v_scale: std::ptr::null(),
                    j_begin: (c * step).min(n),
                    j_end: ((c + 1) * step).min(n),
                    scale: 0.088,
                    walk: DecodeWalk::Auto,
                    pages: KvPages::contiguous(),
                };
                // SAFETY: buffers cover every extent in `args`; the ISA is supported.
                unsafe {
                    decode_partial(
                        isa,
                        &args,
                        parts[c * rows_n * pl..].as_mut_ptr(),
                        pl,
                        &mut scratch,
                    )
                };
            }
            let mut out = vec![0.0; rows_n * dv];
            for r in 0..rows_n {
                merge_partials(
                    &parts[r * pl..],
                    rows_n * pl,
                    chunks,
                    None,
                    &mut out[r * dv..(r + 1) * dv],
                );
            }
            out
        };
        let whole = run(1);
        for chunks in 2..=9 {
            for (a, b) in run(chunks).iter().zip(&whole) {
                assert!(
                    (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "{isa}: {chunks} chunks: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn rows_dot_matches_f64() {
    let mut rng = SmallRng::seed_from_u64(41);
    for isa in isas() {
        for m in [1, 2, 3, 4, 5] {
            for (k, n) in [
                (1, 1),
                (15, 3),
                (16, 4),
                (17, 9),
                (64, 7),
                (100, 33),
                (384, 5),
            ] {
                let (ldx, ldw, ldy) = (k + 3, k + 1, n + 2);
                let x: Vec<f32> = (0..m * ldx).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let w: Vec<f32> = (0..n * ldw).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let want = reference::rows_dot(m, k, n, &x, ldx, &w, ldw);
                let old: Vec<f32> = (0..m * ldy).map(|_| rng.gen_range(-1.0..1.0)).collect();
                for accumulate in [false, true] {
                    let mut y = old.clone();
                    // SAFETY: the buffers hold m rows of ldx ≥ k, n rows of ldw ≥ k, and m rows
                    // of ldy ≥ n.
                    unsafe {
                        attnkit_kernels::rows_dot(
                            isa,
                            m,
                            k,
                            n,
                            x.as_ptr(),
                            ldx,
                            w.as_ptr(),
                            ldw,
                            y.as_mut_ptr(),
                            ldy,
                            accumulate,
                        )
                    };
                    for r in 0..m {
                        for c in 0..ldy {
                            let got = y[r * ldy + c];
                            if c >= n {
                                assert_eq!(got, old[r * ldy + c], "{isa}: wrote past column {n}");
                                continue;
                            }
                            let base = if accumulate {
                                old[r * ldy + c] as f64
                            } else {
                                0.0
                            };
                            let want = base + want[r * n + c];
                            let tol = 1e-6 * (k as f64).sqrt() * (1.0 + want.abs());
                            assert!(
                                (got as f64 - want).abs() <= tol,
                                "{isa} m={m} k={k} n={n} acc={accumulate} ({r},{c}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// `tile_gemm` with A read in place through strides (row-major and transposed) and B, C wider
/// than the product's lanes, against the f64 product.
#[test]
fn tile_gemm_matches_f64() {
    let mut rng = SmallRng::seed_from_u64(43);
    for isa in isas() {
        let w = isa.lanes();
        for (m, nvec, k) in [
            (1, 1, 1),
            (7, 2, 13),
            (9, 1, 64),
            (17, 3, 5),
            (128, 8, 64),
            (3, 1, 0),
        ] {
            let n = nvec * w;
            for transposed in [false, true] {
                // A is m × k; stored as is (rsa = k + 2) or transposed (k × m, row stride m + 1).
                let (rsa, csa, alen) = if transposed {
                    (1, m + 1, k.max(1) * (m + 1))
                } else {
                    (k + 2, 1, m * (k + 2))
                };
                let a: Vec<f32> = (0..alen).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let ldb = n + 3;
                let b: Vec<f32> = (0..k * ldb).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let ldc = n + 5;
                let c0: Vec<f32> = (0..m * ldc).map(|_| rng.gen_range(-1.0..1.0)).collect();
                for accumulate in [false, true] {
                    let mut c = c0.clone();
                    // SAFETY: a, b and c cover the strides and extents above.
                    unsafe {
                        attnkit_kernels::tile_gemm(
                            isa,
                            m,
                            nvec,
                            k,
                            a.as_ptr(),
                            rsa,
                            csa,
                            b.as_ptr(),
                            ldb,
                            c.as_mut_ptr(),
                            ldc,
                            accumulate,
                        )
                    };
                    for i in 0..m {
                        for j in 0..ldc {
                            let got = c[i * ldc + j];
                            if j >= n {
                                assert_eq!(got, c0[i * ldc + j], "{isa}: wrote past column {n}");
                                continue;
                            }
                            let mut want = if accumulate {
                                c0[i * ldc + j] as f64
                            } else {
                                0.0
                            };
                            for p in 0..k {
                                want += a[i * rsa + p * csa] as f64 * b[p * ldb + j] as f64;
                            }
                            let tol = 1e-6 * (1.0 + (k as f64).sqrt()) * (1.0 + want.abs());
                            assert!(
                                (got as f64 - want).abs() <= tol,
                                "{isa} {m}x{n}x{k} t={transposed} acc={accumulate} ({i},{j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// `probs_and_ds` (the backward's step on a tile row): weights `exp(rule(scale·s) − lse)` and
/// `dS = p·(dP − delta)` (times the softcap's derivative, or not) against f64, over row lengths
/// around the vector widths, visible ranges that cut the row on either side, ALiBi and softcap;
/// hidden keys get exactly zero.
#[test]
fn probs_and_ds_matches_f64() {
    let mut rng = SmallRng::seed_from_u64(47);
    for isa in isas() {
        for n in [1usize, 7, 16, 17, 33, 100, 128] {
            for (lo, hi) in [(0, n), (0, n.div_ceil(2)), (n / 3, n), (n / 4, n - n / 4)] {
                if lo >= hi {
                    continue;
                }
                for (alibi, softcap, deriv) in [
                    (None, None, true),
                    (Some(0.375f32), None, true),
                    (None, Some(2.5f32), true),
                    (Some(0.375), Some(2.5), false),
                ] {
                    let j0 = 5;
                    let spec = ScoreSpec {
                        alibi: alibi.map(|slope| Alibi { slope, offset: 2 }),
                        softcap,
                        ..range_spec(j0 + lo, j0 + hi, j0 + n)
                    };
                    let s: Vec<f32> = (0..n).map(|_| rng.gen_range(-8.0..8.0)).collect();
                    let dp: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let (scale, delta) = (0.35f32, rng.gen_range(-0.5f32..0.5));
                    // The logits in f64 (−inf where hidden) with the softcap's derivative, and
                    // the lse of the visible ones.
                    let logit: Vec<(f64, f64)> = (0..n)
                        .map(|c| {
                            if c < lo || c >= hi {
                                return (f64::NEG_INFINITY, 0.0);
                            }
                            let x = scale as f64 * s[c] as f64;
                            let (x, g) = match softcap {
                                Some(cap) => {
                                    let t = (x / cap as f64).tanh();
                                    (cap as f64 * t, 1.0 - t * t)
                                }
                                None => (x, 1.0),
                            };
                            let a =
                                alibi.map_or(0.0, |sl| sl as f64 * (2.0 - (j0 + c) as f64).abs());
                            (x - a, if deriv { g } else { 1.0 })
                        })
                        .collect();
                    let mx = logit.iter().map(|l| l.0).fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = logit.iter().map(|&(x, _)| (x - mx).exp()).sum();
                    let lse = (mx + sum.ln()) as f32;
                    let (mut p, mut ds) = (s.clone(), dp.clone());
                    // SAFETY: the spec has no bias or mask.
                    unsafe {
                        attnkit_kernels::probs_and_ds(
                            isa,
                            &spec,
                            0,
                            j0,
                            (scale, lse, delta),
                            &mut p,
                            &mut ds,
                            deriv,
                        )
                    };
                    for c in 0..n {
                        let ctx = format!(
                            "{isa} n={n} [{lo},{hi}) alibi={alibi:?} softcap={softcap:?} \
                             deriv={deriv} key {c}"
                        );
                        if c < lo || c >= hi {
                            assert!(p[c] == 0.0 && ds[c] == 0.0, "{ctx}: hidden key not zero");
                            continue;
                        }
                        let (x, g) = logit[c];
                        let want_p = (x - lse as f64).exp();
                        let want_ds = want_p * (dp[c] as f64 - delta as f64) * g;
                        let rel = 1e-6 * (1.0 + x.abs() + (lse as f64).abs());
                        assert!(
                            (p[c] as f64 - want_p).abs() <= rel * want_p,
                            "{ctx}: p {} vs {want_p}",
                            p[c]
                        );
                        let tol = rel * want_p * (dp[c].abs() + delta.abs()) as f64 + 1e-12;
                        assert!(
                            (ds[c] as f64 - want_ds).abs() <= tol,
                            "{ctx}: dS {} vs {want_ds}",
                            ds[c]
                        );
                    }
                }
            }
        }
    }
}
