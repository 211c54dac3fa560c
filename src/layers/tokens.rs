//! [`Tokens`]: a borrowed `(B, L, E)` batch of sequences of vectors.

use crate::alloc::zeros_for;
use crate::error::{AttnError, Result};
use crate::view::check_len;

/// A borrowed batch of sequences of `E`-vectors, logical shape `(B, L, E)`: element `(b, l, e)`
/// at `b·strides[0] + l·strides[1] + e` (the vector axis is contiguous). Building one never
/// copies and never fails; the layer that reads it validates it and names it in errors.
///
/// PyTorch's two layouts are both plain strides: `batch_first=True` is [`Tokens::ble`]
/// `(B, L, E)`, the default sequence-first layout is [`Tokens::lbe`] `(L, B, E)`. As for
/// [`Tensor`](crate::Tensor), the letters of a constructor's name are its memory order and the
/// order of its sizes; [`Tokens::shape`] is the logical `(B, L, E)`. Layer outputs use the
/// memory order of the query.
///
/// ```
/// use attnkit::Tokens;
/// let x = vec![0.0f32; 2 * 10 * 128];
/// let bf = Tokens::ble(&x, [2, 10, 128]); // (B, L, E) memory
/// let sf = Tokens::lbe(&x, [10, 2, 128]); // (L, B, E) memory, same logical shape
/// assert_eq!(bf.shape(), [2, 10, 128]);
/// assert_eq!(sf.shape(), [2, 10, 128]);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Tokens<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) shape: [usize; 3],
    pub(crate) strides: [usize; 2],
}

impl<'a> Tokens<'a> {
    /// Dense `(B, L, E)` memory (PyTorch's `batch_first=True`); `sizes = [B, L, E]`.
    pub fn ble(data: &'a [f32], sizes: [usize; 3]) -> Self {
        let [b, l, e] = sizes;
        Tokens {
            data,
            shape: [b, l, e],
            // Saturating, as `Layout::strides`: an impossible shape fails validation instead.
            strides: [l.saturating_mul(e), e],
        }
    }
    /// Dense `(L, B, E)` memory (PyTorch's default `batch_first=False`); `sizes = [L, B, E]`,
    /// in memory order like every named constructor.
    pub fn lbe(data: &'a [f32], sizes: [usize; 3]) -> Self {
        let [l, b, e] = sizes;
        Tokens {
            data,
            shape: [b, l, e],
            strides: [e, b.saturating_mul(e)],
        }
    }
    /// One unbatched sequence, dense `(L, E)` memory (B = 1); `sizes = [L, E]`.
    pub fn le(data: &'a [f32], sizes: [usize; 2]) -> Self {
        Self::ble(data, [1, sizes[0], sizes[1]])
    }
    /// The logical shape `(B, L, E)` with any strides for B and L (`E` contiguous), e.g. a slice
    /// of a wider buffer.
    pub fn strided(data: &'a [f32], shape: [usize; 3], strides: [usize; 2]) -> Self {
        Tokens {
            data,
            shape,
            strides,
        }
    }
    /// Logical shape `(B, L, E)`.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }
    /// Whether the sequence axis is the outer one in memory (`(L, B, E)` order); outputs
    /// computed from this input as query use the same order.
    pub fn is_seq_first(&self) -> bool {
        self.shape[0] > 1 && self.shape[1] > 1 && self.strides[0] < self.strides[1]
    }
    /// Whether two views are the same memory with the same shape and strides (self-attention).
    pub(crate) fn same_as(&self, other: &Tokens) -> bool {
        core::ptr::eq(self.data.as_ptr(), other.data.as_ptr())
            && self.data.len() == other.data.len()
            && self.shape == other.shape
            && self.strides == other.strides
    }
    /// Checks the buffer covers the view, and the width `E` if given.
    pub(crate) fn validate(&self, arg: &'static str, width: Option<usize>) -> Result<()> {
        let [b, l, e] = self.shape;
        if let Some(w) = width {
            if e != w {
                return Err(AttnError::ShapeMismatch {
                    arg,
                    dim: "E",
                    expected: w,
                    got: e,
                });
            }
        }
        check_len(
            arg,
            self.data.len(),
            [b, 1, l, e],
            [self.strides[0], 0, self.strides[1]],
        )
    }
    /// The strides to address elements by: `strides`, or none when the view has no element
    /// (validation bounds no stride of such a view, so `b·s₀ + l·s₁` could overflow).
    pub(crate) fn addr_strides(&self) -> [usize; 2] {
        if self.shape.contains(&0) {
            [0, 0]
        } else {
            self.strides
        }
    }
    /// A dense batch-first `(B, L, E)` copy (what training keeps of an input).
    pub(crate) fn dense_ble(&self) -> Result<Vec<f32>> {
        let [b, l, e] = self.shape;
        let mut y = zeros_for("input", &[b, l, e])?;
        let [sb, sl] = self.addr_strides();
        for bi in 0..b {
            for li in 0..l {
                let src = bi * sb + li * sl;
                y[(bi * l + li) * e..][..e].copy_from_slice(&self.data[src..src + e]);
            }
        }
        Ok(y)
    }
    /// Row strides `(b, l)` of a dense `(B, L, n)` buffer in this view's memory order.
    pub(crate) fn dense_strides(&self, n: usize) -> [usize; 2] {
        let [b, l, _] = self.shape;
        if self.is_seq_first() {
            [n, b.saturating_mul(n)]
        } else {
            [l.saturating_mul(n), n]
        }
    }
}

/// Dense `(n0, n1, w)` rows with the two outer axes swapped: batch-first ↔ sequence-first.
pub(crate) fn swap_outer(y: &[f32], [n0, n1, w]: [usize; 3]) -> Vec<f32> {
    let mut out = vec![0.0; y.len()];
    for i in 0..n0 {
        for j in 0..n1 {
            out[(j * n0 + i) * w..][..w].copy_from_slice(&y[(i * n1 + j) * w..][..w]);
        }
    }
    out
}
