//! Regression tests for what fuzzing, Miri and debug builds found (issue #20): each test names
//! its finding. Shapes are tiny so that the whole file also runs under Miri (`.ci/run`), where
//! the undefined-behaviour findings are caught; allocation-failure tests are skipped there.
//! Without a release build's wrapping, the overflow findings panic in a debug build, which CI
//! runs too.

mod common;

use attnkit::kernels::{
    decode_partial, partial_len, softmax_row, DecodeArgs, DecodeRow, DecodeWalk, KvPages, ScoreSpec,
};
use attnkit::{
    sdpa, sdpa_ext, sdpa_vec, AdditiveAttention, AdditiveDims, AdditiveOptions, AdditiveWeights,
    AttnError, Causal, Extras, Kernel, KvCache, Linear, MaskRef, MhaConfig, MhaOptions,
    MultiheadAttention, Par, SdpaOptions, StateDict, Tensor, TensorMut, Tokens,
};
use common::{close, isas, reference, Dims, Problem, RefMask, ATOL, RTOL};

/// Small deterministic values in [-1, 1).
fn vals(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 101) % 23) as f32 / 11.5 - 1.0)
        .collect()
}

fn opts_for(isa: attnkit::Isa) -> SdpaOptions<'static> {
    SdpaOptions::new().isa(isa).par(Par::Seq)
}

/// `sdpa_ext` on dense BHLD inputs; returns the output.
fn call(
    dims: Dims,
    [q, k, v]: [&[f32]; 3],
    opts: &SdpaOptions,
    lse: Option<&mut [f32]>,
    weights: Option<&mut [f32]>,
) -> Vec<f32> {
    let mut out = vec![0.0f32; dims.out().iter().product()];
    sdpa_ext(
        &Tensor::bhld(q, dims.q()),
        &Tensor::bhld(k, dims.k()),
        &Tensor::bhld(v, dims.v()),
        &mut TensorMut::bhld(&mut out, dims.out()),
        opts,
        Extras { lse, weights },
    )
    .unwrap();
    out
}

/// Miri, Stacked and Tree Borrows: the row softmax used a raw pointer after re-borrowing the
/// row for its scalar tail.
#[test]
fn softmax_row_with_a_tail() {
    for isa in isas() {
        for n in [1, 7, 9, 17, 33] {
            let mut x = vec![0.5f32; n];
            softmax_row(isa, &mut x);
            for &p in &x {
                assert!(close(p, 1.0 / n as f64, 1e-7, 1e-6), "{isa} n={n}: {p}");
            }
        }
    }
}

/// Miri, Stacked Borrows: the causal fill of the prefill mask pass wrote a whole vector past
/// the end of a row's sub-slice, with causal plus a mask, a bias, weights or a window. It takes
/// a key hidden from more rows than a lane multiple but not from all: 13 rows, keys 9–12 of the
/// top-left diagonal.
#[test]
fn prefill_causal_with_mask_bias_weights_and_window() {
    let (lq, lk, d, dv) = (13, 15, 3, 5);
    let dims = Dims {
        b: 1,
        hq: 1,
        hkv: 1,
        lq,
        lk,
        d,
        dv,
    };
    let (q, k, v) = (vals(lq * d, 1), vals(lk * d, 2), vals(lk * dv, 3));
    let mask: Vec<bool> = (0..lq * lk).map(|i| i % 5 != 3).collect();
    let bias = vals(lq * lk, 4);
    let shape = [1, 1, lq, lk];
    for isa in isas() {
        for causal in [Causal::TopLeft, Causal::BottomRight] {
            for (window, masked, biased) in [
                (None, true, false),
                (None, false, true),
                (Some(4), false, false),
            ] {
                let mut opts = opts_for(isa).causal(causal).kernel(Kernel::Prefill);
                let mut ref_mask = RefMask::None;
                if masked {
                    opts = opts.bool_mask(MaskRef::new(&mask, shape));
                    ref_mask = RefMask::Bool(&mask, shape);
                }
                if biased {
                    opts = opts.bias(MaskRef::new(&bias, shape));
                    ref_mask = RefMask::Bias(&bias, shape);
                }
                if let Some(w) = window {
                    opts = opts.window(w);
                }
                let mut weights = vec![0.0f32; lq * lk];
                let out = call(dims, [&q, &k, &v], &opts, None, Some(&mut weights));
                let want = reference(&Problem {
                    dims,
                    q: &q,
                    k: &k,
                    v: &v,
                    scale: 1.0 / (d as f64).sqrt(),
                    causal: Some(causal),
                    window,
                    mask: ref_mask,
                    key_lengths: None,
                    alibi: None,
                    softcap: None,
                    sinks: None,
                });
                let what =
                    format!("{isa} {causal:?} window {window:?} mask {masked} bias {biased}");
                for (i, (&g, &w)) in out.iter().zip(&want.out).enumerate() {
                    assert!(close(g, w, ATOL, RTOL), "{what}: out[{i}] {g} vs {w}");
                }
                for (i, (&g, &w)) in weights.iter().zip(&want.w).enumerate() {
                    assert!(close(g, w, ATOL, RTOL), "{what}: weights[{i}] {g} vs {w}");
                }
            }
        }
    }
}

