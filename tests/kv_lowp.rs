//! `KvCache` stored in bf16 and f16. Appending rounds to the storage type (exactly once, and
//! not at all for keys and values already of that type); attending widens exactly, so a 16-bit
//! cache must give *bitwise* what an f32 cache holding the same (rounded) values gives for the
//! widened queries, on every ISA and kernel, with ragged lengths, GQA and a window — except
//! where the decode kernel reads bf16 as pairs and so sums in another order (then within
//! rounding; see `common::same_values`). A refused append changes nothing.

mod common;

use attnkit::kernels::flash_path;
use attnkit::{
    bf16, f16, AttnError, Elem, Kernel, KvCache, Operand, SdpaOptions, Tensor, TensorMut,
};
use common::{decode_reorders, isas, randn, same_values};
use rand::rngs::SmallRng;
use rand::SeedableRng;

/// `(B, Hq, Hkv, D, Dv, capacity)`: one element; GQA with odd sizes; a decode-sized head.
const SHAPES: [[usize; 6]; 3] = [
    [1, 1, 1, 1, 1, 4],
    [2, 6, 2, 5, 7, 40],
    [1, 8, 2, 128, 64, 700],
];

fn widen<E: Elem>(x: &[E]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// Fills a cache of `E` and an f32 cache with the same tokens: appended in f32 to the first
/// (rounded there) and the rounded values to the second, in three appends, then sequence 1
/// (if any) truncated so the lengths differ. Checks the stored values, then returns both.
fn filled<E: Operand + Elem>(rng: &mut SmallRng, s: [usize; 6]) -> (KvCache<E>, KvCache) {
    let [b, _, hkv, d, dv, cap] = s;
    let mut lowp = KvCache::<E>::new_of(b, hkv, cap, d, dv).unwrap();
    let mut f32c = KvCache::new(b, hkv, cap, d, dv).unwrap();
    assert_eq!(lowp.dtype(), E::DTYPE);
    for t in [1, cap / 2, cap - cap / 2 - 1] {
        let k = randn(rng, b * hkv * t * d, 1.0);
        let v = randn(rng, b * hkv * t * dv, 1.0);
        let (kt, vt) = (
            Tensor::bhld(&k, [b, hkv, t, d]),
            Tensor::bhld(&v, [b, hkv, t, dv]),
        );
        lowp.append(&kt, &vt).unwrap();
        let round =
            |x: &[f32]| -> Vec<f32> { x.iter().map(|&x| E::from_f32(x).to_f32()).collect() };
        let (kr, vr) = (round(&k), round(&v));
        f32c.append(
            &Tensor::bhld(&kr, [b, hkv, t, d]),
            &Tensor::bhld(&vr, [b, hkv, t, dv]),
        )
        .unwrap();
    }
    if b > 1 {
        let l = lowp.lens()[1] * 2 / 3;
        lowp.truncate(1, l).unwrap();
        f32c.truncate(1, l).unwrap();
    }
    assert_eq!(lowp.lens(), f32c.lens());
    let stored = |c: &KvCache<E>| (widen(&dense(c.keys())), widen(&dense(c.values())));
    assert_eq!(stored(&lowp), (dense(f32c.keys()), dense(f32c.values())));
    (lowp, f32c)
}

/// A view's elements in (B, H, L, D) order.
fn dense<E: Elem>(t: Tensor<E>) -> Vec<E> {
    let ([b, h, l, d], data, st) = (t.shape(), t.data(), t.strides());
    let mut out = Vec::with_capacity(b * h * l * d);
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                let o = bi * st[0] + hi * st[1] + li * st[2];
                out.extend_from_slice(&data[o..o + d]);
            }
        }
    }
    out
}

fn case<E: Operand + Elem>(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for s in SHAPES {
        let [b, hq, _, d, dv, _] = s;
        let (lowp, f32c) = filled::<E>(&mut rng, s);
        for lq in [1, 3] {
            let q: Vec<E> = randn(&mut rng, b * hq * lq * d, 1.0)
                .into_iter()
                .map(E::from_f32)
                .collect();
            let qf = widen(&q);
            let q32 = randn(&mut rng, b * hq * lq * d, 1.0);
            for isa in isas() {
                for kernel in [Kernel::Auto, Kernel::Prefill, Kernel::Decode] {
                    for window in [None, Some(5)] {
                        let mut opts = SdpaOptions::new().isa(isa).kernel(kernel);
                        if let Some(w) = window {
                            opts = opts.window(w);
                        }
                        let what =
                            format!("{:?} {s:?} lq={lq} {isa} {kernel:?} {window:?}", E::DTYPE);
                        let oshape = [b, hq, lq, dv];
                        let mut want = vec![0.0f32; b * hq * lq * dv];
                        f32c.attend(
                            &Tensor::bhld(&qf, [b, hq, lq, d]),
                            &mut TensorMut::bhld(&mut want, oshape),
                            &opts,
                        )
                        .unwrap();
                        let mut got = vec![f32::NAN; want.len()];
                        lowp.attend(
                            &Tensor::bhld(&q, [b, hq, lq, d]),
                            &mut TensorMut::bhld(&mut got, oshape),
                            &opts,
                        )
                        .unwrap();
                        // (`Auto` runs the decode kernel at these `Lq`.) The bf16 pair
                        // path rounds the weights to bf16: each output is then within
                        // 2⁻⁸·Σⱼ pⱼ·|vⱼ| ≤ 2⁻⁸·max |v| of the f32 one (tests/lowp.rs checks the
                        // tight bound).
                        let pairs = kernel == Kernel::Prefill
                            && flash_path(isa, E::DTYPE, E::DTYPE, d).rounds_weights();
                        if pairs {
                            let vmax = widen(&dense(lowp.values()))
                                .iter()
                                .fold(0.0f32, |m, x| m.max(x.abs()));
                            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                                let tol = 1e-5 + 1e-5 * w.abs() + vmax / 256.0;
                                assert!((g - w).abs() <= tol, "{what}: out[{i}] {g} vs {w}");
                            }
                        } else {
                            same_values(&got, &want, decode_reorders(E::DTYPE, isa, kernel), &what);
                        }
                        let mut got16 = vec![E::from_f32(f32::NAN); want.len()];
                        lowp.attend(
                            &Tensor::bhld(&q, [b, hq, lq, d]),
                            &mut TensorMut::bhld(&mut got16, oshape),
                            &opts,
                        )
                        .unwrap();
                        let rounded: Vec<f32> =
                            got.iter().map(|&x| E::from_f32(x).to_f32()).collect();
                        assert_eq!(widen(&got16), rounded, "{what}, 16-bit out");
                        // f32 queries (not representable in E) over the 16-bit cache: what the
                        // f32 cache gives them (no path rounds f32 queries).
                        let mut want32 = vec![0.0f32; want.len()];
                        f32c.attend(
                            &Tensor::bhld(&q32, [b, hq, lq, d]),
                            &mut TensorMut::bhld(&mut want32, oshape),
                            &opts,
                        )
                        .unwrap();
                        let mut got32 = vec![f32::NAN; want.len()];
                        lowp.attend(
                            &Tensor::bhld(&q32, [b, hq, lq, d]),
                            &mut TensorMut::bhld(&mut got32, oshape),
                            &opts,
                        )
                        .unwrap();
                        same_values(
                            &got32,
                            &want32,
                            decode_reorders(E::DTYPE, isa, kernel),
                            &format!("{what}, f32 queries"),
                        );
                    }
                }
            }
        }
    }
}

