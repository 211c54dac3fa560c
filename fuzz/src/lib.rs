//! Shared pieces of attnkit's fuzz targets (`fuzz_targets/`): decoding fuzz bytes into sizes,
//! views, masks and options; recording which inputs must be refused; the f64 reference; and a
//! global allocator with a size limit.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod alloc;
pub mod expect;
pub mod gen;
pub mod operand;
pub mod problem;
pub mod reference;