/// Silent wrong result: a window of 2^63 keys or more (`usize::MAX` meant as "unbounded")
/// wrapped negative and hid every key, on both kernels.
#[test]
fn huge_window_means_no_window() {
    let dims = Dims {
        b: 1,
        hq: 2,
        hkv: 1,
        lq: 3,
        lk: 6,
        d: 4,
        dv: 4,
    };
    let (q, k, v) = (vals(2 * 3 * 4, 5), vals(6 * 4, 6), vals(6 * 4, 7));
    for isa in isas() {
        for path in [Kernel::Prefill, Kernel::Decode] {
            for causal in [Causal::TopLeft, Causal::BottomRight] {
                let run = |window: Option<usize>| {
                    let mut opts = opts_for(isa).causal(causal).kernel(path);
                    if let Some(w) = window {
                        opts = opts.window(w);
                    }
                    let mut lse = vec![0.0f32; 6];
                    (call(dims, [&q, &k, &v], &opts, Some(&mut lse), None), lse)
                };
                let (want_out, want_lse) = run(None);
                for w in [6, 1 << 40, (1 << 63) - 1, 1 << 63, usize::MAX] {
                    // Not bitwise: Miri perturbs `log2` by an ulp or so on purpose.
                    let (out, lse) = run(Some(w));
                    for (g, &x) in out.iter().chain(&lse).zip(want_out.iter().chain(&want_lse)) {
                        assert!(
                            close(*g, x as f64, 1e-6, 1e-6),
                            "{isa} {path:?} {causal:?} window {w}"
                        );
                    }
                }
            }
        }
    }
}

/// Hang: the decode kernel's prefetch walk never advanced over empty rows (`D = 0`, or
/// `Dv = 0` with lse asked for). Called on the kernel with each walk forced.
#[test]
fn decode_kernel_with_empty_rows_returns() {
    let k = vals(64 * 4, 8);
    for isa in isas() {
        for walk in [DecodeWalk::Prefetch, DecodeWalk::Streams] {
            for (d, dv) in [(0, 4), (4, 0), (0, 0)] {
                let q = vals(4, 9);
                let rows = [DecodeRow {
                    q: q.as_ptr(),
                    spec: ScoreSpec::new(64),
                }];
                let args = DecodeArgs {
                    rows: &rows,
                    d,
                    dv,
                    k: k.as_ptr(),
                    ldk: d,
                    v: k.as_ptr(),
                    ldv: dv,
                    k_scale: std::ptr::null(),
                    v_scale: std::ptr::null(),
                    j_begin: 0,
                    j_end: 64,
                    scale: 0.5,
                    walk,
                    pages: KvPages::contiguous(),
                };
                let mut part = vec![f32::NAN; partial_len(dv)];
                let mut scratch = vec![0.0f32; attnkit::kernels::decode_scratch_len(d, dv)];
                // SAFETY: K and V hold 64 rows of `d`/`dv` values (`k` has 256 floats); `q` has
                // `d ≤ 4` values; the partial row has `dv + 2` floats; the ISA is supported.
                unsafe { decode_partial(isa, &args, part.as_mut_ptr(), 0, &mut scratch) };
                assert!(
                    part.iter().all(|x| x.is_finite()),
                    "{isa} {walk:?} d={d} dv={dv}"
                );
            }
        }
    }
}

/// Hang: with `D = Dv = 0` and lse asked for, prefill walked every key of an `Lk` that no
/// memory backs (1.8 s at 2^28; here 2^40). The answer is ln(visible keys), or −inf.
#[test]
fn empty_rows_with_huge_key_count_return_at_once() {
    let lk = 1usize << 40;
    for path in [Kernel::Prefill, Kernel::Decode] {
        for causal in [
            None,
            Some(Causal::TopLeft),
            Some(Causal::BottomRight),
            Some(Causal::BottomRightAtLk),
        ] {
            let mut opts = SdpaOptions::new().kernel(path);
            if let Some(c) = causal {
                opts = opts.causal(c);
            }
            let mut lse = vec![0.0f32; 2];
            sdpa_ext(
                &Tensor::bhld(&[0.0f32; 0], [1, 1, 2, 0]),
                &Tensor::bhld(&[0.0f32; 0], [1, 1, lk, 0]),
                &Tensor::bhld(&[0.0f32; 0], [1, 1, lk, 0]),
                &mut TensorMut::bhld(&mut [0.0f32; 0], [1, 1, 2, 0]),
                &opts,
                Extras {
                    lse: Some(&mut lse),
                    weights: None,
                },
            )
            .unwrap();
            let visible = |i: usize| match causal {
                None => lk,
                Some(Causal::TopLeft) => i + 1,
                Some(Causal::BottomRight | Causal::BottomRightAtLk) => lk - 1 + i,
            };
            for (i, &got) in lse.iter().enumerate() {
                let want = (visible(i) as f64).ln() as f32;
                assert_eq!(got, want, "{path:?} {causal:?} row {i}");
            }
        }
    }
}

