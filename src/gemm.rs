//! The general matrix multiply behind the unfused baseline (and, later, the layer projections):
//! one `sgemm`, `C ← α·A·B + β·C` over arbitrary row/column strides, run by `matrixmultiply` or,
//! with the `blas` feature, by the system OpenBLAS through `cblas_sgemm`.
//!
//! Threading: parallelism comes from our rayon tasks, each of which runs whole GEMMs. OpenBLAS
//! would otherwise start its own pool of one thread per core inside every one of those tasks and
//! the two pools would oversubscribe the cores, so the first BLAS call sets OpenBLAS to one thread
//! (`openblas_set_num_threads(1)`, process-wide; it overrides `OPENBLAS_NUM_THREADS`). That
//! does not stop the worker threads OpenBLAS started when it loaded: set `OPENBLAS_NUM_THREADS=1`
//! in the environment of a `blas` build, or an idle worker may spin in `sched_yield` on a core
//! (seen on the Xeon VM: the fused kernel, which never calls BLAS, ran 15–25 % slower beside it).
//! `matrixmultiply` is built without its `threading` feature, so it is single-threaded too.

/// Which library multiplies the matrices of the unfused path ([`crate::unfused::sdpa_unfused_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// The pure-Rust `matrixmultiply` crate (always available).
    MatrixMultiply,
    /// The system OpenBLAS through `cblas_sgemm` (feature `blas`). Operands whose strides BLAS
    /// cannot express (neither the row nor the column stride is 1) and empty products fall back
    /// to `matrixmultiply`. Its speed depends on the kernel set OpenBLAS picked for the CPU: see
    /// [`crate::unfused::blas_core`].
    #[cfg(feature = "blas")]
    Blas,
}

impl Default for Backend {
    /// `Backend::Blas` when the `blas` feature is on, else [`Backend::MatrixMultiply`].
    fn default() -> Self {
        #[cfg(feature = "blas")]
        return Backend::Blas;
        #[cfg(not(feature = "blas"))]
        return Backend::MatrixMultiply;
    }
}

impl Backend {
    /// Every backend this build has.
    pub const ALL: &'static [Backend] = &[
        Backend::MatrixMultiply,
        #[cfg(feature = "blas")]
        Backend::Blas,
    ];

    /// Short name: `mm` or `blas`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::MatrixMultiply => "mm",
            #[cfg(feature = "blas")]
            Backend::Blas => "blas",
        }
    }
}

/// `C ← α·A·B + β·C` with `A` `m × k`, `B` `k × n`, `C` `m × n`; element `(i, j)` of a matrix
/// `X` with strides `(rs, cs)` is at `x + i·rs + j·cs`. With `β = 0`, `C` is not read (it may hold
/// NaN). Same argument order as `matrixmultiply::sgemm`.
///
/// # Safety
/// * `a` is valid for reads at every `(i, p)`, `i < m`, `p < k`; `b` at every `(p, j)`, `p < k`,
///   `j < n`; `c` for reads and writes at every `(i, j)`, `i < m`, `j < n`;
/// * no two elements of `C` share memory, and `C` overlaps neither `A` nor `B`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm(
    backend: Backend,
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: *const f32,
    rsa: isize,
    csa: isize,
    b: *const f32,
    rsb: isize,
    csb: isize,
    beta: f32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    match backend {
        Backend::MatrixMultiply => {}
        #[cfg(feature = "blas")]
        Backend::Blas => {
            // SAFETY: forwarded contract.
            if unsafe {
                blas::try_sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
            } {
                return;
            }
        }
    }
    // SAFETY: forwarded contract (matrixmultiply documents the same one).
    unsafe { matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
}

/// Number of `cblas_sgemm` calls this process has made (tests use it to prove that the BLAS path
/// is really taken).
#[cfg(feature = "blas")]
pub fn blas_calls() -> u64 {
    blas::CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(feature = "blas")]
pub(crate) use blas::core_name as blas_core;

#[cfg(feature = "blas")]
mod blas {
    use cblas_sys::{cblas_sgemm, CBLAS_LAYOUT, CBLAS_TRANSPOSE};
    use std::os::raw::c_int;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Once;

    pub(super) static CALLS: AtomicU64 = AtomicU64::new(0);

