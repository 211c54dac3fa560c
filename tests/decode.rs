//! The decode path: KV cache, split-KV, GQA grouping, merge, path choice.

use attnkit::{
    merge, sdpa, sdpa_ext, AttnError, Causal, Extras, Isa, Kernel, KvCache, Partial, SdpaOptions,
    Tensor, TensorMut,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn randn(rng: &mut SmallRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn close(a: &[f32], b: &[f32], atol: f32, rtol: f32, ctx: &str) {
    assert_eq!(a.len(), b.len(), "{ctx}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= atol + rtol * y.abs(),
            "{ctx}: [{i}] {x} vs {y}"
        );
    }
}

/// Runs one configuration through both kernels, on every ISA; they must agree.
#[test]
fn decode_path_equals_prefill_path() {
    let mut rng = SmallRng::seed_from_u64(10);
    for isa in Isa::available() {
        for case in 0..40 {
            let b = 1 + case % 2;
            let hkv = [1, 2, 4][case % 3];
            let g = [1, 2, 4, 8][(case / 3) % 4];
            let hq = hkv * g;
            let lq = [1, 2, 3][case % 3];
            let lk = [1, 7, 33, 513, 1500][case % 5];
            let d = [16, 64, 128, 3, 80][(case / 2) % 5];
            let dv = if case % 4 == 0 { 24 } else { d };
            let q = randn(&mut rng, b * hq * lq * d);
            let k = randn(&mut rng, b * hkv * lk * d);
            let v = randn(&mut rng, b * hkv * lk * dv);
            let lens: Vec<usize> = (0..b).map(|_| rng.gen_range(lq.min(lk)..=lk)).collect();
            let bias = randn(&mut rng, b * hq * lq * lk);
            let mut opts = SdpaOptions::new().isa(isa);
            if case % 2 == 1 {
                opts = opts.causal(Causal::BottomRight).key_lengths(&lens);
            }
            if case % 5 == 3 {
                opts = opts.causal(Causal::BottomRight).window(1 + lk / 3);
            }
            if case % 7 == 2 {
                opts = opts.bias(attnkit::MaskRef::new(&bias, [b, hq, lq, lk]));
            }
            let run = |path: Kernel| {
                let mut out = vec![f32::NAN; b * hq * lq * dv];
                let mut lse = vec![0.0f32; b * hq * lq];
                sdpa_ext(
                    &Tensor::bhld(&q, [b, hq, lq, d]),
                    &Tensor::bhld(&k, [b, hkv, lk, d]),
                    &Tensor::bhld(&v, [b, hkv, lk, dv]),
                    &mut TensorMut::blhd(&mut out, [b, lq, hq, dv]),
                    &opts.kernel(path),
                    Extras {
                        lse: Some(&mut lse),
                        weights: None,
                    },
                )
                .unwrap();
                (out, lse)
            };
            let (od, ld) = run(Kernel::Decode);
            let (op, lp) = run(Kernel::Prefill);
            let ctx =
                format!("{isa} case {case}: b={b} hq={hq} hkv={hkv} lq={lq} lk={lk} d={d} dv={dv}");
            close(&od, &op, 2e-6, 1e-5, &ctx);
            for (x, y) in ld.iter().zip(&lp) {
                assert!(
                    x == y || (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "{ctx}: lse {x} vs {y}"
                );
            }
        }
    }
}

/// Token-by-token decoding through a KV cache equals one causal pass over the whole sequence.
#[test]
fn incremental_decoding_equals_full_causal_attention() {
    incremental_decoding(false);
}

/// The same with ALiBi, softcap, sinks and a sliding window: each query's position in the cache
/// (bottom-right) is its position in the full sequence (top-left).
#[test]
fn incremental_decoding_with_score_modifiers() {
    incremental_decoding(true);
}

fn incremental_decoding(mods: bool) {
    let mut rng = SmallRng::seed_from_u64(11);
    let (b, hq, hkv, len, d) = (2, 8, 2, 70, 32);
    let q = randn(&mut rng, b * len * hq * d); // (B, L, Hq, D): a projection's layout
    let k = randn(&mut rng, b * len * hkv * d);
    let v = randn(&mut rng, b * len * hkv * d);
    let slopes = attnkit::alibi_slopes(hq, 8.0);
    let sinks: Vec<f32> = (0..hq).map(|h| h as f32 - 3.0).collect();
    fn with<'a>(
        o: SdpaOptions<'a>,
        mods: bool,
        slopes: &'a [f32],
        sinks: &'a [f32],
    ) -> SdpaOptions<'a> {
        if mods {
            o.alibi(slopes).softcap(2.0).sinks(sinks).window(9)
        } else {
            o
        }
    }
    let modify = |o| with(o, mods, &slopes, &sinks);
    let mut full = vec![0.0; b * len * hq * d];
    sdpa(
        &Tensor::blhd(&q, [b, len, hq, d]),
        &Tensor::blhd(&k, [b, len, hkv, d]),
        &Tensor::blhd(&v, [b, len, hkv, d]),
        &mut TensorMut::blhd(&mut full, [b, len, hq, d]),
        &modify(SdpaOptions::new().causal(Causal::TopLeft)),
    )
    .unwrap();
    for isa in Isa::available() {
        let mut cache = KvCache::new(b, hkv, len, d, d).unwrap();
        let mut pos = 0;
        // A 5-token prefill, then steps of 1, 2 and 3 tokens.
        let steps = std::iter::once(5).chain([1, 2, 3].into_iter().cycle());
        for t in steps {
            let t = t.min(len - pos);
            if t == 0 {
                break;
            }
            // Rows pos..pos+t of a (B, L, H, D) buffer, as a (B, H, t, D) view.
            fn view(
                x: &[f32],
                h: usize,
                pos: usize,
                t: usize,
                b: usize,
                len: usize,
                d: usize,
            ) -> Tensor<'_> {
                Tensor::strided(&x[pos * h * d..], [b, h, t, d], [len * h * d, d, h * d])
            }
            cache
                .append(
                    &view(&k, hkv, pos, t, b, len, d),
                    &view(&v, hkv, pos, t, b, len, d),
                )
                .unwrap();
            let mut out = vec![0.0; b * t * hq * d];
            let qv = view(&q, hq, pos, t, b, len, d);
            cache
                .attend(
                    &qv,
                    &mut TensorMut::blhd(&mut out, [b, t, hq, d]),
                    &modify(SdpaOptions::new().isa(isa).causal(Causal::BottomRight)),
                )
                .unwrap();
            for bi in 0..b {
                let got = &out[bi * t * hq * d..(bi + 1) * t * hq * d];
                let want = &full[(bi * len + pos) * hq * d..(bi * len + pos + t) * hq * d];
                close(
                    got,
                    want,
                    1e-5,
                    1e-5,
                    &format!("{isa} pos {pos} t {t} batch {bi}"),
                );
            }
            pos += t;
        }
        assert_eq!(cache.lens(), &[len, len]);
    }
}