/// Hang (found by the fuzzer after #20's fixes): with `D = Dv = 0`, `Lk = 0` and weights asked
/// for, every buffer is empty, so nothing bounds `B·Hq·Lq`, and prefill ran that many empty
/// rows. There is nothing to write: the call returns at once.
#[test]
fn empty_weights_with_huge_row_count_return_at_once() {
    let lq = 1usize << 40;
    for path in [Kernel::Auto, Kernel::Prefill, Kernel::Decode] {
        let opts = SdpaOptions::new().kernel(path);
        sdpa_ext(
            &Tensor::bhld(&[0.0f32; 0], [1, 2, lq, 0]),
            &Tensor::bhld(&[0.0f32; 0], [1, 1, 0, 0]),
            &Tensor::bhld(&[0.0f32; 0], [1, 1, 0, 0]),
            &mut TensorMut::bhld(&mut [0.0f32; 0], [1, 2, lq, 0]),
            &opts,
            Extras {
                lse: None,
                weights: Some(&mut []),
            },
        )
        .unwrap();
    }
}

/// Hang and wrap: `append` of a huge token count with empty rows looped that many times, and
/// `len + t` could wrap past the capacity check.
#[test]
fn kv_cache_append_of_empty_rows_is_bounded() {
    let cap = 1usize << 62;
    let mut cache = KvCache::new(1, 1, cap, 0, 0).unwrap();
    let t = 1usize << 61;
    let e = Tensor::bhld(&[0.0f32; 0], [1, 1, t, 0]);
    cache.append(&e, &e).unwrap();
    assert_eq!(cache.lens(), [t]);
    let big = Tensor::bhld(&[0.0f32; 0], [1, 1, usize::MAX - 1, 0]);
    assert!(matches!(
        cache.append(&big, &big),
        Err(AttnError::Capacity { batch: 0, .. })
    ));
    assert_eq!(cache.lens(), [t], "a refused append changes nothing");
}

/// Release-build panic: appending a strided empty K view (`D = 0`, strides pointing past the
/// empty buffer) indexed the buffer anyway.
#[test]
fn kv_cache_append_of_strided_empty_keys() {
    let mut cache = KvCache::new(1, 1, 4, 0, 1).unwrap();
    let k = Tensor::strided(&[], [1, 1, 2, 0], [0, 0, 8]);
    let v = [1.0f32, 2.0];
    cache.append(&k, &Tensor::bhld(&v, [1, 1, 2, 1])).unwrap();
    assert_eq!(cache.lens(), [2]);
    let mut out = [0.0f32];
    cache
        .attend(
            &Tensor::bhld(&[0.0f32; 0], [1, 1, 1, 0]),
            &mut TensorMut::bhld(&mut out, [1, 1, 1, 1]),
            &SdpaOptions::new(),
        )
        .unwrap();
    assert_eq!(out, [1.5], "D = 0: the mean of the values");
}

/// Allocation before validation: sizes no machine can back are an error, not an abort.
#[test]
#[cfg_attr(miri, ignore = "huge allocations")]
fn kv_cache_sizes_that_cannot_be_allocated() {
    // 2^40 tokens × 8 heads × 128 floats: 4 PiB each for K and V.
    let e = KvCache::new(1, 8, 1 << 40, 128, 128).unwrap_err();
    assert!(
        matches!(
            e,
            AttnError::Alloc {
                arg: "capacity",
                ..
            }
        ),
        "{e}"
    );
    // 2^46 sequences: their lengths alone are 512 TiB.
    let e = KvCache::new(1 << 46, 1, 1, 0, 0).unwrap_err();
    assert!(matches!(e, AttnError::Alloc { arg: "B", .. }), "{e}");
    // Sizes whose products overflow, including those a zero dimension hides.
    for dims in [
        [1, 1 << 32, 1 << 32, 1, 1],
        [0, 1 << 40, 1 << 40, 1 << 40, 1],
        [1, 1, usize::MAX, 0, 0],
    ] {
        let [b, h, c, d, dv] = dims;
        assert!(
            matches!(
                KvCache::new(b, h, c, d, dv),
                Err(AttnError::Overflow { .. })
            ),
            "{dims:?}"
        );
    }
}

/// Debug-build overflow: `keys()` of a cache with B = 0 multiplied the other sizes unchecked.
#[test]
fn kv_cache_with_no_sequences() {
    let cache = KvCache::new(0, 4, 8, 16, 16).unwrap();
    assert_eq!(cache.keys().shape(), [0, 4, 0, 16]);
    let mut out: [f32; 0] = [];
    cache
        .attend(
            &Tensor::bhld(&[0.0f32; 0], [0, 4, 1, 16]),
            &mut TensorMut::bhld(&mut out, [0, 4, 1, 16]),
            &SdpaOptions::new(),
        )
        .unwrap();
}

/// int8 caches under Miri and ASan: the scale pointers of both kernels stay inside the scale
/// buffers (ragged lengths, a truncated sequence, odd widths, GQA), and decode equals prefill
/// within f32 rounding.
#[test]
fn int8_cache_attends_through_both_kernels() {
    let (b, hq, hkv, cap, d, dv) = (2, 4, 2, 11, 5, 3);
    let mut cache = KvCache::<i8>::new_of(b, hkv, cap, d, dv).unwrap();
    for (t, seed) in [(3, 1), (6, 2)] {
        let (k, v) = (
            vals(b * hkv * t * d, seed),
            vals(b * hkv * t * dv, seed + 7),
        );
        cache
            .append(
                &Tensor::bhld(&k, [b, hkv, t, d]),
                &Tensor::bhld(&v, [b, hkv, t, dv]),
            )
            .unwrap();
    }
    cache.truncate(1, 4).unwrap();
    let lq = 2;
    let q = vals(b * hq * lq * d, 5);
    for isa in attnkit::Isa::available() {
        let mut outs = Vec::new();
        for kernel in [Kernel::Decode, Kernel::Prefill] {
            let mut out = vec![f32::NAN; b * hq * lq * dv];
            cache
                .attend(
                    &Tensor::bhld(&q, [b, hq, lq, d]),
                    &mut TensorMut::bhld(&mut out, [b, hq, lq, dv]),
                    &opts_for(isa).kernel(kernel),
                )
                .unwrap();
            outs.push(out);
        }
        for (x, y) in outs[0].iter().zip(&outs[1]) {
            assert!((x - y).abs() <= 1e-5, "{isa}: decode {x} vs prefill {y}");
        }
    }
}

