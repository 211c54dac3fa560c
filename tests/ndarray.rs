//! The `ndarray` feature: views of ndarray arrays read and written in place. Each layout is
//! checked against a naive f64 attention written with ndarray (`softmax(Q·Kᵀ·scale)·V` per
//! head, query head `h` reading KV head `h / (Hq/Hkv)`, TopLeft causal masking), within 1e-5
//! absolute plus 1e-5 relative; the views attnkit cannot use in place are refused by name.
#![cfg(feature = "ndarray")]

use attnkit::{bf16, sdpa, AttnError, Causal, SdpaOptions, Tensor, TensorMut};
use ndarray::{s, Array4, ArrayView4, Axis};

/// Deterministic values in [-1, 1).
fn array(shape: (usize, usize, usize, usize), seed: u32) -> Array4<f32> {
    let mut i = 0u32;
    Array4::from_shape_simple_fn(shape, || {
        i += 1;
        ((i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 2000) as f32 / 1000.0 - 1.0
    })
}

/// Naive attention in f64 over logical `(B, H, L, D)` views.
fn reference(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    causal: bool,
) -> Array4<f64> {
    let (b, hq, lq, d) = q.dim();
    let (hkv, lk, dv) = (k.dim().1, k.dim().2, v.dim().3);
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = Array4::<f64>::zeros((b, hq, lq, dv));
    for bi in 0..b {
        for h in 0..hq {
            let g = h / (hq / hkv);
            for i in 0..lq {
                let keys = if causal { (i + 1).min(lk) } else { lk };
                let scores: Vec<f64> = (0..keys)
                    .map(|j| {
                        (0..d)
                            .map(|x| q[[bi, h, i, x]] as f64 * k[[bi, g, j, x]] as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = p.iter().sum();
                for x in 0..dv {
                    out[[bi, h, i, x]] = (0..keys)
                        .map(|j| p[j] * v[[bi, g, j, x]] as f64)
                        .sum::<f64>()
                        / sum;
                }
            }
        }
    }
    out
}

fn assert_close(got: ArrayView4<f32>, want: &Array4<f64>) {
    assert_eq!(got.shape(), want.shape());
    for (idx, (g, w)) in got
        .indexed_iter()
        .zip(want.iter())
        .map(|((i, g), w)| (i, (g, w)))
    {
        let tol = 1e-5 + 1e-5 * w.abs();
        assert!(
            ((*g as f64) - w).abs() <= tol,
            "at {idx:?}: got {g}, want {w}"
        );
    }
}

/// The error's `Unsupported` argument and reason.
fn unsupported<T: std::fmt::Debug>(r: Result<T, AttnError>) -> (&'static str, String) {
    match r {
        Err(AttnError::Unsupported { arg, reason }) => (arg, reason),
        other => panic!("expected AttnError::Unsupported, got {other:?}"),
    }
}

#[test]
fn standard_layout() {
    let (q, k, v) = (
        array((2, 3, 5, 8), 1),
        array((2, 3, 7, 8), 2),
        array((2, 3, 7, 4), 3),
    );
    let got = attnkit::ndarray::sdpa(q.view(), k.view(), v.view(), &SdpaOptions::new()).unwrap();
    assert!(got.is_standard_layout());
    assert_close(got.view(), &reference(q.view(), k.view(), v.view(), false));

    // The same through the core API, written into an ndarray output.
    let mut out = Array4::<f32>::zeros((2, 3, 5, 4));
    sdpa(
        &Tensor::from_ndarray(q.view()).unwrap(),
        &Tensor::from_ndarray(k.view()).unwrap(),
        &Tensor::from_ndarray(v.view()).unwrap(),
        &mut TensorMut::from_ndarray(out.view_mut()).unwrap(),
        &SdpaOptions::new(),
    )
    .unwrap();
    assert_eq!(out, got);
}

/// `(B, L, H, D)` arrays (a projection's output) read per head through `permuted_axes`, and the
/// output written the same way: attnkit gets the BLHD strides, nothing is copied.
#[test]
fn permuted_blhd_views() {
    let (b, h, lq, lk, d) = (2, 3, 5, 6, 8);
    let (q, k, v) = (
        array((b, lq, h, d), 4),
        array((b, lk, h, d), 5),
        array((b, lk, h, d), 6),
    );
    fn p(a: &Array4<f32>) -> ArrayView4<'_, f32> {
        a.view().permuted_axes([0, 2, 1, 3])
    }
    let qt = Tensor::from_ndarray(p(&q)).unwrap();
    assert_eq!(qt.shape(), [b, h, lq, d]);
    assert_eq!(qt.strides(), [lq * h * d, d, h * d]);
    assert_eq!(qt.data().as_ptr(), q.as_ptr(), "read in place");

    let mut out = Array4::<f32>::zeros((b, lq, h, d));
    sdpa(
        &qt,
        &Tensor::from_ndarray(p(&k)).unwrap(),
        &Tensor::from_ndarray(p(&v)).unwrap(),
        &mut TensorMut::from_ndarray(out.view_mut().permuted_axes([0, 2, 1, 3])).unwrap(),
        &SdpaOptions::new(),
    )
    .unwrap();
    let want = reference(p(&q), p(&k), p(&v), false);
    assert_close(out.view().permuted_axes([0, 2, 1, 3]), &want);
    let got = attnkit::ndarray::sdpa(p(&q), p(&k), p(&v), &SdpaOptions::new()).unwrap();
    assert_close(got.view(), &want);
}

/// Views with gaps (every other row; Q, K, V of one packed QKV array) are refused by
/// `from_ndarray`, naming the axis, and read in place by `from_ndarray_in` given the buffer.
#[test]
fn sliced_views_need_their_buffer() {
    let (b, h, l, d) = (2, 2, 12, 8);
    let x = array((b, h, l, d), 7);
    let rows = x.slice(s![.., .., ..;2, ..]);
    let (arg, reason) = unsupported(Tensor::from_ndarray(rows));
    assert_eq!(arg, "view");
    assert!(reason.contains("axis 2 (L) has stride 16"), "{reason}");
    let (arg, _) = unsupported(attnkit::ndarray::sdpa(
        rows,
        x.view(),
        x.view(),
        &SdpaOptions::new(),
    ));
    assert_eq!(arg, "q");

    let buf = x.as_slice().unwrap();
    let t = Tensor::from_ndarray_in(rows, buf).unwrap();
    assert_eq!(
        (t.shape(), t.strides()),
        ([b, h, l / 2, d], [h * l * d, l * d, 2 * d])
    );
    let kv = Tensor::from_ndarray(x.view()).unwrap();
    let mut out = Array4::<f32>::zeros((b, h, l / 2, d));
    sdpa(
        &t,
        &kv,
        &kv,
        &mut TensorMut::from_ndarray(out.view_mut()).unwrap(),
        &SdpaOptions::new(),
    )
    .unwrap();
    assert_close(out.view(), &reference(rows, x.view(), x.view(), false));

    // A packed (B, L, 3, H, D) projection: Q, K and V are strided views of one buffer.
    let (lq, hq) = (5, 4);
    let qkv = ndarray::Array::from_shape_fn((b, lq, 3, hq, d), |(i, j, w, g, x)| {
        ((i * 131 + j * 37 + w * 17 + g * 7 + x) % 19) as f32 / 10.0 - 0.9
    });
    let buf = qkv.as_slice().unwrap();
    let part = |w: usize| qkv.slice(s![.., .., w, .., ..]).permuted_axes([0, 2, 1, 3]);
    let (q, k, v) = (part(0), part(1), part(2));
    let mut out = Array4::<f32>::zeros((b, hq, lq, d));
    sdpa(
        &Tensor::from_ndarray_in(q, buf).unwrap(),
        &Tensor::from_ndarray_in(k, buf).unwrap(),
        &Tensor::from_ndarray_in(v, buf).unwrap(),
        &mut TensorMut::from_ndarray(out.view_mut()).unwrap(),
        &SdpaOptions::new(),
    )
    .unwrap();
    assert_close(out.view(), &reference(q, k, v, false));

    // A buffer that does not hold the view, or stops short of it.
    let other = vec![0.0f32; 16];
    let (arg, _) = unsupported(Tensor::from_ndarray_in(q, &other));
    assert_eq!(arg, "buffer");
    let short = &buf[..buf.len() - 1];
    assert!(matches!(
        Tensor::from_ndarray_in(v, short),
        Err(AttnError::BufferLength { arg: "buffer", .. })
    ));
    // A mutable view with gaps cannot be written through a slice that covers its neighbours.
    let mut wide = Array4::<f32>::zeros((b, hq, 2 * lq, d));
    let (arg, reason) = unsupported(TensorMut::from_ndarray(
        wide.slice_mut(s![.., .., ..;2, ..]),
    ));
    assert_eq!(arg, "out");
    assert!(reason.contains("axis 2 (L)"), "{reason}");
}

/// Grouped-query attention: 6 query heads over 2 KV heads, causal (TopLeft), Lq = Lk.
#[test]
fn gqa_causal() {
    let (b, hq, hkv, l, d) = (2, 6, 2, 9, 16);
    let (q, k, v) = (
        array((b, hq, l, d), 8),
        array((b, hkv, l, d), 9),
        array((b, hkv, l, d), 10),
    );
    let opts = SdpaOptions::new().causal(Causal::TopLeft);
    let got = attnkit::ndarray::sdpa(q.view(), k.view(), v.view(), &opts).unwrap();
    assert_close(got.view(), &reference(q.view(), k.view(), v.view(), true));
    let plain = attnkit::ndarray::sdpa(q.view(), k.view(), v.view(), &SdpaOptions::new()).unwrap();
    assert_close(
        plain.view(),
        &reference(q.view(), k.view(), v.view(), false),
    );
}

/// Q in f32 over bf16 K and V (a 16-bit cache): read in place, computed on the widened values.
#[test]
fn bf16_keys_and_values() {
    let (q, k, v) = (
        array((1, 2, 4, 8), 11),
        array((1, 2, 6, 8), 12),
        array((1, 2, 6, 8), 13),
    );
    let (kb, vb) = (k.mapv(bf16::from_f32), v.mapv(bf16::from_f32));
    let got = attnkit::ndarray::sdpa(q.view(), kb.view(), vb.view(), &SdpaOptions::new()).unwrap();
    let (kw, vw) = (kb.mapv(f32::from), vb.mapv(f32::from));
    assert_close(
        got.view(),
        &reference(q.view(), kw.view(), vw.view(), false),
    );
}

/// A last axis that is not contiguous and negative strides are refused, naming the axis;
/// empty views give empty results.
#[test]
fn refusals_and_empty_views() {
    let x = array((2, 3, 4, 8), 14);
    // D stepped, or D not the fastest axis.
    let (arg, reason) = unsupported(Tensor::from_ndarray(x.slice(s![.., .., .., ..;2])));
    assert_eq!(arg, "view");
    assert!(reason.contains("last axis (D) has stride 2"), "{reason}");
    let r = array((8, 4, 3, 2), 15);
    let (_, reason) = unsupported(Tensor::from_ndarray(r.view().reversed_axes()));
    assert!(reason.contains("last axis (D) has stride 24"), "{reason}");
    let (arg, reason) = unsupported(attnkit::ndarray::sdpa(
        x.view(),
        x.view(),
        r.view().reversed_axes(),
        &SdpaOptions::new(),
    ));
    assert_eq!(arg, "v");
    assert!(reason.contains("(D)"), "{reason}");

    // Negative strides: L reversed, and H inverted in place.
    let (arg, reason) = unsupported(Tensor::from_ndarray(x.slice(s![.., .., ..;-1, ..])));
    assert_eq!(arg, "view");
    assert!(reason.contains("axis 2 (L) has stride -8"), "{reason}");
    let mut y = x.clone();
    y.invert_axis(Axis(1));
    let (arg, reason) = unsupported(attnkit::ndarray::sdpa(
        x.view(),
        y.view(),
        x.view(),
        &SdpaOptions::new(),
    ));
    assert_eq!(arg, "k");
    assert!(reason.contains("axis 1 (H) has stride -32"), "{reason}");
    let (arg, _) = unsupported(TensorMut::from_ndarray(y.view_mut()));
    assert_eq!(arg, "out");
    // A broadcast (stride 0) overlaps: only with its buffer.
    let one = array((1, 3, 4, 8), 16);
    let wide = one.broadcast((2, 3, 4, 8)).unwrap();
    let (_, reason) = unsupported(Tensor::from_ndarray(wide));
    assert!(reason.contains("overlap"), "{reason}");
    let t = Tensor::from_ndarray_in(wide, one.as_slice().unwrap()).unwrap();
    assert_eq!(t.strides(), [0, 32, 8]);
    // Shape errors are the core API's.
    let r = attnkit::ndarray::sdpa(
        x.view(),
        array((2, 3, 4, 7), 17).view(),
        x.view(),
        &SdpaOptions::new(),
    );
    assert!(
        matches!(
            r,
            Err(AttnError::ShapeMismatch {
                arg: "k",
                dim: "D",
                ..
            })
        ),
        "{r:?}"
    );

    let e = Array4::<f32>::zeros((2, 3, 0, 8));
    let got = attnkit::ndarray::sdpa(e.view(), x.view(), x.view(), &SdpaOptions::new()).unwrap();
    assert_eq!(got.shape(), &[2, 3, 0, 8]);
}
