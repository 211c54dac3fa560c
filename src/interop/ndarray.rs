//! `ndarray` views as attnkit tensors, without copies (feature `ndarray`).
//!
//! An `ArrayView4` whose axes are the logical `(B, H, L, D)` becomes a [`Tensor`] with
//! [`Tensor::from_ndarray`], an `ArrayViewMut4` a [`TensorMut`] with [`TensorMut::from_ndarray`],
//! and [`sdpa`] takes three views and returns a new `Array4<f32>`. The attnkit view borrows the
//! array's memory with the array's strides, so a `(B, L, H, D)` projection output is read per
//! head by permuting its axes, not by copying it.
//!
//! What can be used in place:
//! - the last axis (D) contiguous (stride 1), and no negative stride (ndarray has them after
//!   `s![.., .., ..;-1, ..]` or `invert_axis`);
//! - for [`Tensor::from_ndarray`], [`TensorMut::from_ndarray`] and [`sdpa`]: a view whose
//!   elements fill the memory they span, in any axis order (ndarray's `as_slice_memory_order`
//!   is `Some`): a standard-layout array, or a permuted one such as
//!   `x.permuted_axes([0, 2, 1, 3])` of a `(B, L, H, D)` array;
//! - for [`Tensor::from_ndarray_in`]: any view, gaps and broadcasts included (rows stepped with
//!   `s![.., .., ..;2, ..]`, the Q of a packed QKV array), given the buffer it was sliced from.
//!
//! Why the gaps need the buffer: attnkit's views are slices, and a slice over the span of a view
//! with gaps would also cover the elements between its rows, which another live view (a
//! `multi_slice_mut` sibling) may be writing. A shared borrow of the whole buffer rules that
//! out; a view alone cannot, so it is refused rather than read unsoundly. Everything else is
//! refused with [`AttnError::Unsupported`] naming the axis; `view.as_standard_layout()` is the
//! copy that can always be read.
//!
//! ```
//! use attnkit::{Causal, SdpaOptions};
//! use ndarray::{s, Array4};
//!
//! let (b, l, h, d) = (1, 6, 2, 8);
//! // A projection's output (B, L, H, D), read per head as (B, H, L, D) without a copy.
//! let x = Array4::from_shape_fn((b, l, h, d), |(_, i, j, k)| ((i * 7 + j * 3 + k) % 5) as f32);
//! let q = x.view().permuted_axes([0, 2, 1, 3]);
//! let out = attnkit::ndarray::sdpa(q, q, q, &SdpaOptions::new().causal(Causal::TopLeft))?;
//! assert_eq!(out.shape(), &[b, h, l, d]);
//!
//! // Every other row: a view with gaps, read in place given the array's buffer.
//! let rows = x.slice(s![.., ..;2, .., ..]).permuted_axes([0, 2, 1, 3]);
//! assert!(attnkit::Tensor::from_ndarray(rows).is_err());
//! let t = attnkit::Tensor::from_ndarray_in(rows, x.as_slice().unwrap())?;
//! assert_eq!(t.shape(), [b, h, l / 2, d]);
//! # Ok::<(), attnkit::AttnError>(())
//! ```

use super::unsupported;
use crate::error::{AttnError, Result};
use crate::options::SdpaOptions;
use crate::sdpa::sdpa_vec;
use crate::view::{needed_len, Tensor, TensorMut};
use ::ndarray::{Array4, ArrayView4, ArrayViewMut4};
use attnkit_kernels::{Elem, Operand, Stored};

/// The logical axis names of a `(B, H, L, D)` tensor, by index.
const AXES: [&str; 4] = ["B", "H", "L", "D"];

impl<'a, E: Stored> Tensor<'a, E> {
    /// Reads an `ndarray` view with axes `(B, H, L, D)` in place: D contiguous, no negative
    /// stride, and elements that fill the memory they span (standard layout or permuted axes;
    /// see [the module](crate::ndarray)).
    ///
    /// # Errors
    /// [`AttnError::Unsupported`] naming the axis (argument `"view"`) for a negative stride, a
    /// D axis that is not contiguous, or gaps between the elements (a sliced view: use
    /// [`Tensor::from_ndarray_in`]).
    pub fn from_ndarray(view: ArrayView4<'a, E>) -> Result<Self> {
        tensor("view", view)
    }