/// Allocation before validation: `sdpa_vec` allocated `B·Hq·Lq·Dv` before looking at the
/// inputs.
#[test]
#[cfg_attr(miri, ignore = "huge allocations")]
fn sdpa_vec_validates_then_allocates_fallibly() {
    let v = vec![0.0f32; 1 << 10];
    // 2^40 queries (D = 0, so Q needs no memory) × Dv = 2^10: a 4 PiB output.
    let (q, k) = (
        Tensor::bhld(&[0.0f32; 0], [1, 1, 1 << 40, 0]),
        Tensor::bhld(&[0.0f32; 0], [1, 1, 1, 0]),
    );
    let e = sdpa_vec(
        &q,
        &k,
        &Tensor::bhld(&v, [1, 1, 1, 1 << 10]),
        &SdpaOptions::new(),
    );
    assert!(
        matches!(e, Err(AttnError::Alloc { arg: "out", .. })),
        "{e:?}"
    );
    // A bad argument is reported as such, before any allocation.
    let e = sdpa_vec(
        &q,
        &k,
        &Tensor::bhld(&v, [1, 1, 2, 1 << 9]),
        &SdpaOptions::new(),
    );
    assert!(
        matches!(
            e,
            Err(AttnError::ShapeMismatch {
                arg: "v",
                dim: "Lk",
                ..
            })
        ),
        "{e:?}"
    );
}

/// Debug-build overflows in the planning of calls with zero-sized dimensions: `D + Dv` with
/// no heads, and a mask's strides with a zero-sized batch.
#[test]
fn zero_sized_dimensions_with_huge_others() {
    let e: [f32; 0] = [];
    let opts = SdpaOptions::new();
    // No heads, D = Dv = usize::MAX.
    let s = [1, 0, 1, usize::MAX];
    sdpa(
        &Tensor::bhld(&e, s),
        &Tensor::bhld(&e, s),
        &Tensor::bhld(&e, s),
        &mut TensorMut::bhld(&mut [0.0f32; 0], s),
        &opts,
    )
    .unwrap();
    // B = 0, and a full-size mask whose other dimensions multiply past usize.
    let (h, l) = (1 << 10, 1 << 31);
    let mask = MaskRef::<bool>::new(&[], [0, h, l, l]);
    let (qs, ks) = ([0, h, l, 0], [0, h, l, 0]);
    sdpa(
        &Tensor::bhld(&e, qs),
        &Tensor::bhld(&e, ks),
        &Tensor::bhld(&e, ks),
        &mut TensorMut::bhld(&mut [0.0f32; 0], qs),
        &SdpaOptions::new().bool_mask(mask),
    )
    .unwrap();
    // Lk past isize::MAX cannot be indexed: an overflow error, not wrapped offsets.
    let r = sdpa(
        &Tensor::bhld(&e, [1, 1, 1, 0]),
        &Tensor::bhld(&e, [1, 1, usize::MAX, 0]),
        &Tensor::bhld(&e, [1, 1, usize::MAX, 0]),
        &mut TensorMut::bhld(&mut [0.0f32; 0], [1, 1, 1, 0]),
        &SdpaOptions::new().causal(Causal::BottomRight),
    );
    assert!(matches!(r, Err(AttnError::Overflow { .. })), "{r:?}");
}

/// Fuzzing (`sdpa`, 2026-12-06): a view with a zero-sized dimension addresses no element, so
/// validation accepts any strides on its other dimensions; the kernels still offset their base
/// pointers by `b·s₀ + h·s₁`, which overflowed (a debug-build panic; in release a wrapped
/// offset, `ptr.add` out of bounds). Here K and V have no keys and strides near `usize::MAX`.
#[test]
fn empty_views_with_huge_strides() {
    let (b, h, d, dv) = (3, 2, 5, 3);
    let q = vals(b * h * d, 1);
    let huge = [usize::MAX / 3, usize::MAX, usize::MAX / 2 + 7];
    let e: [f32; 0] = [];
    for isa in isas() {
        for path in [Kernel::Prefill, Kernel::Decode] {
            let mut out = vec![f32::NAN; b * h * dv];
            let mut lse = vec![0.0f32; b * h];
            sdpa_ext(
                &Tensor::bhld(&q, [b, h, 1, d]),
                &Tensor::strided(&e, [b, h, 0, d], huge),
                &Tensor::strided(&e, [b, h, 0, dv], huge),
                &mut TensorMut::bhld(&mut out, [b, h, 1, dv]),
                &opts_for(isa).kernel(path),
                Extras {
                    lse: Some(&mut lse),
                    weights: None,
                },
            )
            .unwrap();
            // No key: a fully masked row, zero output and lse −inf.
            assert!(out.iter().all(|&x| x == 0.0), "{isa} {path:?}");
            assert!(
                lse.iter().all(|&x| x == f32::NEG_INFINITY),
                "{isa} {path:?}"
            );
            // The same with an empty query view of huge strides and an empty output.
            sdpa(
                &Tensor::strided(&e, [b, h, 0, d], huge),
                &Tensor::bhld(&q, [b, h, 1, d]),
                &Tensor::bhld(&q[..b * h * dv], [b, h, 1, dv]),
                &mut TensorMut::strided(&mut [0.0f32; 0], [b, h, 0, dv], huge),
                &opts_for(isa).kernel(path),
            )
            .unwrap();
        }
    }
}

