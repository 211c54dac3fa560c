//! Borrowed 4-D views `(B, H, L, D)` over slices of `f32`, `bf16` or `f16` (f32 unless said): a
//! shape plus strides (in elements) for B, H and L, the last dimension contiguous. Building a
//! view never copies and never fails; the attention call validates it (and names it) before any
//! kernel runs.
//!
//! One rule for sizes: a constructor named after a memory order takes the sizes in that order
//! (`Tensor::blhd(x, [B, L, H, D])`, `Tensor::bhld(x, [B, H, L, D])`, `Tensor::new(x, sizes,
//! layout)` in the layout's order); a strided constructor, which has no memory order, takes the
//! logical `(B, H, L, D)`. Everything that reports a shape (`shape()`, errors) speaks the logical
//! order.

use crate::error::{AttnError, Result};
use attnkit_kernels::{Elem, Stored};
use core::ops::Range;

/// Memory order of a `(B, H, L, D)` tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Heads before sequence: `(B, H, L, D)` row-major (PyTorch's SDPA layout).
    Bhld,
    /// Sequence before heads: `(B, L, H, D)` row-major, i.e. `(B, L, H·D)`, the layout of a
    /// projection's output. Reading it per head is a stride, not a copy.
    Blhd,
}

impl Layout {
    /// The logical `(B, H, L, D)` shape of sizes given in this layout's memory order.
    pub fn logical(self, sizes: [usize; 4]) -> [usize; 4] {
        match self {
            Layout::Bhld => sizes,
            Layout::Blhd => {
                let [b, l, h, d] = sizes;
                [b, h, l, d]
            }
        }
    }

    /// The sizes in this layout's memory order of a logical `(B, H, L, D)` shape (the inverse of
    /// [`Layout::logical`]).
    pub fn sizes(self, shape: [usize; 4]) -> [usize; 4] {
        // Both layouts differ by one swap, its own inverse.
        self.logical(shape)
    }

    /// Element strides of B, H and L for a dense tensor of this layout, from its logical shape
    /// `(B, H, L, D)`. Products saturate at `usize::MAX` instead of overflowing: such a view then
    /// fails validation with [`AttnError::Overflow`] rather than panicking here.
    pub fn strides(self, shape: [usize; 4]) -> [usize; 3] {
        let [_, h, l, d] = shape;
        let m = |a: usize, b: usize| a.saturating_mul(b);
        match self {
            Layout::Bhld => [m(m(h, l), d), m(l, d), d],
            Layout::Blhd => [m(m(l, h), d), d, m(h, d)],
        }
    }
}

/// A read-only `(B, H, L, D)` view of elements `E` (`f32`, [`bf16`](crate::bf16) or
/// [`f16`](struct@crate::f16)). Element `(b, h, l, x)` is at
/// `b·strides[0] + h·strides[1] + l·strides[2] + x`.
#[derive(Debug)]
pub struct Tensor<'a, E = f32> {
    pub(crate) data: &'a [E],
    pub(crate) shape: [usize; 4],
    pub(crate) strides: [usize; 3],
}

/// A writable `(B, H, L, D)` view, as [`Tensor`]. Elements outside the view (padding between
/// rows) are never written.
#[derive(Debug)]
pub struct TensorMut<'a, E = f32> {
    pub(crate) data: &'a mut [E],
    pub(crate) shape: [usize; 4],
    pub(crate) strides: [usize; 3],
}

// Manual: a derive would ask `E: Clone`; a view is a borrow whatever it points at.
impl<E> Clone for Tensor<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Tensor<'_, E> {}

