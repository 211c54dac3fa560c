//! x86-64 register types. The kernels themselves are generic (see `flash.rs`); these modules
//! only say how each ISA spells the vector operations.

pub(crate) mod avx2;
pub(crate) mod avx512;
