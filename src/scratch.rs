//! Per-thread scratch for the kernels: allocated on a thread's first call, grown when a larger
//! shape needs it, then reused, so steady-state calls allocate nothing.
//!
//! Growing is fallible: scratch sizes follow the caller's shapes (a head dimension read from a
//! checkpoint), and a refused allocation must be an [`AttnError::Alloc`](crate::AttnError), not
//! an abort. [`run_tasks_scratch`] also keeps a call from failing half-way through: the calling
//! thread reserves its scratch before any task runs, and a task whose rayon worker cannot grow
//! its own runs on the calling thread afterwards.

use crate::alloc::try_zeros;
use crate::error::Result;
use crate::options::Par;
use std::cell::RefCell;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with at least `len` f32 of this thread's scratch, or fails with
/// [`AttnError::Alloc`](crate::AttnError) if it cannot grow (the thread's buffer is then freed).
/// Not re-entrant (kernels never call back into the safe layer).
pub(crate) fn try_with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < len {
            // The old contents are dead: free them first, so peak memory is the new size only.
            // Zeroed pages from the allocator cost nothing until touched.
            *buf = Vec::new();
            *buf = try_zeros("scratch", len)?;
        }
        // Debug builds (the sanitizer stage's tests) hand out NaN, so a kernel that read
        // scratch it had not written, or a result left unwritten, cannot pass on what a
        // previous call left there. Not under Miri: the fill took its stage 390 → 585 s, and
        // the memory is initialised either way.
        #[cfg(all(debug_assertions, not(miri)))]
        buf[..len].fill(f32::NAN);
        Ok(f(&mut buf[..len]))
    })
}

/// Runs `f(t, scratch)` for `t` in `0..n`, each with `len` floats of scratch, on the rayon pool
/// when [`parallel`](crate::exec::parallel) says so, else in one loop on this thread. Either every task runs, or none
/// does and the error says why: this thread's scratch is grown first, and the tasks of a worker
/// that cannot grow its own are rerun here afterwards.
pub(crate) fn run_tasks_scratch(
    par: Par,
    n: usize,
    work: usize,
    len: usize,
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> Result<()> {
    try_with_scratch(len, |_| ())?;
    #[cfg(feature = "rayon")]
    if crate::exec::parallel(par, n, work) {
        use rayon::prelude::*;
        let refused = std::sync::Mutex::new(Vec::new());
        (0..n).into_par_iter().for_each(|t| {
            if try_with_scratch(len, |s| f(t, s)).is_err() {
                refused.lock().unwrap_or_else(|e| e.into_inner()).push(t);
            }
        });
        let refused = refused.into_inner().unwrap_or_else(|e| e.into_inner());
        return try_with_scratch(len, |s| refused.into_iter().for_each(|t| f(t, s)));
    }
    let _ = (par, work);
    try_with_scratch(len, |s| (0..n).for_each(|t| f(t, s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "asks the allocator for more than a machine has")]
    fn refused_growth_is_an_error() {
        try_with_scratch(8, |s| s.fill(1.0)).unwrap();
        let huge = isize::MAX as usize / 8;
        assert!(try_with_scratch(huge, |_| ()).is_err());
        assert!(run_tasks_scratch(Par::Rayon, 3, usize::MAX, huge, |_, _| unreachable!()).is_err());
        // And the thread's scratch works afterwards.
        assert_eq!(try_with_scratch(8, |s| s.len()).unwrap(), 8);
    }
}