/// Found beside the previous one: the layers addressed `Tokens` with a zero-sized dimension
/// (here the feature width) through strides validation cannot bound. `Linear` overflowed
/// `b·s₀` (a debug-build panic, a wrapped pointer in release), and the dense copy the training
/// paths keep indexed past the buffer (a release-build panic).
#[test]
fn empty_token_views_with_huge_strides() {
    let huge = [usize::MAX / 2, usize::MAX / 3];
    let empty = Tokens::strided(&[], [2, 5, 0], huge);
    // Linear from no features: the bias in every row.
    let lin = |o: usize, i: usize| Linear::new(vals(o * i, 3), Some(vals(o, 4)), o, i).unwrap();
    let y = lin(4, 0).forward(&empty, Par::Seq).unwrap();
    assert_eq!(y, vals(4, 4).repeat(10));
    // Single-head self-attention over empty-width tokens: forward and training forward agree.
    let sa = attnkit::SelfAttention::new(lin(4, 0), lin(4, 0), lin(3, 0)).unwrap();
    let y = sa.forward(&empty, &MhaOptions::new()).unwrap().out;
    let (t, _) = sa.forward_train(&empty, &MhaOptions::new()).unwrap();
    assert_eq!(y.len(), 2 * 5 * 3);
    assert_eq!(t.out, y);
    assert!(y.iter().all(|x| x.is_finite()));
    // Additive attention with keys, then values, of width 0.
    let add = |key_dim: usize| {
        AdditiveAttention::new(&AdditiveWeights {
            dims: AdditiveDims {
                attn_dim: 2,
                query_dim: 4,
                key_dim,
            },
            w_q: &vals(8, 5),
            w_k: &vals(2 * key_dim, 6),
            bias: None,
            v: &[1.0; 2],
        })
        .unwrap()
    };
    let q = vals(8, 7);
    let q = Tokens::ble(&q, [2, 1, 4]);
    let (kv4, kv2) = (vals(40, 8), vals(20, 9));
    let opts = AdditiveOptions::new();
    let out = add(0)
        .forward(&q, &empty, &Tokens::ble(&kv2, [2, 5, 2]), &opts)
        .unwrap();
    assert!(out.out.iter().all(|x| x.is_finite()));
    let keys = Tokens::ble(&kv4, [2, 5, 4]);
    let out = add(4).forward(&q, &keys, &empty, &opts).unwrap();
    assert!(out.out.is_empty());
    let (train, _) = add(4).forward_train(&q, &keys, &empty, &opts).unwrap();
    assert_eq!(train.out, out.out);
}

/// Debug-build overflow: `Tokens` constructors (documented never to fail) multiplied their
/// sizes unchecked; an impossible view now fails when a layer validates it.
#[test]
fn tokens_with_huge_or_zero_sizes() {
    let x = [0.0f32; 8];
    let views = [
        Tokens::ble(&x, [1, 1 << 40, 1 << 40]),
        Tokens::lbe(&x, [1 << 40, 1 << 40, 8]),
        Tokens::ble(&x, [0, usize::MAX, usize::MAX]),
        Tokens::lbe(&x, [usize::MAX, 0, usize::MAX]),
        Tokens::ble(&x, [0, usize::MAX, 8]),
        Tokens::lbe(&x, [0, usize::MAX, 8]),
    ];
    let lin = Linear::new(vec![0.0; 8], None, 1, 8).unwrap();
    for t in &views {
        // Either refused (buffer too short / overflow) or empty (a zero dimension).
        if let Ok(y) = lin.forward(t, Par::Seq) {
            assert!(y.is_empty());
        }
    }
}

