//! Views: sizes given in the memory order a constructor's name spells, narrowing to rows
//! (`Tensor::rows`, `TensorMut::rows`: the same memory and strides, a range outside L refused by
//! name), and K/V broadcast over the batch (stride 0, or a batch of one).

use attnkit::{sdpa, AttnError, KvCache, SdpaOptions, Tensor, TensorMut, Tokens};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

/// `(B, L, H, D)` memory permuted to `(B, H, L, D)`.
fn blhd_to_bhld(x: &[f32], [_, l, h, d]: [usize; 4]) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    for (i, v) in x.iter().enumerate() {
        let (bi, li, hi, di) = (i / (l * h * d), i / (h * d) % l, i / d % h, i % d);
        y[((bi * h + hi) * l + li) * d + di] = *v;
    }
    y
}

/// A named constructor takes its sizes in the memory order its name spells (#18: before,
/// `Tensor::blhd` took the logical `(B, H, L, D)`, so `[B, L, H, D]` computed garbage). L ≠ H
/// and Lq ≠ Lk, so no swapped order can pass: attention over `Tensor::blhd(x, [B, L, H, D])`
/// views equals, bitwise, attention over the dense `(B, H, L, D)` copies, written back through
/// `TensorMut::blhd`; `Tokens` likewise report the logical `(B, L, E)` of `[L, B, E]` memory.
#[test]
fn named_constructors_take_sizes_in_memory_order() {
    let (b, h, lq, lk, d) = (2, 3, 5, 7, 4);
    let q = values(b * lq * h * d, 11);
    let (k, v) = (values(b * lk * h * d, 12), values(b * lk * h * d, 13));
    let mut got = vec![0.0f32; q.len()];
    sdpa(
        &Tensor::blhd(&q, [b, lq, h, d]),
        &Tensor::blhd(&k, [b, lk, h, d]),
        &Tensor::blhd(&v, [b, lk, h, d]),
        &mut TensorMut::blhd(&mut got, [b, lq, h, d]),
        &SdpaOptions::new(),
    )
    .unwrap();
    let (qp, kp, vp) = (
        blhd_to_bhld(&q, [b, lq, h, d]),
        blhd_to_bhld(&k, [b, lk, h, d]),
        blhd_to_bhld(&v, [b, lk, h, d]),
    );
    let mut want = vec![0.0f32; q.len()];
    sdpa(
        &Tensor::bhld(&qp, [b, h, lq, d]),
        &Tensor::bhld(&kp, [b, h, lk, d]),
        &Tensor::bhld(&vp, [b, h, lk, d]),
        &mut TensorMut::bhld(&mut want, [b, h, lq, d]),
        &SdpaOptions::new(),
    )
    .unwrap();
    assert_eq!(blhd_to_bhld(&got, [b, lq, h, d]), want);
    assert_eq!(Tensor::blhd(&q, [b, lq, h, d]).shape(), [b, h, lq, d]);

    let x = values(lq * b * d, 14);
    assert_eq!(Tokens::lbe(&x, [lq, b, d]).shape(), [b, lq, d]);
    assert_eq!(Tokens::ble(&x, [b, lq, d]).shape(), [b, lq, d]);
    assert_eq!(Tokens::le(&x, [b * lq, d]).shape(), [1, b * lq, d]);
}

#[test]
fn rows_outside_l_are_refused() {
    let x = vec![0.0f32; 2 * 3 * 5 * 4];
    let t = Tensor::bhld(&x, [2, 3, 5, 4]);
    for (a, b) in [(0, 6), (5, 6), (6, 6), (3, 2)] {
        assert_eq!(
            t.rows(a..b).err(),
            Some(AttnError::Range {
                arg: "rows",
                dim: "L",
                start: a,
                end: b,
                size: 5
            }),
            "{a}..{b}"
        );
    }
    for (a, b) in [(0, 5), (4, 5), (5, 5), (0, 0), (2, 4)] {
        assert_eq!(t.rows(a..b).unwrap().shape(), [2, 3, b - a, 4]);
    }
    let mut y = x.clone();
    let mut o = TensorMut::bhld(&mut y, [2, 3, 5, 4]);
    assert!(matches!(o.rows(1..7), Err(AttnError::Range { end: 7, .. })));
}

/// A cache filled token by token through `rows(t..t + 1)` of a `(B, L, H, D)` projection holds
/// what one append of all of it holds: attention over both is bitwise equal.
#[test]
fn token_by_token_appends_through_rows() {
    let (b, h, l, d, dv) = (2, 3, 7, 5, 6);
    let (k, v) = (values(b * l * h * d, 1), values(b * l * h * dv, 2));
    let (kt, vt) = (
        Tensor::blhd(&k, [b, l, h, d]),
        Tensor::blhd(&v, [b, l, h, dv]),
    );
    let mut whole = KvCache::new(b, h, l, d, dv).unwrap();
    whole.append(&kt, &vt).unwrap();
    let mut steps = KvCache::new(b, h, l, d, dv).unwrap();
    for t in 0..l {
        steps
            .append(&kt.rows(t..t + 1).unwrap(), &vt.rows(t..t + 1).unwrap())
            .unwrap();
    }
    let q = values(b * h * d, 3);
    let qt = Tensor::bhld(&q, [b, h, 1, d]);
    let attend = |c: &KvCache| {
        let mut out = vec![0.0f32; b * h * dv];
        c.attend(
            &qt,
            &mut TensorMut::bhld(&mut out, [b, h, 1, dv]),
            &SdpaOptions::new(),
        )
        .unwrap();
        out
    };
    assert_eq!(attend(&whole), attend(&steps));
}