impl<'a, E: Stored> Tensor<'a, E> {
    /// A dense tensor stored in `layout` order, `sizes` in that order (`[B, L, H, D]` for
    /// [`Layout::Blhd`]).
    pub fn new(data: &'a [E], sizes: [usize; 4], layout: Layout) -> Self {
        let shape = layout.logical(sizes);
        Tensor {
            data,
            shape,
            strides: layout.strides(shape),
        }
    }
    /// Dense `(B, H, L, D)` memory, heads before sequence; `sizes = [B, H, L, D]`.
    pub fn bhld(data: &'a [E], sizes: [usize; 4]) -> Self {
        Self::new(data, sizes, Layout::Bhld)
    }
    /// Dense `(B, L, H, D)` memory (a projection's output, `(B, L, H·D)`) read per head;
    /// `sizes = [B, L, H, D]`, in memory order like every named constructor.
    ///
    /// ```
    /// # let (b, l, h, d) = (2, 5, 3, 4);
    /// let x = vec![0.0f32; b * l * h * d];
    /// let t = attnkit::Tensor::blhd(&x, [b, l, h, d]);
    /// assert_eq!(t.shape(), [b, h, l, d]); // the logical (B, H, L, D)
    /// ```
    pub fn blhd(data: &'a [E], sizes: [usize; 4]) -> Self {
        Self::new(data, sizes, Layout::Blhd)
    }
    /// The logical shape `(B, H, L, D)` with any strides for B, H, L (the D axis is contiguous).
    /// Lets Q, K and V be views into one packed
    /// QKV projection buffer, e.g. `(B, L, 3, H, D)` with `strides = [L·3·H·D, D, 3·H·D]`.
    pub fn strided(data: &'a [E], shape: [usize; 4], strides: [usize; 3]) -> Self {
        Tensor {
            data,
            shape,
            strides,
        }
    }
    /// Logical shape `(B, H, L, D)`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }
    /// Element strides of B, H and L (D is contiguous): element `(b, h, l, i)` is
    /// `data()[b·s[0] + h·s[1] + l·s[2] + i]`.
    pub fn strides(&self) -> [usize; 3] {
        self.strides
    }
    /// The buffer the view reads.
    pub fn data(&self) -> &'a [E] {
        self.data
    }
    /// Rows `rows` of the L axis, for every batch and head: the same strides and memory, `L` =
    /// `rows.len()`. Token `t` of a projection for [`KvCache::append`](crate::KvCache::append):
    /// `x.rows(t..t + 1)?`.
    ///
    /// # Errors
    /// [`AttnError::Range`] if `rows` reaches past `L` (or is reversed).
    ///
    /// # Example
    /// ```
    /// use attnkit::Tensor;
    /// let x: Vec<f32> = (0..24).map(|i| i as f32).collect(); // (B, L, H, D) = (1, 3, 2, 4)
    /// let t1 = Tensor::blhd(&x, [1, 3, 2, 4]).rows(1..2)?;
    /// assert_eq!(t1.shape(), [1, 2, 1, 4]);
    /// # Ok::<(), attnkit::AttnError>(())
    /// ```
    pub fn rows(self, rows: Range<usize>) -> Result<Tensor<'a, E>> {
        let (shape, offset) = narrow_rows(self.shape, self.strides, &rows)?;
        Ok(Tensor {
            data: self.data.get(offset..).unwrap_or_default(),
            shape,
            strides: self.strides,
        })
    }
}

/// The shape of rows `rows` of a view and the offset of its first element; an offset past the
/// buffer is left for the call to refuse as a short buffer.
fn narrow_rows(
    shape: [usize; 4],
    strides: [usize; 3],
    rows: &Range<usize>,
) -> Result<([usize; 4], usize)> {
    let l = shape[2];
    if rows.start > rows.end || rows.end > l {
        return Err(AttnError::Range {
            arg: "rows",
            dim: "L",
            start: rows.start,
            end: rows.end,
            size: l,
        });
    }
    let mut out = shape;
    out[2] = rows.len();
    // Nothing is addressed when the view is empty; otherwise `start < L`, and the view's own
    // extent (checked by the call) bounds `start·stride`.
    let offset = if out.contains(&0) {
        0
    } else {
        rows.start.saturating_mul(strides[2])
    };
    Ok((out, offset))
}