    extern "C" {
        /// OpenBLAS extension (not CBLAS): the number of threads OpenBLAS itself uses.
        fn openblas_set_num_threads(n: c_int);
        /// OpenBLAS extension: the name of the kernel set chosen when the library loaded.
        fn openblas_get_corename() -> *const std::os::raw::c_char;
    }

    /// The kernel set OpenBLAS picked when it loaded (`openblas_get_corename`), e.g. `SkylakeX`.
    pub(crate) fn core_name() -> String {
        // SAFETY: OpenBLAS returns a pointer to a static NUL-terminated string (never null).
        unsafe { std::ffi::CStr::from_ptr(openblas_get_corename()) }
            .to_string_lossy()
            .into_owned()
    }

    /// One operand as CBLAS sees it in row-major order: transposed or not, leading dimension.
    /// `None` when the strides are not expressible (neither stride is 1, a negative stride, or a
    /// leading dimension too small or too large for `c_int`). A stride along a dimension of
    /// extent ≤ 1 is never used, so it is replaced by a valid one first.
    fn operand(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<(CBLAS_TRANSPOSE, c_int)> {
        let fits = |ld: isize, min: usize| ld >= min.max(1) as isize && c_int::try_from(ld).is_ok();
        // Row-major: unit column stride, leading dimension = row stride.
        let (r, c) = (
            if rows <= 1 { cols.max(1) as isize } else { rs },
            if cols <= 1 { 1 } else { cs },
        );
        if c == 1 && fits(r, cols) {
            return Some((CBLAS_TRANSPOSE::CblasNoTrans, r as c_int));
        }
        // Column-major = the transpose stored row-major: unit row stride, ld = column stride.
        let (r, c) = (
            if rows <= 1 { 1 } else { rs },
            if cols <= 1 { rows.max(1) as isize } else { cs },
        );
        if r == 1 && fits(c, rows) {
            return Some((CBLAS_TRANSPOSE::CblasTrans, c as c_int));
        }
        None
    }

    /// Runs the product through `cblas_sgemm` if BLAS can express it; returns whether it did.
    ///
    /// # Safety
    /// The contract of [`super::sgemm`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn try_sgemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: *const f32,
        rsa: isize,
        csa: isize,
        b: *const f32,
        rsb: isize,
        csb: isize,
        beta: f32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
    ) -> bool {
        if m == 0 || n == 0 || k == 0 {
            return false;
        }
        let dims = (c_int::try_from(m), c_int::try_from(k), c_int::try_from(n));
        let (Ok(mi), Ok(ki), Ok(ni)) = dims else {
            return false;
        };
        // CBLAS row-major needs C with unit column stride; a C with unit row stride is Cᵀ
        // row-major, and Cᵀ = Bᵀ·Aᵀ: swap the operands and transpose each.
        let (mi, ni, a, rsa, csa, b, rsb, csb, rsc) = match operand(m, n, rsc, csc) {
            Some((CBLAS_TRANSPOSE::CblasNoTrans, _)) => (mi, ni, a, rsa, csa, b, rsb, csb, rsc),
            Some(_) => (ni, mi, b, csb, rsb, a, csa, rsa, csc),
            None => return false,
        };
        let (m, n) = (mi as usize, ni as usize);
        let ldc = if m <= 1 { n.max(1) as isize } else { rsc };
        if ldc < n.max(1) as isize || c_int::try_from(ldc).is_err() {
            return false;
        }
        let (Some((ta, lda)), Some((tb, ldb))) = (operand(m, k, rsa, csa), operand(k, n, rsb, csb))
        else {
            return false;
        };
        static THREADS: Once = Once::new();
        // SAFETY: a plain setter of OpenBLAS's global thread count; no pointers involved.
        THREADS.call_once(|| unsafe { openblas_set_num_threads(1) });
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the layouts above describe exactly the elements the caller guarantees valid
        // (`operand` only accepts strides that address them); C is disjoint from A and B.
        unsafe {
            cblas_sgemm(
                CBLAS_LAYOUT::CblasRowMajor,
                ta,
                tb,
                mi,
                ni,
                ki,
                alpha,
                a,
                lda,
                b,
                ldb,
                beta,
                c,
                ldc as c_int,
            )
        };
        true
    }
}

#[cfg(all(test, feature = "blas"))]
mod tests {
    use super::*;