/// Allocation before validation: the layers allocated their outputs before validating the
/// query, so a huge query shape over a tiny buffer aborted instead of failing.
#[test]
fn layers_validate_before_allocating() {
    let x = [0.0f32; 8];
    let huge = Tokens::ble(&x, [1 << 40, 1 << 20, 8]);
    let small = Tokens::ble(&x, [1, 1, 8]);
    let mut sd = StateDict::new();
    sd.insert("in_proj_weight", &[24, 8], &[0.0; 192]).unwrap();
    sd.insert("in_proj_bias", &[24], &[0.0; 24]).unwrap();
    sd.insert("out_proj.weight", &[8, 8], &[0.0; 64]).unwrap();
    sd.insert("out_proj.bias", &[8], &[0.0; 8]).unwrap();
    let mha = MultiheadAttention::from_state_dict(MhaConfig::new(8, 2), &sd, "").unwrap();
    let e = mha
        .forward(&huge, &small, &small, &MhaOptions::new())
        .unwrap_err();
    assert!(
        matches!(e, AttnError::BufferLength { arg: "query", .. }),
        "{e}"
    );
    let add = AdditiveAttention::new(&AdditiveWeights {
        dims: AdditiveDims {
            attn_dim: 2,
            query_dim: 8,
            key_dim: 8,
        },
        w_q: &[0.0; 16],
        w_k: &[0.0; 16],
        bias: None,
        v: &[1.0; 2],
    })
    .unwrap();
    let e = add
        .forward(&huge, &small, &small, &AdditiveOptions::new())
        .unwrap_err();
    assert!(
        matches!(e, AttnError::BufferLength { arg: "queries", .. }),
        "{e}"
    );
    // The layers still work on the small input.
    assert_eq!(
        mha.forward(&small, &small, &small, &MhaOptions::new())
            .unwrap()
            .out
            .len(),
        8
    );
}

/// Debug-build overflow: `MhaConfig::new(1 << 63, 1)` formed `3·E` unchecked.
#[test]
fn mha_config_too_large_to_hold() {
    for (e, h) in [(1usize << 63, 1), (usize::MAX, 1), (1 << 40, 1 << 20)] {
        let r = MultiheadAttention::from_state_dict(MhaConfig::new(e, h), &StateDict::new(), "");
        assert!(
            matches!(
                r,
                Err(AttnError::Config {
                    arg: "embed_dim",
                    ..
                })
            ),
            "{e}: {r:?}"
        );
    }
}

/// A `[huge, 0]` weight holds no values, so a 300-byte checkpoint can declare any width: the
/// layers then refuse (overflow) or fail to allocate, never abort or overflow.
#[test]
#[cfg(feature = "safetensors")]
#[cfg_attr(miri, ignore = "huge allocations")]
fn checkpoints_with_huge_empty_weights() {
    let file = |rows: [usize; 3], bias: bool| {
        let mut sd = StateDict::new();
        for (name, r) in ["query", "key", "value"].into_iter().zip(rows) {
            sd.insert(format!("{name}.weight"), &[r, 0], &[]).unwrap();
        }
        if bias {
            sd.insert("value.bias", &[rows[2]], &vec![0.0; rows[2]])
                .unwrap();
        }
        let bytes = sd.to_safetensors().unwrap();
        assert!(bytes.len() < 400);
        StateDict::from_safetensors(&bytes).unwrap()
    };
    // The packed bias would be 2^47 + 1 floats.
    let e = attnkit::SelfAttention::from_state_dict(&file([1 << 46, 1 << 46, 1], true), "")
        .unwrap_err();
    assert!(matches!(e, AttnError::Alloc { .. }), "{e}");
    // Widths whose sum overflows.
    let e = attnkit::SelfAttention::from_state_dict(&file([1 << 63, 1 << 63, 1], false), "")
        .unwrap_err();
    assert!(matches!(e, AttnError::Overflow { .. }), "{e}");
    // Loads (no bias to pack), but its projection cannot be allocated.
    let layer =
        attnkit::SelfAttention::from_state_dict(&file([1 << 46, 1 << 46, 1], false), "").unwrap();
    let x = Tokens::ble(&[], [1, 1, 0]);
    let e = layer.forward(&x, &MhaOptions::new()).unwrap_err();
    assert!(matches!(e, AttnError::Alloc { .. }), "{e}");
    // `Linear` with out_features 2^46 and in_features 0.
    let lin = Linear::new(vec![], None, 1 << 46, 0).unwrap();
    let e = lin.forward(&x, Par::Seq).unwrap_err();
    assert!(matches!(e, AttnError::Alloc { arg: "y", .. }), "{e}");
}

/// Miri: the layers passed their buffers to rayon tasks as `usize` addresses, which drops the
/// pointers' provenance. A small forward of each layer, checked against plain arithmetic.
#[test]
fn layers_small_forward() {
    // Linear: y = x·Wᵀ + b.
    let w = vals(3 * 4, 10);
    let b = vals(3, 11);
    let x = vals(2 * 4, 12);
    let lin = Linear::new(w.clone(), Some(b.clone()), 3, 4).unwrap();
    let y = lin
        .forward(&Tokens::ble(&x, [1, 2, 4]), Par::Rayon)
        .unwrap();
    for t in 0..2 {
        for o in 0..3 {
            let want: f64 = b[o] as f64
                + (0..4)
                    .map(|i| (x[t * 4 + i] * w[o * 4 + i]) as f64)
                    .sum::<f64>();
            assert!(close(y[t * 3 + o], want, 1e-6, 1e-6));
        }
    }
    // Additive attention with a mask and key lengths: the weights sum to one per row.
    let (a, dq, dk, dv, lq, lk) = (4, 3, 5, 2, 2, 3);
    let layer = AdditiveAttention::new(&AdditiveWeights {
        dims: AdditiveDims {
            attn_dim: a,
            query_dim: dq,
            key_dim: dk,
        },
        w_q: &vals(a * dq, 13),
        w_k: &vals(a * dk, 14),
        bias: Some(&vals(a, 15)),
        v: &vals(a, 16),
    })
    .unwrap();
    let (q, k, v) = (vals(lq * dq, 17), vals(lk * dk, 18), vals(lk * dv, 19));
    let mask = [true, false, true, true, true, false];
    let lens = [3];
    let opts = AdditiveOptions::new()
        .outputs(true, false)
        .mask(attnkit::AttnMask::Bool(MaskRef::new(&mask, [1, 1, lq, lk])))
        .key_lengths(&lens)
        .par(Par::Rayon);
    let r = layer
        .forward(
            &Tokens::ble(&q, [1, lq, dq]),
            &Tokens::ble(&k, [1, lk, dk]),
            &Tokens::ble(&v, [1, lk, dv]),
            &opts,
        )
        .unwrap();
    let w = r.weights.unwrap();
    for i in 0..lq {
        let row = &w[i * lk..(i + 1) * lk];
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        for j in 0..lk {
            assert_eq!(row[j] == 0.0, !mask[i * lk + j]);
        }
    }
}