/// Rolling back a sequence and appending other tokens gives the attention of the new sequence.
#[test]
fn kv_cache_truncate_and_capacity() {
    let (b, h, d) = (2, 1, 4);
    let mut cache = KvCache::new(b, h, 3, d, d).unwrap();
    let one = vec![1.0f32; b * h * d];
    let two = vec![2.0f32; b * h * d];
    fn t(x: &[f32]) -> Tensor<'_> {
        Tensor::bhld(x, [2, 1, 1, 4])
    }
    for _ in 0..3 {
        cache.append(&t(&one), &t(&one)).unwrap();
    }
    let err = cache.append(&t(&one), &t(&one)).unwrap_err();
    assert!(
        matches!(
            err,
            AttnError::Capacity {
                batch: 0,
                len: 3,
                append: 1,
                capacity: 3
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("capacity 3"));
    assert!(matches!(
        cache.truncate(0, 5),
        Err(AttnError::KeyLength {
            batch: 0,
            len: 5,
            lk: 3
        })
    ));
    assert!(matches!(
        cache.truncate(7, 0),
        Err(AttnError::ShapeMismatch { arg: "batch", .. })
    ));
    let bad = vec![0.0f32; 3 * d];
    assert!(matches!(
        cache.append(&Tensor::bhld(&bad, [3, h, 1, d]), &t(&one)),
        Err(AttnError::ShapeMismatch {
            arg: "k",
            dim: "B",
            expected: 2,
            got: 3
        })
    ));
    // Roll sequence 1 back to one token, append a "2" token: its values average to 1.5.
    cache.truncate(1, 1).unwrap();
    cache.truncate(0, 2).unwrap();
    cache.append(&t(&two), &t(&two)).unwrap();
    assert_eq!(cache.lens(), &[3, 2]);
    let q = vec![0.0f32; b * h * d]; // zero query: uniform weights over the visible keys
    let mut out = vec![0.0f32; b * h * d];
    cache
        .attend(
            &t(&q),
            &mut TensorMut::bhld(&mut out, [b, h, 1, d]),
            &SdpaOptions::new(),
        )
        .unwrap();
    close(&out[..d], &[4.0 / 3.0; 4], 1e-6, 0.0, "sequence 0");
    close(&out[d..], &[1.5; 4], 1e-6, 0.0, "sequence 1");
}

/// Attention over two halves of the keys, merged by logsumexp, equals attention over all keys.
#[test]
fn merge_of_two_halves_equals_the_whole() {
    let mut rng = SmallRng::seed_from_u64(12);
    let (b, h, lq, lk, d) = (2, 3, 5, 301, 64);
    let q = randn(&mut rng, b * h * lq * d);
    let k = randn(&mut rng, b * h * lk * d);
    let v = randn(&mut rng, b * h * lk * d);
    let run = |lo: usize, hi: usize| {
        let mut out = vec![0.0; b * h * lq * d];
        let mut lse = vec![0.0; b * h * lq];
        let (kt, vt) = (
            Tensor::strided(&k[lo * d..], [b, h, hi - lo, d], [h * lk * d, lk * d, d]),
            Tensor::strided(&v[lo * d..], [b, h, hi - lo, d], [h * lk * d, lk * d, d]),
        );
        sdpa_ext(
            &Tensor::bhld(&q, [b, h, lq, d]),
            &kt,
            &vt,
            &mut TensorMut::bhld(&mut out, [b, h, lq, d]),
            &SdpaOptions::new(),
            Extras {
                lse: Some(&mut lse),
                weights: None,
            },
        )
        .unwrap();
        (out, lse)
    };
    let (whole, whole_lse) = run(0, lk);
    let (a, la) = run(0, 120);
    let (c, lc) = run(120, lk);
    let mut out = vec![0.0; whole.len()];
    let mut lse = vec![0.0; whole_lse.len()];
    merge(
        &[Partial { out: &a, lse: &la }, Partial { out: &c, lse: &lc }],
        d,
        &mut out,
        &mut lse,
    )
    .unwrap();
    close(&out, &whole, 1e-6, 1e-6, "merged output");
    close(&lse, &whole_lse, 1e-6, 1e-6, "merged lse");
    // A part that saw nothing (lse = -inf) changes nothing.
    let empty_out = vec![0.0; whole.len()];
    let empty_lse = vec![f32::NEG_INFINITY; whole_lse.len()];
    let mut out2 = vec![0.0; whole.len()];
    merge(
        &[
            Partial {
                out: &whole,
                lse: &whole_lse,
            },
            Partial {
                out: &empty_out,
                lse: &empty_lse,
            },
        ],
        d,
        &mut out2,
        &mut lse,
    )
    .unwrap();
    close(&out2, &whole, 1e-7, 1e-7, "merge with an empty part");
    assert!(matches!(
        merge(
            &[Partial {
                out: &a[1..],
                lse: &la
            }],
            d,
            &mut out,
            &mut lse
        ),
        Err(AttnError::BufferLength {
            arg: "parts.out",
            ..
        })
    ));
}

/// GQA grouping (8 query heads on 2 KV heads, K/V read once per group) equals the same
/// computation with K/V repeated per query head.
#[test]
fn gqa_grouping_equals_repeated_kv() {
    let mut rng = SmallRng::seed_from_u64(13);
    let (hq, hkv, lq, lk, d) = (8, 2, 1, 2000, 128);
    let q = randn(&mut rng, hq * lq * d);
    let k = randn(&mut rng, hkv * lk * d);
    let v = randn(&mut rng, hkv * lk * d);
    let rep = |x: &[f32]| -> Vec<f32> {
        (0..hq)
            .flat_map(|h| x[(h / (hq / hkv)) * lk * d..][..lk * d].to_vec())
            .collect()
    };
    let (k8, v8) = (rep(&k), rep(&v));
    for isa in Isa::available() {
        let mut grouped = vec![0.0; hq * lq * d];
        let mut plain = vec![0.0; hq * lq * d];
        let opts = SdpaOptions::new().isa(isa).kernel(Kernel::Decode);
        sdpa(
            &Tensor::bhld(&q, [1, hq, lq, d]),
            &Tensor::bhld(&k, [1, hkv, lk, d]),
            &Tensor::bhld(&v, [1, hkv, lk, d]),
            &mut TensorMut::bhld(&mut grouped, [1, hq, lq, d]),
            &opts,
        )
        .unwrap();
        sdpa(
            &Tensor::bhld(&q, [1, hq, lq, d]),
            &Tensor::bhld(&k8, [1, hq, lk, d]),
            &Tensor::bhld(&v8, [1, hq, lk, d]),
            &mut TensorMut::bhld(&mut plain, [1, hq, lq, d]),
            &opts,
        )
        .unwrap();
        close(&grouped, &plain, 1e-6, 1e-6, &format!("{isa}"));
    }
}

/// Decode results do not depend on the thread count (the split depends on the shape only).
#[test]
fn decode_is_bitwise_identical_across_thread_counts() {
    let mut rng = SmallRng::seed_from_u64(14);
    let (hq, hkv, lk, d) = (8, 2, 5000, 64);
    let q = randn(&mut rng, hq * d);
    let k = randn(&mut rng, hkv * lk * d);
    let v = randn(&mut rng, hkv * lk * d);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut out = vec![0.0; hq * d];
        pool.install(|| {
            sdpa(
                &Tensor::bhld(&q, [1, hq, 1, d]),
                &Tensor::bhld(&k, [1, hkv, lk, d]),
                &Tensor::bhld(&v, [1, hkv, lk, d]),
                &mut TensorMut::bhld(&mut out, [1, hq, 1, d]),
                &SdpaOptions::new().kernel(Kernel::Decode),
            )
            .unwrap()
        });
        out
    };
    let one = run(1);
    for t in [2, 3, 4] {
        assert!(
            one.iter()
                .zip(run(t))
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{t} threads differ"
        );
    }
}