    /// Reads an `ndarray` view with axes `(B, H, L, D)` in place inside `buffer`, the memory it
    /// was sliced from (`array.as_slice_memory_order()` of the owning array): gaps between rows,
    /// overlaps and broadcasts (stride 0) are fine, since the shared borrow of `buffer` keeps
    /// every element it holds unchanged while the tensor lives. D contiguous and no negative
    /// stride, as [`Tensor::from_ndarray`].
    ///
    /// # Errors
    /// [`AttnError::Unsupported`] naming the axis (argument `"view"`) as
    /// [`Tensor::from_ndarray`] except for gaps; `"buffer"` when the view's first element is
    /// not in it, [`AttnError::BufferLength`] when the view reaches past its end.
    pub fn from_ndarray_in(view: ArrayView4<'_, E>, buffer: &'a [E]) -> Result<Self> {
        let (shape, strides) = layout("view", view.shape(), view.strides())?;
        if shape.contains(&0) {
            return Ok(Tensor::strided(&[], shape, strides));
        }
        let start = index_in(buffer, view.as_ptr()).ok_or_else(|| {
            unsupported(
                "buffer",
                "does not hold the view's first element: pass the buffer of the array the view \
                 was sliced from"
                    .into(),
            )
        })?;
        let needed = needed_len("view", shape, strides)?;
        if buffer.len() - start < needed {
            return Err(AttnError::BufferLength {
                arg: "buffer",
                needed: start.saturating_add(needed),
                got: buffer.len(),
            });
        }
        Ok(Tensor::strided(&buffer[start..], shape, strides))
    }
}

impl<'a, E: Elem> TensorMut<'a, E> {
    /// Writes an `ndarray` view with axes `(B, H, L, D)` in place: D contiguous, no negative
    /// stride, and elements that fill the memory they span (standard layout or permuted axes),
    /// so that the slice attnkit writes through holds this view's elements and no others.
    ///
    /// # Errors
    /// [`AttnError::Unsupported`] naming the axis (argument `"out"`) for a negative stride, a D
    /// axis that is not contiguous, or gaps between the elements (write into a dense array and
    /// `assign` it instead).
    pub fn from_ndarray(view: ArrayViewMut4<'a, E>) -> Result<Self> {
        let arg = "out";
        let (shape, strides) = layout(arg, view.shape(), view.strides())?;
        if shape.contains(&0) {
            return Ok(TensorMut::strided(&mut [], shape, strides));
        }
        let first = view.as_ptr();
        let Some(data) = view.into_slice_memory_order() else {
            return Err(not_dense(
                arg,
                shape,
                strides,
                "write into a dense array and `assign` it",
            ));
        };
        if data.as_ptr() != first {
            return Err(not_first(arg));
        }
        Ok(TensorMut::strided(data, shape, strides))
    }
}

/// Scaled dot-product attention over `ndarray` views, as [`crate::sdpa`]: `q (B, Hq, Lq, D)`,
/// `k (B, Hkv, Lk, D)`, `v (B, Hkv, Lk, Dv)`, read in place (as [`Tensor::from_ndarray`]);
/// returns a new standard-layout `(B, Hq, Lq, Dv)` array.
///
/// # Errors
/// [`AttnError::Unsupported`] naming `q`, `k` or `v` and the axis for a view that cannot be read
/// in place; otherwise as [`crate::sdpa`].
pub fn sdpa<Q: Elem, KV: Operand>(
    q: ArrayView4<'_, Q>,
    k: ArrayView4<'_, KV>,
    v: ArrayView4<'_, KV>,
    opts: &SdpaOptions,
) -> Result<Array4<f32>> {
    let (q, k, v) = (tensor("q", q)?, tensor("k", k)?, tensor("v", v)?);
    let [b, hq, lq, _] = q.shape();
    let out = sdpa_vec(&q, &k, &v, opts)?;
    Ok(Array4::from_shape_vec((b, hq, lq, v.shape()[3]), out)
        .expect("sdpa_vec returns B·Hq·Lq·Dv elements"))
}

