//! Attention over `ndarray` arrays without copies: a packed `(B, L, 3, H, D)` QKV projection,
//! split into Q, K and V views that attnkit reads in place (`Tensor::from_ndarray_in`), the
//! output written into a `(B, L, H, D)` array through a permuted view (the multi-head concat),
//! and the same through `attnkit::ndarray::sdpa` on dense copies, checked against a naive
//! `softmax(Q·Kᵀ/√D)·V` written with ndarray.
//!
//! `cargo run --release --features ndarray --example ndarray_attention`

use attnkit::{sdpa, Causal, SdpaOptions, Tensor, TensorMut};
use ndarray::{s, Array, Array4, ArrayView4, Axis};

/// Naive causal attention of one batch and head: `q (Lq, D)`, `k (Lk, D)`, `v (Lk, Dv)`.
fn naive(q: ArrayView4<f32>, k: ArrayView4<f32>, v: ArrayView4<f32>) -> Array4<f32> {
    let (b, h, l, d) = q.dim();
    let mut out = Array4::zeros((b, h, l, v.dim().3));
    for bi in 0..b {
        for hi in 0..h {
            let (q2, k2, v2) = (
                q.slice(s![bi, hi, .., ..]),
                k.slice(s![bi, hi, .., ..]),
                v.slice(s![bi, hi, .., ..]),
            );
            let mut scores = q2.dot(&k2.t()) / (d as f32).sqrt();
            for (i, mut row) in scores.axis_iter_mut(Axis(0)).enumerate() {
                row.slice_mut(s![i + 1..]).fill(f32::NEG_INFINITY);
                let max = row.fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                row.mapv_inplace(|x| (x - max).exp());
                let sum = row.sum();
                row /= sum;
            }
            out.slice_mut(s![bi, hi, .., ..]).assign(&scores.dot(&v2));
        }
    }
    out
}

fn main() -> Result<(), attnkit::AttnError> {
    let (b, l, h, d) = (2, 64, 4, 32);
    let qkv = Array::from_shape_fn((b, l, 3, h, d), |(i, j, w, g, x)| {
        ((i * 131 + j * 37 + w * 17 + g * 7 + x * 3) % 23) as f32 / 23.0 - 0.5
    });
    // Q, K, V: (B, L, H, D) slices of the packed buffer, read per head as (B, H, L, D).
    let part = |w: usize| qkv.slice(s![.., .., w, .., ..]).permuted_axes([0, 2, 1, 3]);
    let buf = qkv.as_slice().expect("a new array is in standard layout");
    let opts = SdpaOptions::new().causal(Causal::TopLeft);

    // The concat of heads: (B, L, H, D) memory written through a (B, H, L, D) view.
    let mut concat = Array4::<f32>::zeros((b, l, h, d));
    sdpa(
        &Tensor::from_ndarray_in(part(0), buf)?,
        &Tensor::from_ndarray_in(part(1), buf)?,
        &Tensor::from_ndarray_in(part(2), buf)?,
        &mut TensorMut::from_ndarray(concat.view_mut().permuted_axes([0, 2, 1, 3]))?,
        &opts,
    )?;

    // Dense (B, H, L, D) copies through the convenience function.
    let dense = |w: usize| part(w).as_standard_layout().into_owned();
    let (q, k, v) = (dense(0), dense(1), dense(2));
    let out = attnkit::ndarray::sdpa(q.view(), k.view(), v.view(), &opts)?;

    let want = naive(q.view(), k.view(), v.view());
    let diff = |a: ArrayView4<f32>| {
        a.iter()
            .zip(want.iter())
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
    };
    println!("(B, L, H, D) = ({b}, {l}, {h}, {d}), causal");
    println!(
        "max |attnkit - naive|: packed QKV views {:.2e}, dense arrays {:.2e}",
        diff(concat.view().permuted_axes([0, 2, 1, 3])),
        diff(out.view())
    );
    Ok(())
}
