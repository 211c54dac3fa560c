//! Fallible, zero-filled allocation for buffers whose size comes from the caller.
//!
//! `vec![0.0; n]` aborts the process when the allocator refuses `n`, and sizes that reach it
//! here (a KV cache's capacity, a layer's output) are the caller's, possibly from an untrusted
//! checkpoint. These helpers return [`AttnError::Alloc`] instead. They allocate through
//! `alloc_zeroed`, as `vec!` does, so large buffers map untouched zero pages (which huge-page
//! advice needs: see `pages.rs`).

use crate::error::{AttnError, Result};
use attnkit_kernels::Stored;
use std::alloc::{alloc_zeroed, Layout};
use std::ptr::NonNull;

/// Element types whose all-zero bit pattern is the value zero.
///
/// # Safety
/// All-zero bytes must be a valid value of the type.
pub(crate) unsafe trait Zeroable: Copy {}
// SAFETY: all-zero bits are 0.0 / 0.
unsafe impl Zeroable for f32 {}
// SAFETY: as above.
unsafe impl Zeroable for usize {}
// SAFETY: as above.
unsafe impl Zeroable for u32 {}

/// `n` zeros, or [`AttnError::Overflow`] / [`AttnError::Alloc`] naming `arg`.
pub(crate) fn try_zeros<T: Zeroable>(arg: &'static str, n: usize) -> Result<Vec<T>> {
    // SAFETY: all-zero bytes are a valid `T` (`Zeroable`).
    unsafe { zeroed_vec(arg, n) }
}

/// [`try_zeros`] of a storage element type (all-zero bits are zero in each; see [`Stored`]).
pub(crate) fn try_zeros_elem<E: Stored>(arg: &'static str, n: usize) -> Result<Vec<E>> {
    // SAFETY: `Stored` types are f32, bf16, f16 and i8, for which all-zero bits are zero.
    unsafe { zeroed_vec(arg, n) }
}

/// `n` zero-filled `T`s.
///
/// # Safety
/// All-zero bytes must be a valid value of `T`, and `T` not zero-sized.
unsafe fn zeroed_vec<T>(arg: &'static str, n: usize) -> Result<Vec<T>> {
    let layout = Layout::array::<T>(n).map_err(|_| AttnError::Overflow { arg })?;
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout has a non-zero size (`n > 0`, `T` not zero-sized).
    let ptr = unsafe { alloc_zeroed(layout) };
    let ptr = NonNull::new(ptr.cast::<T>()).ok_or(AttnError::Alloc {
        arg,
        bytes: layout.size(),
    })?;
    // SAFETY: allocated by the global allocator with the layout of `[T; n]`, zero-filled, and
    // zero bytes are valid `T`s (this function's contract); the Vec takes ownership.
    Ok(unsafe { Vec::from_raw_parts(ptr.as_ptr(), n, n) })
}

/// `∏ dims`, at most `isize::MAX` (the most elements a buffer can hold, and what keeps every
/// index and offset representable as `isize`), or [`AttnError::Overflow`] naming `arg`.
pub(crate) fn checked_len(arg: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or(AttnError::Overflow { arg })
}

/// `∏ dims` zeros (see [`try_zeros`]).
pub(crate) fn zeros_for(arg: &'static str, dims: &[usize]) -> Result<Vec<f32>> {
    try_zeros(arg, checked_len(arg, dims)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "Miri reports resource exhaustion instead of a null pointer"
    )]
    fn refuses_what_cannot_be_allocated() {
        assert_eq!(
            try_zeros::<f32>("x", usize::MAX).unwrap_err(),
            AttnError::Overflow { arg: "x" }
        );
        // 2^61 bytes is a valid layout that no machine can back.
        assert!(matches!(
            try_zeros::<f32>("x", 1 << 59),
            Err(AttnError::Alloc { arg: "x", .. })
        ));
        assert_eq!(try_zeros::<usize>("x", 3).unwrap(), vec![0usize; 3]);
        assert!(try_zeros::<f32>("x", 0).unwrap().is_empty());
        assert_eq!(zeros_for("x", &[2, 3]).unwrap().len(), 6);
        assert!(zeros_for("x", &[usize::MAX, 2]).is_err());
    }
}