/// [`Tensor::from_ndarray`] with the argument's name for errors.
fn tensor<'a, E: Stored>(arg: &'static str, view: ArrayView4<'a, E>) -> Result<Tensor<'a, E>> {
    let (shape, strides) = layout(arg, view.shape(), view.strides())?;
    if shape.contains(&0) {
        return Ok(Tensor::strided(&[], shape, strides));
    }
    let Some(data) = view.to_slice_memory_order() else {
        const FIX: &str = "use `Tensor::from_ndarray_in` with the array's buffer, or copy it with \
                           `as_standard_layout()`";
        return Err(not_dense(arg, shape, strides, FIX));
    };
    if data.as_ptr() != view.as_ptr() {
        return Err(not_first(arg));
    }
    Ok(Tensor::strided(data, shape, strides))
}

/// The attnkit shape and B, H, L strides of a view's `(B, H, L, D)` axes. The strides of axes
/// with at most one index address nothing and become 0; an empty view has no strides.
fn layout(
    arg: &'static str,
    dims: &[usize],
    strides: &[isize],
) -> Result<([usize; 4], [usize; 3])> {
    let shape = [dims[0], dims[1], dims[2], dims[3]];
    let mut out = [0usize; 3];
    if shape.contains(&0) {
        return Ok((shape, out));
    }
    for (i, &s) in strides.iter().enumerate() {
        if shape[i] <= 1 {
            continue;
        }
        if i == 3 && s != 1 {
            return Err(unsupported(
                arg,
                format!(
                    "the last axis (D) has stride {s}; attnkit reads rows of D contiguous \
                     elements (stride 1): copy it with `as_standard_layout()`"
                ),
            ));
        }
        if s < 0 {
            return Err(unsupported(
                arg,
                format!(
                    "axis {i} ({}) has stride {s}; attnkit reads only non-negative strides: \
                     copy it with `as_standard_layout()`",
                    AXES[i]
                ),
            ));
        }
        if i < 3 {
            out[i] = s.unsigned_abs();
        }
    }
    Ok((shape, out))
}

/// The refusal of a view whose elements do not fill the memory they span, naming the first
/// axis (by stride) that steps past the axes inside it, or saying that elements overlap.
fn not_dense(arg: &'static str, shape: [usize; 4], strides: [usize; 3], fix: &str) -> AttnError {
    let mut axes: Vec<usize> = (0..3).filter(|&i| shape[i] > 1).collect();
    axes.sort_by_key(|&i| strides[i]);
    let mut span = shape[3];
    for i in axes {
        if strides[i] > span {
            return unsupported(
                arg,
                format!(
                    "axis {i} ({}) has stride {} over {span} elements inside it, so the memory \
                     the view spans holds elements outside it; {fix}",
                    AXES[i], strides[i]
                ),
            );
        }
        span = strides[i].saturating_mul(shape[i] - 1).saturating_add(span);
    }
    unsupported(
        arg,
        format!("its elements overlap (a broadcast, strides {strides:?}); {fix}"),
    )
}

/// The refusal of a dense view whose memory-order slice does not start at its first element.
/// Without negative strides (refused before) the first element is the lowest in memory, so
/// this does not happen; it is checked rather than assumed.
fn not_first(arg: &'static str) -> AttnError {
    unsupported(
        arg,
        "its first element is not the lowest in memory; copy it with `as_standard_layout()`".into(),
    )
}

/// The index in `buf` of the element at address `first`, if it is one of `buf`'s.
fn index_in<E>(buf: &[E], first: *const E) -> Option<usize> {
    let bytes = first.addr().checked_sub(buf.as_ptr().addr())?;
    let size = size_of::<E>();
    (bytes % size == 0 && bytes / size < buf.len()).then_some(bytes / size)
}
