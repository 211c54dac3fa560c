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
//! ```
//! use attnkit::{sdpa_vec, Causal, SdpaOptions, Tensor};
//! // 8 query heads over 2 KV heads (GQA), 5 new tokens against 12 keys, head width 16.
//! let (hq, hkv, lq, lk, d) = (8, 2, 5, 12, 16);
//! let q: Vec<f32> = (0..lq * hq * d).map(|i| (i % 7) as f32 * 0.1).collect(); // (B, L, H, D)
//! let k: Vec<f32> = (0..hkv * lk * d).map(|i| (i % 5) as f32 * 0.1).collect(); // (B, H, L, D)
//! let v = k.clone();
//! let out = sdpa_vec(
//!     &Tensor::blhd(&q, [1, lq, hq, d]),
//!     &Tensor::bhld(&k, [1, hkv, lk, d]),
//!     &Tensor::bhld(&v, [1, hkv, lk, d]),
//!     &SdpaOptions::new().causal(Causal::BottomRight),
//! )?; // dense (B, Hq, Lq, D)
//! assert_eq!(out.len(), hq * lq * d);
//! # Ok::<(), attnkit::AttnError>(())
//! ```
//!
//! ## Map
//!
//! | | |
//! |---|---|
//! | attention | [`sdpa`] (into a view), [`sdpa_vec`] (allocating), [`sdpa_ext`] / [`sdpa_ext_vec`] (with logsumexp and weights), [`sdpa_int8`]; options in [`SdpaOptions`]: scale, [`Causal`] alignment, bool (`bool`/`u8`) and float masks, [`KeyLengths`], window, ALiBi ([`alibi_slopes`]), softcap, sinks, [`Kernel`], [`Isa`], [`Par`] |
//! | element types | Q, K, V in `f32`, [`bf16`] or [`f16`](struct@f16); f32 accumulation; output in any |
//! | layers | [`MultiheadAttention`] (`nn.MultiheadAttention`), [`SelfAttention`], [`AdditiveAttention`], [`Linear`], over [`Tokens`]; from a [`StateDict`] (PyTorch names) or freshly initialised ([`InitRng`]) |
//! | decoding | [`KvCache`] (f32, bf16, f16, int8) and [`PagedKvCache`] (pages, `fork`, copy-on-write), each with `append` and `attend` |
//! | composition | [`merge`] (results over disjoint key ranges, by logsumexp), [`split_heads`] / [`merge_heads`] |
//! | training | [`sdpa_backward`] / [`sdpa_backward_vec`]: f32 dQ, dK, dV from the forward's [`Saved`] inputs (f32, bf16 or f16), output and logsumexp; [`bias_gradient`], [`sinks_gradient`] |
//! | baselines | [`unfused`] (GEMM → softmax → GEMM), [`kernels`] (the raw-slice kernels and their f64 twins) |
//!
//! Features: `rayon` (default; threads), `safetensors` (default; checkpoint files), `blas` (the
//! system OpenBLAS for the unfused baseline), `ndarray` and `candle` (read those crates' tensors
//! in place: `Tensor::from_ndarray` and `ndarray::sdpa`; `candle::sdpa` on
//! `candle_core::Tensor`s and the `candle::Sdpa` custom op). Errors are [`AttnError`]s that name
//! the argument and the sizes; a refused call changes nothing.
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod alloc;
mod backward;
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

pub use attnkit_kernels::{bf16, f16, Dtype, Elem, Isa, IsaError, Operand, Precision, Stored};
pub use backward::{
    bias_gradient, sdpa_backward, sdpa_backward_vec, sinks_gradient, Gradients, Saved,
};
pub use error::{AttnError, Result};
pub use heads::{merge_heads, split_heads};
#[cfg(feature = "candle")]
pub use interop::candle;
#[cfg(feature = "ndarray")]
pub use interop::ndarray;
pub use kv_cache::KvCache;
pub use layers::{
    dot_product_attention, scaled_dot_product_attention, AdditiveAttention, AdditiveDims,
    AdditiveOptions, AdditiveOutput, AdditiveTape, AdditiveWeights, Fusion, InitRng, KeyPadding,
    LayerGrads, LayerOutput, Linear, MhaConfig, MhaMask, MhaOptions, MultiheadAttention,
    SelfAttention, StateDict, Tape, Tokens, Weights,
};
pub use merge::{merge, Partial};
pub use options::{
    alibi_slopes, AttnMask, Causal, Extras, Kernel, KeyLengths, MaskElem, MaskRef, Par, Returns,
    SdpaOptions, SdpaOutput,
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