/// The f64 reference output of one decode step, `(B, Hq, Hkv, Lk, D, Dv)`, for `[q, k, v]`
/// (BHLD, one query row) with bottom-right causal alignment (which, with one query, only clips
/// to each sequence's `key_lengths`).
fn decode_reference(
    (b, hq, hkv, lk, d, dv): (usize, usize, usize, usize, usize, usize),
    [q, k, v]: [&[f32]; 3],
    key_lengths: Option<&[usize]>,
) -> Vec<f64> {
    let dims = Dims {
        b,
        hq,
        hkv,
        lq: 1,
        lk,
        d,
        dv,
    };
    reference(&Problem {
        dims,
        q,
        k,
        v,
        scale: 1.0 / (d as f64).sqrt(),
        causal: Some(Causal::BottomRight),
        window: None,
        mask: RefMask::None,
        key_lengths,
        alibi: None,
        softcap: None,
        sinks: None,
    })
    .out
}

/// Miri: the CPU-vendor check behind the decode walk runs CPUID, which Miri cannot; and the
/// decode path end to end (GQA group, split chunks merged) on a KV cache.
#[test]
fn kv_cache_decode_matches_reference() {
    let (b, hq, hkv, d) = (2, 4, 2, 5);
    let mut cache = KvCache::new(b, hkv, 8, d, d).unwrap();
    let (k, v) = (vals(b * hkv * 3 * d, 20), vals(b * hkv * 3 * d, 21));
    let kv = |x| Tensor::bhld(x, [b, hkv, 3, d]);
    cache.append(&kv(&k), &kv(&v)).unwrap();
    cache.truncate(1, 2).unwrap();
    let q = vals(b * hq * d, 22);
    for isa in isas() {
        let mut out = vec![0.0f32; b * hq * d];
        cache
            .attend(
                &Tensor::bhld(&q, [b, hq, 1, d]),
                &mut TensorMut::bhld(&mut out, [b, hq, 1, d]),
                &opts_for(isa).kernel(Kernel::Decode),
            )
            .unwrap();
        let dims = (b, hq, hkv, 3, d, d);
        let want = decode_reference(dims, [&q, &k, &v], Some(&[3, 2]));
        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
            assert!(close(g, w, ATOL, RTOL), "{isa} out[{i}] {g} vs {w}");
        }
    }
}

/// Miri: the decode kernel's bf16 pair loads (32 bytes of K or V at a time on AVX2), with a
/// head dimension that leaves a single chunk and a scalar tail after the pairs (D = 40, Dv = 37)
/// and keys over two blocks, against the reference on the stored (rounded) values.
#[test]
fn bf16_cache_decode_reads_pairs_in_bounds() {
    use attnkit::bf16;
    let (b, hq, hkv, lk, d, dv) = (1, 4, 1, 35, 40, 37);
    let mut cache = KvCache::<bf16>::new_of(b, hkv, lk, d, dv).unwrap();
    let round =
        |x: Vec<f32>| -> Vec<f32> { x.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect() };
    let (k, v) = (round(vals(lk * d, 30)), round(vals(lk * dv, 31)));
    cache
        .append(
            &Tensor::bhld(&k, [b, hkv, lk, d]),
            &Tensor::bhld(&v, [b, hkv, lk, dv]),
        )
        .unwrap();
    let q = vals(hq * d, 32);
    for isa in isas() {
        let mut out = vec![0.0f32; hq * dv];
        cache
            .attend(
                &Tensor::bhld(&q, [b, hq, 1, d]),
                &mut TensorMut::bhld(&mut out, [b, hq, 1, dv]),
                &opts_for(isa).kernel(Kernel::Decode),
            )
            .unwrap();
        let want = decode_reference((b, hq, hkv, lk, d, dv), [&q, &k, &v], None);
        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
            assert!(close(g, w, ATOL, RTOL), "{isa} out[{i}] {g} vs {w}");
        }
    }
}

/// Both kernels' page walks (decode: rows addressed per page run, `P·V` split at page ends;
/// prefill: key blocks gathered across pages), on small shapes for Miri: a paged cache equals
/// the contiguous one bit for bit, in f32 and in int8 (whose scales are paged too).
#[test]
fn paged_cache_reads_through_its_page_table() {
    paged_equals_contiguous::<f32>();
    paged_equals_contiguous::<i8>();
}