impl<'a, E: Elem> TensorMut<'a, E> {
    /// A dense tensor stored in `layout` order, `sizes` in that order, as [`Tensor::new`].
    pub fn new(data: &'a mut [E], sizes: [usize; 4], layout: Layout) -> Self {
        let shape = layout.logical(sizes);
        TensorMut {
            data,
            shape,
            strides: layout.strides(shape),
        }
    }
    /// Dense `(B, H, L, D)` memory; `sizes = [B, H, L, D]`.
    pub fn bhld(data: &'a mut [E], sizes: [usize; 4]) -> Self {
        Self::new(data, sizes, Layout::Bhld)
    }
    /// Dense `(B, L, H, D)` memory written per head (the multi-head concat); `sizes =
    /// [B, L, H, D]`.
    pub fn blhd(data: &'a mut [E], sizes: [usize; 4]) -> Self {
        Self::new(data, sizes, Layout::Blhd)
    }
    /// The logical shape `(B, H, L, D)` with any non-overlapping strides for B, H, L (validated
    /// by the call that writes it).
    pub fn strided(data: &'a mut [E], shape: [usize; 4], strides: [usize; 3]) -> Self {
        TensorMut {
            data,
            shape,
            strides,
        }
    }
    /// Logical shape `(B, H, L, D)`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }
    /// Rows `rows` of the L axis, as [`Tensor::rows`], borrowed from this view.
    ///
    /// # Errors
    /// As [`Tensor::rows`].
    pub fn rows(&mut self, rows: Range<usize>) -> Result<TensorMut<'_, E>> {
        let (shape, offset) = narrow_rows(self.shape, self.strides, &rows)?;
        let len = self.data.len();
        Ok(TensorMut {
            data: &mut self.data[offset.min(len)..],
            shape,
            strides: self.strides,
        })
    }
}

/// Elements a view needs: the largest offset plus one row, with checked arithmetic.
pub(crate) fn needed_len(
    arg: &'static str,
    shape: [usize; 4],
    strides: [usize; 3],
) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    let ovf = || AttnError::Overflow { arg };
    let mut last = 0usize;
    for i in 0..3 {
        let step = (shape[i] - 1).checked_mul(strides[i]).ok_or_else(ovf)?;
        last = last.checked_add(step).ok_or_else(ovf)?;
    }
    last.checked_add(shape[3]).ok_or_else(ovf)
}

/// Checks that `data` covers the view.
pub(crate) fn check_len(
    arg: &'static str,
    len: usize,
    shape: [usize; 4],
    strides: [usize; 3],
) -> Result<()> {
    let needed = needed_len(arg, shape, strides)?;
    if len < needed {
        return Err(AttnError::BufferLength {
            arg,
            needed,
            got: len,
        });
    }
    Ok(())
}

/// Checks that no two elements of a writable view share memory: sorted by stride, each
/// dimension's stride must step over everything inside it.
pub(crate) fn check_disjoint(
    arg: &'static str,
    shape: [usize; 4],
    strides: [usize; 3],
) -> Result<()> {
    const NAMES: [&str; 3] = ["B", "H", "L"];
    if shape.contains(&0) {
        return Ok(());
    }
    let mut dims: Vec<usize> = (0..3).filter(|&i| shape[i] > 1).collect();
    dims.sort_by_key(|&i| strides[i]);
    let mut span = shape[3]; // one contiguous row
    for i in dims {
        if strides[i] < span {
            return Err(AttnError::BadStride {
                arg,
                dim: NAMES[i],
                stride: strides[i],
                min: span,
            });
        }
        span = strides[i]
            .checked_mul(shape[i] - 1)
            .and_then(|x| x.checked_add(span))
            .ok_or(AttnError::Overflow { arg })?;
    }
    Ok(())
}

/// Writes `src` rounded to `O` at `dst`: a 16-bit output's single rounding of the f32 result.
///
/// # Safety
/// `dst` is writable for `src.len()` elements and nothing else accesses them meanwhile.
pub(crate) unsafe fn store_rounded<O: Elem>(dst: *mut O, src: &[f32]) {
    for (c, x) in src.iter().enumerate() {
        // SAFETY: `c < src.len()`, per the contract.
        unsafe { *dst.add(c) = O::from_f32(*x) };
    }
}
