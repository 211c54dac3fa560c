//! How calls are executed, shared by sdpa, decode and the layers: ISA resolution, the
//! sequential/parallel decision, and the pointer wrappers that carry disjoint output ranges into
//! rayon tasks.

use crate::error::Result;
use crate::options::Par;
use attnkit_kernels::Isa;

/// Below this many multiply-adds a call (or a layer's phase) runs on the calling thread: a
/// rayon round trip costs more than it saves.
pub(crate) const PAR_MIN_WORK: usize = 1 << 20;

/// The ISA a call runs on: the one asked for (if the CPU has it), else [`Isa::detect`].
pub(crate) fn resolve_isa(isa: Option<Isa>) -> Result<Isa> {
    Ok(match isa {
        Some(isa) => isa.check()?,
        None => Isa::detect()?,
    })
}

/// Whether `n` tasks of `work` multiply-adds in all go to the rayon pool.
pub(crate) fn parallel(par: Par, n: usize, work: usize) -> bool {
    cfg!(feature = "rayon") && par == Par::Rayon && n > 1 && work >= PAR_MIN_WORK
}

/// How many threads a call of `work` multiply-adds split into several tasks runs on: the
/// current rayon pool's, or 1.
pub(crate) fn threads(par: Par, work: usize) -> usize {
    #[cfg(feature = "rayon")]
    if parallel(par, 2, work) {
        return rayon::current_num_threads().max(1);
    }
    let _ = (par, work);
    1
}

/// Runs `f(0..n)` on the current rayon pool, or inline when `par` is `Seq` or the work is small.
/// Callers make the task split depend on the shape only, so results do not depend on threads.
pub(crate) fn run_tasks(par: Par, n: usize, work: usize, f: impl Fn(usize) + Sync + Send) {
    #[cfg(feature = "rayon")]
    if parallel(par, n, work) {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(f);
        return;
    }
    let _ = (par, work);
    (0..n).for_each(f);
}

/// A raw pointer that may cross into rayon tasks; each task writes a disjoint part of the buffer
/// it points into (argued at each use).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T = f32>(pub(crate) *mut T);

impl<T> SendPtr<T> {
    /// The pointer. (A method, so that closures capture the whole `Sync` wrapper rather than
    /// the raw pointer field.)
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: only used to hand disjoint output ranges to tasks that run while the owning buffer is
// mutably borrowed by the caller, which waits for all of them.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SendPtr<T> {}

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
