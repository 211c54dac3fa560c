//! The one error type of the safe API. Every variant names the offending argument and the sizes
//! involved, so a message alone is enough to find the bug.

use attnkit_kernels::IsaError;
use core::fmt;

/// Why an attention call refused its input.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum AttnError {
    /// A dimension of `arg` disagrees with the size implied by the other arguments.
    ShapeMismatch {
        /// The argument (`"k"`, `"out"`, `"mask"`, …).
        arg: &'static str,
        /// The dimension (`"B"`, `"Lk"`, `"D"`, …).
        dim: &'static str,
        /// The size the other arguments imply.
        expected: usize,
        /// The size `arg` has.
        got: usize,
    },
    /// A buffer is shorter than its shape and strides need (or, for masks, not exactly as long).
    BufferLength {
        /// The argument.
        arg: &'static str,
        /// Elements the view needs.
        needed: usize,
        /// Elements the slice has.
        got: usize,
    },
    /// A stride is unusable: an output view whose rows would overlap, or a stride smaller than
    /// the row it steps over.
    BadStride {
        /// The argument.
        arg: &'static str,
        /// The dimension whose stride is wrong.
        dim: &'static str,
        /// The stride given.
        stride: usize,
        /// The smallest stride that would be valid.
        min: usize,
    },
    /// The query head count is not a multiple of the key/value head count (GQA/MQA).
    HeadRatio {
        /// Query heads.
        hq: usize,
        /// Key/value heads.
        hkv: usize,
    },
    /// A per-batch key length exceeds the key sequence length.
    KeyLength {
        /// Batch index.
        batch: usize,
        /// The length given.
        len: usize,
        /// The key sequence length `Lk`.
        lk: usize,
    },
    /// Appending would overflow a KV cache sequence.
    Capacity {
        /// Batch index.
        batch: usize,
        /// Tokens it holds.
        len: usize,
        /// Tokens being appended.
        append: usize,
        /// Tokens it can hold.
        capacity: usize,
    },
    /// A paged KV cache's pool has too few free pages for an append (nothing was written).
    PoolExhausted {
        /// Pages the append needs.
        needed: usize,
        /// Pages free in the pool.
        free: usize,
    },
    /// A paged KV cache sequence that does not exist (never made, or freed).
    UnknownSequence {
        /// The argument that named it.
        arg: &'static str,
        /// Its id.
        seq: u64,
    },
    /// A value an int8 KV cache cannot quantise (NaN or infinite): the row's scale would not be
    /// finite. The append is refused whole.
    NonFinite {
        /// `"k"` or `"v"`.
        arg: &'static str,
        /// Batch index.
        batch: usize,
        /// KV head.
        head: usize,
        /// Token within the append.
        token: usize,
    },
    /// A range along one axis of a view reaches past the axis.
    Range {
        /// The argument (`"rows"`, …).
        arg: &'static str,
        /// The axis (`"L"`, …).
        dim: &'static str,
        /// The range asked for, `start..end`.
        start: usize,
        /// End of the range (exclusive).
        end: usize,
        /// The axis's size.
        size: usize,
    },
    /// A product of sizes overflows: past `isize::MAX` elements, more than any buffer can hold
    /// (or, for loop bounds over empty rows, than any index can count).
    Overflow {
        /// The argument whose extent overflows.
        arg: &'static str,
    },
    /// A buffer of a caller-given size could not be allocated (the allocator refused it).
    Alloc {
        /// What was being allocated (`"capacity"`, `"out"`, …).
        arg: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
    /// A parameter value is unusable (for example a non-finite scale).
    BadParam {
        /// The parameter.
        arg: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The requested ISA is unknown or unsupported on this CPU.
    Isa(IsaError),
    /// A layer's configuration is inconsistent (for example `embed_dim` not divisible by
    /// `num_heads`): the parameter, its value, and what it must satisfy.
    Config {
        /// The parameter (`"embed_dim"`, `"num_heads"`, …).
        arg: &'static str,
        /// Its value.
        value: usize,
        /// The rule it breaks, with the numbers involved.
        reason: String,
    },
    /// A tensor a layer needs is absent from the state dict / checkpoint.
    MissingTensor {
        /// Full name, prefix included (`"attn.in_proj_weight"`).
        name: String,
    },
    /// A weight tensor's shape differs from the one the layer's configuration implies.
    WeightShape {
        /// Full name of the tensor.
        name: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape found.
        got: Vec<usize>,
    },
    /// A weight tensor's element type cannot be converted to f32 (integers, bools, 8-bit
    /// floats…). F32, F64, F16 and BF16 are accepted.
    WeightDtype {
        /// Full name of the tensor.
        name: String,
        /// The dtype found, as safetensors spells it (`"I64"`).
        dtype: String,
    },
    /// A layer input (activations or mask) has the wrong shape: both shapes, in the argument's
    /// own axis order.
    InputShape {
        /// The argument (`"query"`, `"attn_mask"`, `"key_padding_mask"`, …).
        arg: &'static str,
        /// The shape the other arguments imply.
        expected: Vec<usize>,
        /// The shape given.
        got: Vec<usize>,
    },
    /// A tensor of another crate (ndarray, candle) that attnkit cannot use in place: a negative
    /// stride, a last axis that is not contiguous, memory holding elements outside the view, an
    /// element type the kernels do not read, a device other than the CPU. The reason says
    /// which, with the numbers, and how to get a tensor that can be used.
    Unsupported {
        /// The argument (`"q"`, `"view"`, …).
        arg: &'static str,
        /// What is wrong, and the usual fix.
        reason: String,
    },
    /// Reading or parsing a checkpoint failed (I/O error, malformed safetensors header…).
    Checkpoint {
        /// What was being read (a path, or `"<bytes>"`).
        path: String,
        /// The underlying error, as text.
        reason: String,
    },
}

impl fmt::Display for AttnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttnError::ShapeMismatch { arg, dim, expected, got } => {
                write!(f, "`{arg}`: dimension {dim} is {got}, expected {expected}")
            }
            AttnError::BufferLength { arg, needed, got } => {
                write!(f, "`{arg}`: buffer has {got} elements, its shape and strides need {needed}")
            }
            AttnError::BadStride { arg, dim, stride, min } => {
                write!(f, "`{arg}`: stride of {dim} is {stride}, must be at least {min}")
            }
            AttnError::HeadRatio { hq, hkv } => write!(
                f,
                "query heads ({hq}) must be a non-zero multiple of key/value heads ({hkv})"
            ),
            AttnError::KeyLength { batch, len, lk } => {
                write!(f, "`key_lengths[{batch}]` is {len}, larger than Lk = {lk}")
            }
            AttnError::Capacity { batch, len, append, capacity } => write!(
                f,
                "KV cache sequence {batch} holds {len} tokens; appending {append} exceeds its capacity {capacity}"
            ),
            AttnError::PoolExhausted { needed, free } => write!(
                f,
                "paged KV cache: the append needs {needed} pages; the pool has {free} free"
            ),
            AttnError::UnknownSequence { arg, seq } => write!(
                f,
                "`{arg}`: paged KV cache sequence {seq} does not exist (never made, or freed)"
            ),
            AttnError::NonFinite { arg, batch, head, token } => write!(
                f,
                "`{arg}`: row (batch {batch}, head {head}, token {token}) holds NaN or infinity, which int8 cannot store"
            ),
            AttnError::Range { arg, dim, start, end, size } => {
                write!(f, "`{arg}`: {start}..{end} is not inside {dim} = {size}")
            }
            AttnError::Overflow { arg } => write!(f, "`{arg}`: size overflows (over isize::MAX elements)"),
            AttnError::Alloc { arg, bytes } => {
                write!(f, "`{arg}`: could not allocate {bytes} bytes")
            }
            AttnError::BadParam { arg, reason } => write!(f, "`{arg}`: {reason}"),
            AttnError::Isa(e) => write!(f, "{e}"),
            AttnError::Config { arg, value, reason } => write!(f, "`{arg}` = {value}: {reason}"),
            AttnError::MissingTensor { name } => write!(f, "tensor `{name}` is missing from the state dict"),
            AttnError::WeightShape { name, expected, got } => {
                write!(f, "tensor `{name}` has shape {got:?}, expected {expected:?}")
            }
            AttnError::WeightDtype { name, dtype } => {
                write!(f, "tensor `{name}` has dtype {dtype}, expected F32, F64, F16 or BF16")
            }
            AttnError::InputShape { arg, expected, got } => {
                write!(f, "`{arg}` has shape {got:?}, expected {expected:?}")
            }
            AttnError::Unsupported { arg, reason } => write!(f, "`{arg}`: {reason}"),
            AttnError::Checkpoint { path, reason } => write!(f, "reading checkpoint {path}: {reason}"),
        }
    }
}

impl std::error::Error for AttnError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AttnError::Isa(e) => Some(e),
            _ => None,
        }
    }
}

impl From<IsaError> for AttnError {
    fn from(e: IsaError) -> Self {
        AttnError::Isa(e)
    }
}

/// Short for `Result<T, AttnError>`.
pub type Result<T, E = AttnError> = core::result::Result<T, E>;