#[test]
fn auto_path_follows_the_measured_crossover() {
    use attnkit::choose_kernel;
    let auto = SdpaOptions::new();
    // (Lq, Hq, Hkv, Lk) → the kernel Kernel::Auto must pick (BENCHMARKS.md, "Kernel choice").
    for (lq, hq, hkv, lk, want) in [
        (1, 32, 32, 4096, Kernel::Decode),
        (4, 8, 8, 16, Kernel::Decode),
        (8, 32, 32, 4096, Kernel::Decode),
        (8, 32, 8, 512, Kernel::Decode),
        (8, 32, 8, 64, Kernel::Prefill),
        (9, 32, 32, 4096, Kernel::Prefill),
        (16, 32, 8, 4096, Kernel::Prefill),
        (4, 32, 32, 2, Kernel::Prefill),
    ] {
        let got = choose_kernel([1, hq, lq, 128], [1, hkv, lk, 128], &auto);
        assert_eq!(got, want, "Lq {lq}, Hq {hq}, Hkv {hkv}, Lk {lk}");
    }
    let forced = SdpaOptions::new().kernel(Kernel::Prefill);
    assert_eq!(
        choose_kernel([1, 32, 1, 128], [1, 32, 4096, 128], &forced),
        Kernel::Prefill
    );
}