    /// Every stride combination BLAS can take (row- and column-major A, B, C; extents of 1 with
    /// arbitrary strides) goes to BLAS and agrees with matrixmultiply; the others fall back.
    #[test]
    fn blas_layouts_match_matrixmultiply() {
        let (m, k, n) = (5, 7, 3);
        // (rows, cols) of each matrix stored row-major (ld = cols + 2) or column-major (ld = rows + 1).
        let strides = |rows: usize, cols: usize, col_major: bool| -> (isize, isize, usize) {
            if col_major {
                (1, rows as isize + 1, (rows + 1) * cols)
            } else {
                (cols as isize + 2, 1, (cols + 2) * rows)
            }
        };
        for bits in 0..8 {
            let (rsa, csa, la) = strides(m, k, bits & 1 != 0);
            let (rsb, csb, lb) = strides(k, n, bits & 2 != 0);
            let (rsc, csc, lc) = strides(m, n, bits & 4 != 0);
            let a: Vec<f32> = (0..la).map(|i| (i % 7) as f32 - 3.0).collect();
            let b: Vec<f32> = (0..lb).map(|i| (i % 5) as f32 - 2.0).collect();
            let mut want = vec![1.0f32; lc];
            let mut got = want.clone();
            let before = blas_calls();
            // SAFETY: the strides address elements inside the buffers, which do not overlap.
            unsafe {
                sgemm(
                    Backend::MatrixMultiply,
                    m,
                    k,
                    n,
                    0.5,
                    a.as_ptr(),
                    rsa,
                    csa,
                    b.as_ptr(),
                    rsb,
                    csb,
                    2.0,
                    want.as_mut_ptr(),
                    rsc,
                    csc,
                );
                sgemm(
                    Backend::Blas,
                    m,
                    k,
                    n,
                    0.5,
                    a.as_ptr(),
                    rsa,
                    csa,
                    b.as_ptr(),
                    rsb,
                    csb,
                    2.0,
                    got.as_mut_ptr(),
                    rsc,
                    csc,
                );
            }
            assert!(
                blas_calls() > before,
                "layout {bits:03b} did not reach BLAS"
            );
            // Small integers: exact in f32 either way.
            assert_eq!(got, want, "layout {bits:03b}");
        }
    }

    #[test]
    fn vector_shapes_with_any_stride_and_fallbacks() {
        // m = 1: the row stride of A and C is never used, even when it is 0.
        let a = [1.0f32, 2.0, 3.0];
        let b = [1.0f32, 0.0, 2.0, 1.0, 0.0, 3.0];
        let mut c = [f32::NAN; 2];
        // SAFETY: A is 1×3 (cs 1), B is 3×2 row-major, C is 1×2; β = 0 so C is not read.
        unsafe {
            sgemm(
                Backend::Blas,
                1,
                3,
                2,
                1.0,
                a.as_ptr(),
                0,
                1,
                b.as_ptr(),
                2,
                1,
                0.0,
                c.as_mut_ptr(),
                0,
                1,
            )
        };
        assert_eq!(c, [5.0, 11.0]);
        // Neither stride of A is 1: BLAS cannot express it; matrixmultiply does it.
        let a2 = [1.0f32, 9.0, 2.0, 9.0, 3.0, 9.0];
        let mut c2 = [0.0f32; 2];
        // SAFETY: A is 1×3 with column stride 2 inside a2.
        unsafe {
            sgemm(
                Backend::Blas,
                1,
                3,
                2,
                1.0,
                a2.as_ptr(),
                0,
                2,
                b.as_ptr(),
                2,
                1,
                0.0,
                c2.as_mut_ptr(),
                0,
                1,
            )
        };
        assert_eq!(c2, [5.0, 11.0]);
        // k = 0: C ← β·C.
        let mut c3 = [2.0f32; 2];
        // SAFETY: no element of A or B is read when k = 0.
        unsafe {
            sgemm(
                Backend::Blas,
                1,
                0,
                2,
                1.0,
                a.as_ptr(),
                0,
                1,
                b.as_ptr(),
                2,
                1,
                0.5,
                c3.as_mut_ptr(),
                0,
                1,
            )
        };
        assert_eq!(c3, [1.0, 1.0]);
    }
}
