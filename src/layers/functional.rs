//! The two textbook names of the same kernel.

use crate::error::Result;
use crate::options::SdpaOptions;
use crate::view::{Tensor, TensorMut};

/// Dot-product attention, `softmax(Q·Kᵀ)·V` (no scaling): [`crate::sdpa`] with scale 1,
/// whatever `opts.scale` says. Shapes, masks and errors as [`crate::sdpa`].
///
/// # Errors
/// As [`crate::sdpa`].
///
/// # Example
/// Scores of one query against six keys, `(1, 64)·(6, 64)ᵀ → (1, 6)`, and the output:
/// ```
/// use attnkit::{dot_product_attention, sdpa_ext, Extras, SdpaOptions, Tensor, TensorMut};
/// let (lk, d) = (6, 64);
/// let q = vec![0.01f32; d];
/// let k: Vec<f32> = (0..lk * d).map(|i| (i / d) as f32 * 0.01).collect();
/// let v = k.clone();
/// let mut out = vec![0.0f32; d];
/// let (qt, kt, vt) = (Tensor::bhld(&q, [1, 1, 1, d]), Tensor::bhld(&k, [1, 1, lk, d]), Tensor::bhld(&v, [1, 1, lk, d]));
/// dot_product_attention(&qt, &kt, &vt, &mut TensorMut::bhld(&mut out, [1, 1, 1, d]), &SdpaOptions::new())?;
/// // The (1, 6) weights, if wanted, come from sdpa_ext:
/// let mut w = vec![0.0f32; lk];
/// let opts = SdpaOptions::new().scale(1.0);
/// sdpa_ext(&qt, &kt, &vt, &mut TensorMut::bhld(&mut out, [1, 1, 1, d]), &opts, Extras { lse: None, weights: Some(&mut w) })?;
/// assert!(w.windows(2).all(|p| p[0] < p[1])); // later keys score higher
/// # Ok::<(), attnkit::AttnError>(())
/// ```
pub fn dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut TensorMut,
    opts: &SdpaOptions,
) -> Result<()> {
    let mut o = *opts;
    o.scale = Some(1.0);
    crate::sdpa(q, k, v, out, &o)
}

/// Scaled dot-product attention, `softmax(Q·Kᵀ/√D)·V` (or `opts.scale`): the same as
/// [`crate::sdpa`], under the name of the formula (PyTorch `F.scaled_dot_product_attention`).
///
/// # Errors
/// As [`crate::sdpa`].
///
/// # Example
/// ```
/// use attnkit::{scaled_dot_product_attention, SdpaOptions, Tensor, TensorMut};
/// let (l, d) = (4, 64); // four tokens of width 64, one head
/// let x: Vec<f32> = (0..l * d).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
/// let mut out = vec![0.0f32; l * d];
/// let t = Tensor::bhld(&x, [1, 1, l, d]);
/// scaled_dot_product_attention(&t, &t, &t, &mut TensorMut::bhld(&mut out, [1, 1, l, d]), &SdpaOptions::new())?;
/// # Ok::<(), attnkit::AttnError>(())
/// ```
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut TensorMut,
    opts: &SdpaOptions,
) -> Result<()> {
    crate::sdpa(q, k, v, out, opts)
}
