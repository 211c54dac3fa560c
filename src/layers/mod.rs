//! Attention layers over the fused kernels, numerically equal to their PyTorch counterparts:
//! [`MultiheadAttention`] (`torch.nn.MultiheadAttention`), the single-head [`SelfAttention`]
//! (three `nn.Linear`, no output projection; also cross-attention), [`AdditiveAttention`]
//! (Bahdanau) and the named functional entry points [`dot_product_attention`] /
//! [`scaled_dot_product_attention`]. Weights are named and shaped as in PyTorch's `state_dict`
//! and load from `.safetensors` files through [`StateDict`].
//!
//! Activations are borrowed [`Tokens`] views `(B, L, E)`, batch-first or sequence-first (a
//! stride, never a transposing copy). Projections are GEMMs (bias add fused by pre-filling the
//! output and accumulating) split over rayon tasks by fixed row blocks, so results never depend
//! on the thread count.

mod additive;
mod functional;
mod linear;
mod mha;
mod self_attention;
mod state_dict;
mod tokens;

pub use additive::{AdditiveAttention, AdditiveOptions, AdditiveOutput};
pub use functional::{dot_product_attention, scaled_dot_product_attention};
pub use linear::Linear;
pub use mha::{
    AttnPath, KeyPadding, LayerOutput, MhaConfig, MhaMask, MhaOptions, MultiheadAttention,
};
pub use self_attention::SelfAttention;
pub use state_dict::StateDict;
pub use tokens::Tokens;

use crate::options::Par;

/// Below this many multiply-adds a phase runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 20;

/// Runs `f(0..n)` on the current rayon pool, or inline when `par` is `Seq` or the work is small.
/// Callers make the task split depend on the shape only, so results do not depend on threads.
pub(crate) fn run_tasks(par: Par, n: usize, work: usize, f: impl Fn(usize) + Sync + Send) {
    #[cfg(feature = "rayon")]
    if par == Par::Rayon && n > 1 && work >= PAR_MIN_WORK {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(f);
        return;
    }
    let _ = (par, work);
    (0..n).for_each(f);
}

/// `∏ dims` with overflow reported against `arg`.
pub(crate) fn product(arg: &'static str, dims: &[usize]) -> crate::Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or(crate::AttnError::Overflow { arg })
}

/// Validates a layer's query, key and value inputs (named `names`): each buffer covers its view
/// and has the given width, keys and values have the query's batch size, and values the keys'
/// length. Layers call it before allocating anything sized by these inputs.
pub(crate) fn check_qkv(
    names: [&'static str; 3],
    [q, k, v]: [&Tokens; 3],
    widths: [Option<usize>; 3],
) -> crate::Result<()> {
    q.validate(names[0], widths[0])?;
    k.validate(names[1], widths[1])?;
    v.validate(names[2], widths[2])?;
    let mismatch = |arg, dim, expected, got| {
        Err(crate::AttnError::ShapeMismatch {
            arg,
            dim,
            expected,
            got,
        })
    };
    for (arg, t) in [(names[1], k), (names[2], v)] {
        if t.shape[0] != q.shape[0] {
            return mismatch(arg, "B", q.shape[0], t.shape[0]);
        }
    }
    if v.shape[1] != k.shape[1] {
        return mismatch(names[2], "L", k.shape[1], v.shape[1]);
    }
    Ok(())
}

/// A raw pointer that may cross into rayon tasks; each task writes a disjoint part of the buffer
/// it points into (argued at each use).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);

impl SendPtr {
    /// The pointer. (A method, so that closures capture the whole `Sync` wrapper rather than
    /// the raw pointer field.)
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: only used to hand disjoint output ranges to tasks that run while the owning buffer is
// mutably borrowed by the caller, which waits for all of them.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// A read-only raw pointer that may cross into rayon tasks: the buffer it points into is
/// borrowed by the caller, which waits for all of them, and nobody writes it meanwhile. (Passing
/// the address as a `usize` instead would drop the pointer's provenance.)
#[derive(Clone, Copy)]
pub(crate) struct SendConst<T>(pub(crate) *const T);

impl<T> SendConst<T> {
    /// The pointer (a method, as [`SendPtr::get`]).
    pub(crate) fn get(self) -> *const T {
        self.0
    }
}
// SAFETY: only shared reads of `T: Sync` data happen through it, while the data is borrowed.
unsafe impl<T: Sync> Send for SendConst<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for SendConst<T> {}