#[test]
fn window_needs_causal() {
    let x = vec![0.0f32; 4];
    let t = Tensor::bhld(&x, [1, 1, 1, 4]);
    let mut o = vec![0.0f32; 4];
    let err = sdpa(
        &t,
        &t,
        &t,
        &mut TensorMut::bhld(&mut o, [1, 1, 1, 4]),
        &SdpaOptions::new().window(3),
    )
    .unwrap_err();
    assert!(
        matches!(err, AttnError::BadParam { arg: "window", .. }),
        "{err}"
    );
}

/// Calls made from inside rayon tasks (nested parallelism) work and give the same results. A
/// thread waiting in one call's parallel loop may run another call meanwhile (work stealing), so
/// no per-thread buffer may stay borrowed across a parallel loop; whether a given run hits that
/// interleaving is up to rayon's scheduler, hence many calls, repeated.
#[test]
fn nested_calls_from_rayon_tasks() {
    use rayon::prelude::*;
    let mut rng = SmallRng::seed_from_u64(15);
    let (hq, hkv, lk, d) = (8, 2, 1200, 64); // above the parallel threshold
    let inputs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..48)
        .map(|_| {
            (
                randn(&mut rng, hq * d),
                randn(&mut rng, hkv * lk * d),
                randn(&mut rng, hkv * lk * d),
            )
        })
        .collect();
    let run = |(q, k, v): &(Vec<f32>, Vec<f32>, Vec<f32>), par: attnkit::Par| {
        let mut out = vec![0.0; hq * d];
        sdpa(
            &Tensor::bhld(q, [1, hq, 1, d]),
            &Tensor::bhld(k, [1, hkv, lk, d]),
            &Tensor::bhld(v, [1, hkv, lk, d]),
            &mut TensorMut::bhld(&mut out, [1, hq, 1, d]),
            &SdpaOptions::new().kernel(Kernel::Decode).par(par),
        )
        .unwrap();
        out
    };
    let want: Vec<Vec<f32>> = inputs.iter().map(|x| run(x, attnkit::Par::Seq)).collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for _ in 0..5 {
        let got: Vec<Vec<f32>> = pool.install(|| {
            inputs
                .par_iter()
                .map(|x| run(x, attnkit::Par::Rayon))
                .collect()
        });
        assert_eq!(got, want);
    }
}

/// The huge-page advice never changes contents, refuses buffers without a whole 2 MiB-aligned
/// interior, and a cache built on advised buffers still decodes correctly (covered above).
#[test]
fn huge_page_advice_keeps_contents() {
    let mut small = vec![1.5f32; 1000];
    assert!(!attnkit::advise_huge_pages(&mut small));
    assert!(small.iter().all(|&x| x == 1.5));
    let mut big: Vec<f32> = (0..(3 << 20)).map(|i| i as f32).collect(); // 12 MiB, touched
    let advised = attnkit::advise_huge_pages(&mut big);
    if cfg!(not(target_os = "linux")) {
        assert!(!advised);
    }
    assert!(big.iter().enumerate().all(|(i, &x)| x == i as f32));
}
