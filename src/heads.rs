//! Checked multi-head split/concat copies. Usually unnecessary: [`crate::Tensor::blhd`] reads a
//! `(B, L, H·D)` projection per head through strides, and [`crate::TensorMut::blhd`] writes the
//! concatenated heads directly.

use crate::error::{AttnError, Result};

fn check(arg: &'static str, len: usize, dims: [usize; 4]) -> Result<()> {
    let needed = dims
        .iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or(AttnError::Overflow { arg })?;
    if len != needed {
        return Err(AttnError::BufferLength {
            arg,
            needed,
            got: len,
        });
    }
    Ok(())
}

/// Copies `(B, L, H·D)` into `(B, H, L, D)`; `sizes = [B, L, H, D]`, the memory order of the
/// token-major side (as for [`crate::Tensor::blhd`]).
///
/// # Errors
/// [`AttnError::BufferLength`] if either slice is not `B·L·H·D` long.
///
/// ```
/// let x: Vec<f32> = (0..12).map(|i| i as f32).collect(); // B=1, L=3, H=2, D=2
/// let mut y = vec![0.0; 12];
/// attnkit::split_heads(&x, &mut y, [1, 3, 2, 2])?;
/// assert_eq!(&y[..6], &[0.0, 1.0, 4.0, 5.0, 8.0, 9.0]); // head 0
/// # Ok::<(), attnkit::AttnError>(())
/// ```
pub fn split_heads(src: &[f32], dst: &mut [f32], sizes: [usize; 4]) -> Result<()> {
    check("src", src.len(), sizes)?;
    check("dst", dst.len(), sizes)?;
    let [b, l, h, d] = sizes;
    attnkit_kernels::split_heads(src, dst, b, l, h, d);
    Ok(())
}

/// Copies `(B, H, L, D)` into `(B, L, H·D)`; `sizes = [B, L, H, D]`, the memory order of the
/// token-major side.
///
/// # Errors
/// [`AttnError::BufferLength`] if either slice is not `B·L·H·D` long.
pub fn merge_heads(src: &[f32], dst: &mut [f32], sizes: [usize; 4]) -> Result<()> {
    check("src", src.len(), sizes)?;
    check("dst", dst.len(), sizes)?;
    let [b, l, h, d] = sizes;
    attnkit_kernels::merge_heads(src, dst, b, l, h, d);
    Ok(())
}
