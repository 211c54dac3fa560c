//! Per-thread scratch for the kernels: allocated on a thread's first call, grown when a larger
//! shape needs it, then reused, so steady-state calls allocate nothing.

use std::cell::RefCell;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with at least `len` f32 of this thread's scratch. Not re-entrant (kernels never call
/// back into the safe layer).
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        f(&mut buf[..len])
    })
}