/// `sdpa` into `out.rows(r)` for the query rows `q.rows(r)` writes those rows and no others,
/// equal to the same rows of one call over all of them (the rows are independent).
#[test]
fn sdpa_on_row_ranges() {
    let (b, h, l, d) = (2, 2, 37, 8);
    let q = values(b * h * l * d, 4);
    let kv = values(b * h * l * d, 5);
    let sizes = [b, l, h, d];
    let (qt, kt) = (Tensor::blhd(&q, sizes), Tensor::blhd(&kv, sizes));
    let mut full = vec![0.0f32; q.len()];
    sdpa(
        &qt,
        &kt,
        &kt,
        &mut TensorMut::blhd(&mut full, sizes),
        &SdpaOptions::new(),
    )
    .unwrap();
    for (a, e) in [(0, 37), (5, 21), (36, 37), (10, 10)] {
        let mut out = vec![f32::NAN; q.len()];
        let mut ot = TensorMut::blhd(&mut out, sizes);
        sdpa(
            &qt.rows(a..e).unwrap(),
            &kt,
            &kt,
            &mut ot.rows(a..e).unwrap(),
            &SdpaOptions::new(),
        )
        .unwrap();
        // (B, L, H, D) memory: row i of every (batch, head) at ((b·L + i)·H + h)·D.
        for (idx, (&got, &want)) in out.iter().zip(&full).enumerate() {
            let i = idx / (h * d) % l;
            if (a..e).contains(&i) {
                assert!(
                    (got - want).abs() <= 1e-6,
                    "{a}..{e}: row {i}: {got} vs {want}"
                );
            } else {
                assert!(got.is_nan(), "{a}..{e}: row {i} written");
            }
        }
    }
}

/// K and V shared by every batch element (one encoder output, or one shared prefix, attended by
/// a batch of queries), given with B stride 0 or as a batch of one, give what their copy per
/// batch element gives, bitwise, on both kernels and the unfused path. Any other K/V batch size
/// is refused.
#[test]
fn kv_broadcast_over_the_batch() {
    use attnkit::{unfused, Kernel};
    let (b, hq, hkv, lq, lk, d) = (3, 4, 2, 9, 21, 8);
    let q = values(b * hq * lq * d, 6);
    let (k1, v1) = (values(hkv * lk * d, 7), values(hkv * lk * d, 8));
    let (kb, vb) = (k1.repeat(b), v1.repeat(b));
    let qt = Tensor::bhld(&q, [b, hq, lq, d]);
    let shape = [b, hkv, lk, d];
    fn shared(x: &[f32], s: [usize; 4]) -> Tensor<'_> {
        Tensor::strided(x, s, [0, s[2] * s[3], s[3]])
    }
    for kernel in [Kernel::Prefill, Kernel::Decode] {
        for rows in [1..2, 0..lq] {
            let run = |k: Tensor, v: Tensor| {
                let q = qt.rows(rows.clone()).unwrap();
                let n = rows.len();
                let mut out = vec![0.0f32; b * hq * n * d];
                sdpa(
                    &q,
                    &k,
                    &v,
                    &mut TensorMut::bhld(&mut out, [b, hq, n, d]),
                    &SdpaOptions::new().kernel(kernel),
                )
                .unwrap();
                out
            };
            let copied = run(Tensor::bhld(&kb, shape), Tensor::bhld(&vb, shape));
            let one = [1, hkv, lk, d];
            assert_eq!(
                run(shared(&k1, shape), shared(&v1, shape)),
                copied,
                "{kernel:?}, rows {rows:?}"
            );
            assert_eq!(
                run(Tensor::bhld(&k1, one), Tensor::bhld(&v1, one)),
                copied,
                "{kernel:?}, rows {rows:?}, a batch of one"
            );
        }
    }
    let run = |k: Tensor, v: Tensor| {
        let mut out = vec![0.0f32; b * hq * lq * d];
        unfused::sdpa_unfused(
            &qt,
            &k,
            &v,
            &mut TensorMut::bhld(&mut out, [b, hq, lq, d]),
            &SdpaOptions::new(),
        )
        .unwrap();
        out
    };
    let copied = run(Tensor::bhld(&kb, shape), Tensor::bhld(&vb, shape));
    assert_eq!(run(shared(&k1, shape), shared(&v1, shape)), copied);
    let one = [1, hkv, lk, d];
    assert_eq!(run(Tensor::bhld(&k1, one), Tensor::bhld(&v1, one)), copied);
    let two = [2, hkv, lk, d];
    let r = attnkit::sdpa_vec(
        &qt,
        &Tensor::bhld(&kb, two),
        &Tensor::bhld(&vb, two),
        &SdpaOptions::new(),
    );
    assert_eq!(
        r.err(),
        Some(AttnError::ShapeMismatch {
            arg: "k",
            dim: "B",
            expected: b,
            got: 2
        })
    );
}
