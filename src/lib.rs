//! # attnkit
//!
//! Fused, SIMD, multi-threaded attention for CPUs: `softmax(Q·Kᵀ·scale + mask)·V` computed in
//! blocks with an online softmax, so the `Lq × Lk` score matrix is never materialised unless you
//! ask for the weights. Kernels for AVX-512, AVX2+FMA and a portable path are chosen at run time
//! (`ATTNKIT_ISA=scalar|avx2|avx512` forces one); threads come from the current rayon pool.
//!
//! The entry point is [`sdpa`], with PyTorch `F.scaled_dot_product_attention` semantics over
//! borrowed, strided views ([`Tensor`], [`TensorMut`]) in `(B, H, L, D)` or `(B, L, H, D)` order.
//!
//! **Sizes are given in memory order**: a constructor named after a memory order takes its sizes
//! in that order (`Tensor::blhd(x, [B, L, H, D])`, `Tokens::lbe(x, [L, B, E])`); strided
//! constructors and everything that reports a shape use the logical order, `(B, H, L, D)` for a
//! [`Tensor`] and `(B, L, E)` for [`Tokens`].
//!
//! Optional features read other crates' tensors in place: `ndarray` (module `ndarray`:
//! `Tensor::from_ndarray`, `ndarray::sdpa`) and `candle` (module `candle`: `candle::sdpa` on
//! `candle_core::Tensor`s, and the `candle::Sdpa` custom op).
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod alloc;
mod decode;
mod error;
mod exec;
mod gemm;
mod heads;
// The optional interop features; each module is re-exported below under its crate's name.
#[cfg(any(feature = "candle", feature = "ndarray"))]
mod interop;
mod kv_cache;
mod layers;
mod merge;
mod options;
mod paged_cache;
mod pages;
mod plan;
mod prefill;
mod scratch;
mod sdpa;
pub mod unfused;
mod view;

pub use attnkit_kernels::{bf16, f16, Dtype, Elem, Isa, IsaError, Operand, Stored};
pub use error::{AttnError, Result};
pub use heads::{merge_heads, split_heads};
#[cfg(feature = "candle")]
pub use interop::candle;
#[cfg(feature = "ndarray")]
pub use interop::ndarray;
pub use kv_cache::KvCache;
pub use layers::{
    dot_product_attention, scaled_dot_product_attention, AdditiveAttention, AdditiveDims,
    AdditiveOptions, AdditiveOutput, AdditiveWeights, Fusion, InitRng, KeyPadding, LayerOutput,
    Linear, MhaConfig, MhaMask, MhaOptions, MultiheadAttention, SelfAttention, StateDict, Tokens,
    Weights,
};
pub use merge::{merge, Partial};
pub use options::{
    alibi_slopes, AttnMask, Causal, Extras, Kernel, MaskRef, Par, Returns, SdpaOptions, SdpaOutput,
};
pub use paged_cache::{PagedKvCache, SeqId};
pub use pages::{advise_huge_pages, AlignedBuf};
pub use plan::choose_kernel;
pub use sdpa::{sdpa, sdpa_ext, sdpa_ext_vec, sdpa_int8, sdpa_vec};
pub use view::{Layout, Tensor, TensorMut};

/// The raw-slice kernel crate, re-exported for benchmarks and advanced use.
pub use attnkit_kernels as kernels;

/// README.md's code blocks, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
