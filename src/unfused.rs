//! The unfused baseline: per head, `S = Q·Kᵀ` with a GEMM, mask, the SIMD row softmax, then
//! `O = P·V` with a GEMM. It materialises one `Lq × Lk` score matrix per thread. Exists to be
//! measured against (and as a second, independent implementation in tests).
//!
//! The GEMMs run on a chosen [`Backend`]: `matrixmultiply`, or the system OpenBLAS with the
//! `blas` feature (single-threaded inside our rayon tasks; see [`sdpa_unfused_with`]).

use crate::error::Result;
use crate::gemm::sgemm;
pub use crate::gemm::Backend;
use crate::options::SdpaOptions;
use crate::plan::{off, Plan};
use crate::scratch::run_tasks_scratch;
use crate::view::{Tensor, TensorMut};
use crate::Extras;
use attnkit_kernels::{apply_scores, softmax_row_with_sink};

/// Same contract, semantics and errors as [`crate::sdpa`], computed the unfused way; tasks are
/// whole (batch, head) pairs. The GEMMs run on [`Backend::default`] (OpenBLAS with the `blas`
/// feature, else `matrixmultiply`).
///
/// # Errors
/// As [`crate::sdpa`].
pub fn sdpa_unfused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut TensorMut,
    opts: &SdpaOptions,
) -> Result<()> {
    sdpa_unfused_with(q, k, v, out, opts, Backend::default())
}

/// [`sdpa_unfused`] with the GEMM library chosen explicitly, so that backends can be compared
/// in one process.
///
/// With `Backend::Blas` (feature `blas`) each of the two GEMMs per head is one `cblas_sgemm` call on the calling
/// rayon worker; OpenBLAS is set to one thread (process-wide, on its first use) so that its own
/// pool does not oversubscribe the cores our tasks already use.
///
/// # Errors
/// As [`crate::sdpa`].
///
/// # Example
/// ```
/// use attnkit::unfused::{sdpa_unfused_with, Backend};
/// use attnkit::{SdpaOptions, Tensor, TensorMut};
/// let shape = [1, 2, 4, 8];
/// let q = vec![0.1f32; 64];
/// let mut out = vec![0.0f32; 64];
/// for &backend in Backend::ALL {
///     let (t, mut o) = (Tensor::bhld(&q, shape), TensorMut::bhld(&mut out, shape));
///     sdpa_unfused_with(&t, &t, &t, &mut o, &SdpaOptions::new(), backend)?;
///     assert!((out[0] - 0.1).abs() < 1e-6);
/// }
/// # Ok::<(), attnkit::AttnError>(())
/// ```
pub fn sdpa_unfused_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &mut TensorMut,
    opts: &SdpaOptions,
    backend: Backend,
) -> Result<()> {
    let plan = Plan::new(q, k, v, out, opts, &mut Extras::default(), None)?;
    let s = plan.shape;
    if s.lq == 0 || s.dv == 0 {
        return Ok(());
    }
    // The score matrix of one head, Lq·Lk floats (saturating: an absurd size is refused).
    let len = s.lq.saturating_mul(s.lk);
    run_tasks_scratch(opts.par, s.b * s.hq, plan.work(), len, |bh, sc| {
        head(&plan, bh, backend, sc)
    })
}

/// Number of `cblas_sgemm` calls made so far by this process (feature `blas`): lets tests prove
/// that [`Backend::Blas`] really reaches BLAS.
#[cfg(feature = "blas")]
#[doc(hidden)]
pub fn blas_calls() -> u64 {
    crate::gemm::blas_calls()
}

/// The kernel set the system OpenBLAS chose for this CPU when it loaded (feature `blas`), e.g.
/// `SkylakeX` or `Haswell`.
///
/// OpenBLAS picks it from the CPU model and falls back to a generic SSE3 set (`Prescott`) on a
/// model it does not know: Debian's 0.3.21 does so on the Xeon VM of BENCHMARKS.md, whose
/// `sgemm` then runs 7× slower than with its AVX-512 kernels. OpenBLAS reads the override,
/// `OPENBLAS_CORETYPE` (e.g. `SkylakeX`), only when it loads, so it must be in the process's
/// environment; `attnbench` sets it and restarts itself when needed.
#[cfg(feature = "blas")]
pub fn blas_core() -> String {
    crate::gemm::blas_core()
}

/// Head `bh` (batch-major) with `sc` of at least `Lq·Lk` floats.
fn head(p: &Plan, bh: usize, backend: Backend, sc: &mut [f32]) {
    let s = p.shape;
    let (b, h) = (bh / s.hq, bh % s.hq);
    let hk = h / (s.hq / s.hkv);
    // SAFETY: offsets and extents were validated by `Plan::new` (the spec's masks cover
    // `Lq` rows of `Lk` keys); this head's output rows are disjoint from every other head's;
    // `sc` holds Lq·Lk elements.
    unsafe {
        let q = p.q.add(off(p.qs, b, h, 0));
        let k = p.k.add(off(p.ks, b, hk, 0));
        let v = p.v.add(off(p.vs, b, hk, 0));
        let o = p.o.add(off(p.os, b, h, 0));
        let (lq, lk, d, dv) = (s.lq, s.lk, s.d, s.dv);
        // S = scale · Q · Kᵀ: Kᵀ is K read with swapped strides.
        sgemm(
            backend,
            lq,
            d,
            lk,
            p.scale,
            q,
            p.qs[2] as isize,
            1,
            k,
            1,
            p.ks[2] as isize,
            0.0,
            sc.as_mut_ptr(),
            lk as isize,
            1,
        );
        let spec = p.spec(b, h, 0);
        let sink = spec.sink.unwrap_or(f32::NEG_INFINITY);
        for i in 0..lq {
            let row = &mut sc[i * lk..(i + 1) * lk];
            apply_scores(p.isa, &spec, i, 0, row);
            softmax_row_with_sink(p.isa, row, sink);
        }
        if lk == 0 {
            for i in 0..lq {
                core::slice::from_raw_parts_mut(o.add(i * p.os[2]), dv).fill(0.0);
            }
            return;
        }
        sgemm(
            backend,
            lq,
            lk,
            dv,
            1.0,
            sc.as_ptr(),
            lk as isize,
            1,
            v,
            p.vs[2] as isize,
            1,
            0.0,
            o,
            p.os[2] as isize,
            1,
        );
    }
}
