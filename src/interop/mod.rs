//! Attention on other crates' tensors without copies, one module per optional feature: `ndarray`
//! (views of `ndarray` arrays) and `candle` (`candle_core::Tensor`s on the CPU). Both read the
//! foreign memory in place through attnkit's own [`Tensor`](crate::Tensor) views, with the
//! same validation and typed errors as the core API, plus
//! [`AttnError::Unsupported`](crate::AttnError::Unsupported) for what a view cannot express.

#[cfg(feature = "candle")]
pub mod candle;
#[cfg(feature = "ndarray")]
pub mod ndarray;

use crate::error::AttnError;

/// [`AttnError::Unsupported`] for `arg`.
pub(crate) fn unsupported(arg: &'static str, reason: String) -> AttnError {
    AttnError::Unsupported { arg, reason }
}