/// `sdpa` with Q of one type and K, V of another (every combination of f32, bf16, f16, through
/// both kernels): what the all-f32 call gives on the widened values (bitwise but where
/// `common::decode_reorders`).
#[test]
fn mixed_query_and_cache_types_compute_on_widened_values() {
    fn run<Q: Elem, KV: Operand + Elem>(rng: &mut SmallRng) {
        let (b, hq, hkv, lq, lk, d) = (2, 4, 2, 5, 37, 24);
        let q: Vec<Q> = randn(rng, b * hq * lq * d, 1.0)
            .into_iter()
            .map(Q::from_f32)
            .collect();
        let kv: Vec<KV> = randn(rng, b * hkv * lk * d, 1.0)
            .into_iter()
            .map(KV::from_f32)
            .collect();
        let (qf, kvf) = (widen(&q), widen(&kv));
        let (qs, ks, os) = ([b, hq, lq, d], [b, hkv, lk, d], [b, hq, lq, d]);
        for isa in isas() {
            for kernel in [Kernel::Prefill, Kernel::Decode] {
                let opts = SdpaOptions::new()
                    .isa(isa)
                    .kernel(kernel)
                    .causal(attnkit::Causal::BottomRight);
                let mut want = vec![0.0f32; b * hq * lq * d];
                let t = Tensor::bhld(&kvf, ks);
                attnkit::sdpa(
                    &Tensor::bhld(&qf, qs),
                    &t,
                    &t,
                    &mut TensorMut::bhld(&mut want, os),
                    &opts,
                )
                .unwrap();
                let mut got = vec![f32::NAN; want.len()];
                let t = Tensor::bhld(&kv, ks);
                attnkit::sdpa(
                    &Tensor::bhld(&q, qs),
                    &t,
                    &t,
                    &mut TensorMut::bhld(&mut got, os),
                    &opts,
                )
                .unwrap();
                let what = format!("Q {:?} KV {:?} {isa} {kernel:?}", Q::DTYPE, KV::DTYPE);
                same_values(&got, &want, decode_reorders(KV::DTYPE, isa, kernel), &what);
            }
        }
    }
    let mut rng = SmallRng::seed_from_u64(3);
    run::<f32, bf16>(&mut rng);
    run::<f32, f16>(&mut rng);
    run::<bf16, f32>(&mut rng);
    run::<f16, bf16>(&mut rng);
    run::<bf16, f16>(&mut rng);
}

#[test]
fn bf16_cache_equals_f32_on_stored_values() {
    case::<bf16>(1);
}

#[test]
fn f16_cache_equals_f32_on_stored_values() {
    case::<f16>(2);
}

/// Keys and values already of the storage type go in unchanged; a refused append (capacity, a
/// shape mismatch) leaves the cache as it was.
#[test]
fn appends_exact_and_refusals_change_nothing() {
    let (b, h, d, cap) = (2, 3, 4, 5);
    let mut c = KvCache::<bf16>::new_of(b, h, cap, d, d).unwrap();
    let x: Vec<bf16> = (0..b * h * 3 * d)
        .map(|i| bf16::from_f32(i as f32 * 0.37 - 5.0))
        .collect();
    let t = Tensor::bhld(&x, [b, h, 3, d]);
    c.append(&t, &t).unwrap();
    assert_eq!(dense(c.keys()), x);
    let before = (dense(c.keys()), dense(c.values()), c.lens().to_vec());
    assert!(matches!(c.append(&t, &t), Err(AttnError::Capacity { .. })));
    let y = vec![0.5f32; b * h * 2 * (d + 1)];
    let bad = Tensor::bhld(&y, [b, h, 2, d + 1]);
    assert!(matches!(
        c.append(&bad, &bad),
        Err(AttnError::ShapeMismatch { .. })
    ));
    assert_eq!(
        (dense(c.keys()), dense(c.values()), c.lens().to_vec()),
        before
    );
}
