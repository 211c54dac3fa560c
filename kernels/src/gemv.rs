//! Skinny products `Y = X·Wᵀ` for a few rows of X, the projections of a decode step: every
//! output is the dot product of two contiguous rows, computed in place. A general GEMM packs W
//! on every call, which for one row of X costs several times the product itself.
//!
//! A tile is `R ≤ 2` rows of X by `C ≤ 4` rows of W: `R·C` vector accumulators (8, within the
//! 16 registers of AVX2), each W load shared by the rows and each X load by the columns; four
//! independent chains per row hide the FMA latency. The `k` tail is added in scalar after the
//! lanes are summed.

use crate::simd::Simd;

/// `y[r·ldy + c] = (y[r·ldy + c] if accumulate) + Σ_{p<k} x[r·ldx + p]·w[c·ldw + p]` for
/// `r < m`, `c < n`.
///
/// # Safety
/// The ISA of `S` is enabled; `x` is readable for `m` rows of `k`, `w` for `n` rows of `k`, `y`
/// writable (and readable with `accumulate`) at every `(r, c)`, disjoint from `x` and `w`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows_dot<S: Simd>(
    m: usize,
    k: usize,
    n: usize,
    x: *const f32,
    ldx: usize,
    w: *const f32,
    ldw: usize,
    y: *mut f32,
    ldy: usize,
    accumulate: bool,
) {
    let mut r = 0;
    while r < m {
        let rows = (m - r).min(2);
        let mut c = 0;
        while c < n {
            let cols = if n - c >= 4 { 4 } else { 1 };
            // SAFETY: rows `r..r+rows` and columns `c..c+cols` are inside the extents the
            // caller guarantees.
            unsafe {
                let (xr, wc, yt) = (x.add(r * ldx), w.add(c * ldw), y.add(r * ldy + c));
                match (rows, cols) {
                    (2, 4) => tile::<S, 2, 4>(k, xr, ldx, wc, ldw, yt, ldy, accumulate),
                    (2, _) => tile::<S, 2, 1>(k, xr, ldx, wc, ldw, yt, ldy, accumulate),
                    (_, 4) => tile::<S, 1, 4>(k, xr, ldx, wc, ldw, yt, ldy, accumulate),
                    _ => tile::<S, 1, 1>(k, xr, ldx, wc, ldw, yt, ldy, accumulate),
                }
            }
            c += cols;
        }
        r += rows;
    }
}

/// One `R × C` tile of [`rows_dot`].
///
/// # Safety
/// As [`rows_dot`], for `R` rows of `x` and `C` of `w`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<S: Simd, const R: usize, const C: usize>(
    k: usize,
    x: *const f32,
    ldx: usize,
    w: *const f32,
    ldw: usize,
    y: *mut f32,
    ldy: usize,
    accumulate: bool,
) {
    // SAFETY: every load below reads `p..p+W ≤ k` of a row the caller made readable; the stores
    // write the tile's own outputs.
    unsafe {
        let mut acc = [[S::splat(0.0); C]; R];
        let body = k - k % S::W;
        let mut p = 0;
        while p < body {
            let mut wv = [S::splat(0.0); C];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = S::load(w.add(j * ldw + p));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv = S::load(x.add(i * ldx + p));
                for (a, &v) in row.iter_mut().zip(&wv) {
                    *a = S::fma(xv, v, *a);
                }
            }
            p += S::W;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, &a) in row.iter().enumerate() {
                let mut s = S::hsum(a);
                for q in body..k {
                    s += *x.add(i * ldx + q) * *w.add(j * ldw + q);
                }
                let out = y.add(i * ldy + j);
                *out = if accumulate { *out + s } else { s };
            }
        }
    }
}