fn paged_equals_contiguous<E: attnkit::Operand>() {
    use attnkit::PagedKvCache;
    let (hkv, hq, d, len, lq) = (1, 2, 5, 7, 3);
    let k: Vec<f32> = (0..hkv * len * d)
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    let v: Vec<f32> = (0..hkv * len * d)
        .map(|i| (i as f32 * 0.11).cos())
        .collect();
    let q: Vec<f32> = (0..hq * lq * d).map(|i| (i as f32 * 0.23).sin()).collect();
    let shape = [1, hkv, len, d];
    let mut flat = KvCache::<E>::new_of(1, hkv, len, d, d).unwrap();
    flat.append(&Tensor::bhld(&k, shape), &Tensor::bhld(&v, shape))
        .unwrap();
    let mut paged = PagedKvCache::<E>::new_of(hkv, d, d, 2, 6).unwrap();
    paged.shuffle_free_pages(&[3, 0, 5, 1, 4, 2]).unwrap();
    let s = paged.add_sequence();
    paged
        .append(&[s], &Tensor::bhld(&k, shape), &Tensor::bhld(&v, shape))
        .unwrap();
    let out = [1, hq, lq, d];
    for isa in isas() {
        for kernel in [Kernel::Decode, Kernel::Prefill] {
            let opts = SdpaOptions::new().isa(isa).kernel(kernel);
            let (mut want, mut got) = (vec![0.0f32; hq * lq * d], vec![0.0f32; hq * lq * d]);
            let qt = Tensor::bhld(&q, [1, hq, lq, d]);
            flat.attend(&qt, &mut TensorMut::bhld(&mut want, out), &opts)
                .unwrap();
            paged
                .attend(&[s], &qt, &mut TensorMut::bhld(&mut got, out), &opts)
                .unwrap();
            assert_eq!(got, want, "{isa} {kernel:?}");
        }
    }
}

/// The backward pass (#17) at Miri's scale: unsafe tile code over strided views, GQA, a causal
/// window, a bool mask and key lengths (one batch fully padded). Checked by two identities of
/// softmax attention that hold for any inputs: each row's weights sum to one, so
/// `Σ_j dV_j = Σ_i dO_i` over the rows with a visible key, and each row's `dS` sums to zero, so
/// `Σ_j dK_j = 0` — per batch and KV head.
#[test]
fn backward_identities_at_small_sizes() {
    use attnkit::{sdpa_backward_vec, sdpa_ext_vec, Returns, Saved};
    let (b, hq, hkv, lq, lk, d, dv) = (2, 4, 2, 5, 7, 3, 2);
    let (q, k, v) = (
        vals(b * hq * lq * d, 1),
        vals(b * hkv * lk * d, 2),
        vals(b * hkv * lk * dv, 3),
    );
    let dout = vals(b * hq * lq * dv, 4);
    let mask: Vec<bool> = (0..lq * lk).map(|x| x % 5 != 3).collect();
    let lens = [7usize, 0];
    let opts = SdpaOptions::new()
        .causal(Causal::BottomRight)
        .window(4)
        .key_lengths(&lens)
        .bool_mask(MaskRef::new(&mask, [1, 1, lq, lk]))
        .par(Par::Seq);
    let (qt, kt, vt) = (
        Tensor::bhld(&q, [b, hq, lq, d]),
        Tensor::bhld(&k, [b, hkv, lk, d]),
        Tensor::bhld(&v, [b, hkv, lk, dv]),
    );
    let want = Returns {
        lse: true,
        weights: false,
    };
    let fwd = sdpa_ext_vec(&qt, &kt, &vt, &opts, want).unwrap();
    let lse = fwd.lse.unwrap();
    let saved = Saved {
        q: qt,
        k: kt,
        v: vt,
        out: Tensor::bhld(&fwd.out, [b, hq, lq, dv]),
        lse: &lse,
    };
    let g = sdpa_backward_vec(&saved, &Tensor::bhld(&dout, [b, hq, lq, dv]), &opts).unwrap();
    let group = hq / hkv;
    for bi in 0..b {
        for hk in 0..hkv {
            for c in 0..dv {
                let got: f32 = (0..lk)
                    .map(|j| g.dv[((bi * hkv + hk) * lk + j) * dv + c])
                    .sum();
                let want: f32 = (hk * group..(hk + 1) * group)
                    .flat_map(|h| (0..lq).map(move |i| (h, i)))
                    .filter(|&(h, i)| lse[(bi * hq + h) * lq + i] != f32::NEG_INFINITY)
                    .map(|(h, i)| dout[((bi * hq + h) * lq + i) * dv + c])
                    .sum();
                assert!(
                    (got - want).abs() < 1e-5,
                    "dV sum b{bi} h{hk}: {got} vs {want}"
                );
            }
            for c in 0..d {
                let s: f32 = (0..lk)
                    .map(|j| g.dk[((bi * hkv + hk) * lk + j) * d + c])
                    .sum();
                assert!(s.abs() < 1e-5, "dK sum b{bi} h{hk}: {s}");
            }
        }
    }
    // The fully padded batch has no gradient at all.
    let half = g.dq.len() / 2;
    assert!(g.dq[half..].iter().all(|&x| x == 0.0));
    assert!(g.dq[..half].iter().any(|&x| x != 0.0));
}
