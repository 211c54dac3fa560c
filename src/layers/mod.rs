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
mod additive_train;
mod functional;
mod init;
mod linear;
mod mha;
mod self_attention;
mod state_dict;
mod tokens;

pub use additive::{
    AdditiveAttention, AdditiveDims, AdditiveOptions, AdditiveOutput, AdditiveWeights,
};
pub use additive_train::AdditiveTape;
pub use functional::{dot_product_attention, scaled_dot_product_attention};
pub use init::InitRng;
pub use linear::Linear;
pub use mha::{
    Fusion, KeyPadding, LayerGrads, LayerOutput, MhaConfig, MhaMask, MhaOptions,
    MultiheadAttention, Tape, Weights,
};
pub use self_attention::SelfAttention;
pub use state_dict::StateDict;
pub use tokens::Tokens;

pub(crate) use crate::exec::{run_tasks, SendConst, SendPtr};

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
