//! `nn.Linear` and the projection GEMM every layer uses: `Y = X·Wᵀ + b` over [`Tokens`] rows,
//! split over rayon tasks by fixed row blocks, and by column blocks when the rows are few.

use super::init::{linear_bound, InitRng};
use super::state_dict::{join, StateDict};
use super::{product, run_tasks, SendConst, SendPtr, Tokens};
use crate::alloc::zeros_for;
use crate::error::{AttnError, Result};
use crate::gemm::{sgemm, Backend};
use crate::options::Par;
use attnkit_kernels::{rows_dot, Isa, SKINNY_ROWS};

/// Rows per projection task. Fixed (never derived from the thread count), so the split, and
/// with it every result, is the same on any pool. Large enough that each task amortises packing
/// the weight matrix (which `matrixmultiply` does once per call).
const ROW_BLOCK: usize = 256;

/// Output columns per task when a call has fewer than [`MIN_TASKS`] row blocks (a short
/// batch, a decode step): without a column split such a call runs on one thread. Fixed like
/// [`ROW_BLOCK`]; the split changes no element's sum (each is still one dot product over `k`
/// in the same order), only which task computes it.
const COL_BLOCK: usize = 256;
const MIN_TASKS: usize = 4;

/// Whether an `m`-row product goes through the packing-free [`rows_dot`] instead of the GEMM:
/// for a few rows with `matrixmultiply`, which packs all of W on every call (a decode step's
/// projections ran 9× slower than through OpenBLAS). OpenBLAS has its own skinny paths.
fn skinny(backend: Backend, m: usize) -> bool {
    backend == Backend::MatrixMultiply && m <= SKINNY_ROWS
}

/// How a layer runs its GEMMs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Exec {
    pub(crate) par: Par,
    pub(crate) backend: Backend,
}

/// `y[b, l, c] = Σ_p x[b, l, p]·w[c·ldw + p] (+ bias[c])` for `c < n`: one GEMM per row block of
/// `x`, rows taken in whichever order makes them a single strided matrix (batch-major or
/// sequence-major), else per batch element. The bias is written first and the GEMM accumulates
/// onto it (`β = 1`), so the add costs no extra pass.
///
/// # Safety
/// * `x` was validated (its buffer covers its view);
/// * `w` holds `n` rows of `k = x.shape[2]` elements with stride `ldw`; `bias` (if any) `n`;
/// * `y` is valid for writes at `b·ys[0] + l·ys[1] + c`, `c < n`, for every `(b, l)` of `x`;
///   these elements are pairwise distinct and overlap neither `x`, `w` nor `bias`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn project(
    exec: Exec,
    x: &Tokens,
    w: &[f32],
    ldw: usize,
    n: usize,
    bias: Option<&[f32]>,
    y: *mut f32,
    ys: [usize; 2],
) {
    let [b, l, k] = x.shape;
    let [xb, xl] = x.addr_strides();
    if b == 0 || l == 0 || n == 0 {
        return;
    }
    debug_assert!(
        n == 0 || w.len() >= (n - 1) * ldw + k,
        "projection weight too short"
    );
    // (matrices, rows per matrix, x matrix stride, x row stride, y matrix stride, y row stride)
    let (mats, rows, xo, xr, yo, yr) = if b == 1 || (xb == l * xl && ys[0] == l * ys[1]) {
        (1, b * l, 0, xl, 0, ys[1])
    } else if l == 1 || (xl == b * xb && ys[1] == b * ys[0]) {
        (1, b * l, 0, xb, 0, ys[0])
    } else {
        (b, l, xb, xl, ys[0], ys[1])
    };
    let blocks = rows.div_ceil(ROW_BLOCK);
    let col_blocks = if mats * blocks >= MIN_TASKS {
        1
    } else {
        n.div_ceil(COL_BLOCK)
    };
    let cols = n.div_ceil(col_blocks);
    let (xp, wp, yp) = (
        SendConst(x.data.as_ptr()),
        SendConst(w.as_ptr()),
        SendPtr(y),
    );
    let work = b.saturating_mul(l).saturating_mul(k).saturating_mul(n);
    // An invalid `ATTNKIT_ISA` is reported by the attention calls; the projection need not fail.
    let isa = Isa::detect().unwrap_or_else(|_| Isa::best());
    run_tasks(exec.par, mats * blocks * col_blocks, work, |t| {
        let (mat, blk, cb) = (
            t / (blocks * col_blocks),
            t / col_blocks % blocks,
            t % col_blocks,
        );
        let (r0, c0) = (blk * ROW_BLOCK, cb * cols);
        let (m, nc) = (ROW_BLOCK.min(rows - r0), cols.min(n - c0));
        // SAFETY: rows `r0..r0+m` of matrix `mat` exist in `x` and `y`, and columns
        // `c0..c0+nc` in `w` (rows of it), `bias` and `y`, per the contract; the tasks' (row,
        // column) ranges are disjoint, so their writes to `y` are too.
        unsafe {
            let a = xp.get().add(mat * xo + r0 * xr);
            let c = yp.get().add(mat * yo + r0 * yr + c0);
            let beta = match bias {
                Some(bias) => {
                    for i in 0..m {
                        core::ptr::copy_nonoverlapping(bias.as_ptr().add(c0), c.add(i * yr), nc);
                    }
                    1.0
                }
                None => 0.0,
            };
            if k == 0 {
                if beta == 0.0 {
                    for i in 0..m {
                        core::slice::from_raw_parts_mut(c.add(i * yr), nc).fill(0.0);
                    }
                }
                return;
            }
            if skinny(exec.backend, m) {
                // SAFETY: as for the GEMM below: `m` rows of `x` (unit column stride), `nc`
                // rows of `w`, the task's own block of `y`.
                return rows_dot(
                    isa,
                    m,
                    k,
                    nc,
                    a,
                    xr,
                    wp.get().add(c0 * ldw),
                    ldw,
                    c,
                    yr,
                    beta != 0.0,
                );
            }
            sgemm(
                exec.backend,
                m,
                k,
                nc,
                1.0,
                a,
                xr as isize,
                1,
                wp.get().add(c0 * ldw),
                1,
                ldw as isize,
                beta,
                c,
                yr as isize,
                1,
            );
        }
    });
}

/// A fully connected layer, `y = x·Wᵀ + b`, with PyTorch's `nn.Linear` layout: `weight` is
/// `(out_features, in_features)` row-major, `bias` `(out_features,)`.
///
/// ```
/// use attnkit::{Linear, Par, Tokens};
/// // y = 2·x + 1 on 3-vectors.
/// let mut w = vec![0.0f32; 9];
/// for i in 0..3 { w[i * 3 + i] = 2.0; }
/// let lin = Linear::new(w, Some(vec![1.0; 3]), 3, 3)?;
/// let x = [1.0f32, 2.0, 3.0];
/// let y = lin.forward(&Tokens::ble(&x, [1, 1, 3]), Par::Seq)?;
/// assert_eq!(y, [3.0, 5.0, 7.0]);
/// # Ok::<(), attnkit::AttnError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    pub(crate) weight: Vec<f32>,
    pub(crate) bias: Option<Vec<f32>>,
    pub(crate) out_features: usize,
    pub(crate) in_features: usize,
}

impl Linear {
    /// From a `(out_features, in_features)` weight and an optional `(out_features,)` bias.
    ///
    /// # Errors
    /// [`AttnError::WeightShape`] if a length disagrees with the dimensions (named `"weight"` /
    /// `"bias"`).
    pub fn new(
        weight: Vec<f32>,
        bias: Option<Vec<f32>>,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self> {
        let needed = product("weight", &[out_features, in_features])?;
        if weight.len() != needed {
            return Err(AttnError::WeightShape {
                name: "weight".into(),
                expected: vec![out_features, in_features],
                got: vec![weight.len()],
            });
        }
        if let Some(b) = &bias {
            if b.len() != out_features {
                return Err(AttnError::WeightShape {
                    name: "bias".into(),
                    expected: vec![out_features],
                    got: vec![b.len()],
                });
            }
        }
        Ok(Linear {
            weight,
            bias,
            out_features,
            in_features,
        })
    }

    /// A fresh `nn.Linear(in_features, out_features, bias)` with PyTorch's default
    /// initialisation: weight and bias uniform in `±1/√in_features`.
    ///
    /// # Errors
    /// [`AttnError::Overflow`] / [`AttnError::Alloc`] for sizes that cannot be held.
    pub fn init(
        in_features: usize,
        out_features: usize,
        bias: bool,
        rng: &mut InitRng,
    ) -> Result<Self> {
        let bound = linear_bound(in_features);
        let weight = rng.uniform_vec("weight", &[out_features, in_features], bound)?;
        let bias = if bias {
            Some(rng.uniform_vec("bias", &[out_features], bound)?)
        } else {
            None
        };
        Self::new(weight, bias, out_features, in_features)
    }

    /// Reads `{prefix}.weight` (any 2-D shape) and, if present, `{prefix}.bias`.
    ///
    /// # Errors
    /// [`AttnError::MissingTensor`] without the weight, [`AttnError::WeightShape`] for a weight
    /// that is not 2-D or a bias that is not `(out_features,)`, [`AttnError::WeightDtype`].
    pub fn from_state_dict(sd: &StateDict, prefix: &str) -> Result<Self> {
        let name = join(prefix, "weight");
        let shape = sd.shape_of(&name)?;
        if shape.len() != 2 {
            let expected = vec![
                shape.first().copied().unwrap_or(0),
                shape.get(1).copied().unwrap_or(0),
            ];
            return Err(AttnError::WeightShape {
                name,
                expected,
                got: shape.to_vec(),
            });
        }
        let (out_features, in_features) = (shape[0], shape[1]);
        let weight = sd.weight(&name, &[out_features, in_features])?;
        let bias = sd.optional_weight(&join(prefix, "bias"), &[out_features])?;
        Ok(Linear {
            weight,
            bias,
            out_features,
            in_features,
        })
    }

    /// Writes `{prefix}.weight` and `{prefix}.bias` (if any) into `sd`.
    pub fn write_state_dict(&self, sd: &mut StateDict, prefix: &str) {
        sd.insert_unchecked(
            join(prefix, "weight"),
            vec![self.out_features, self.in_features],
            &self.weight,
        );
        if let Some(b) = &self.bias {
            sd.insert_unchecked(join(prefix, "bias"), vec![self.out_features], b);
        }
    }

    /// `y = x·Wᵀ + b` for every token, as a dense `(B, L, out_features)` buffer in `x`'s memory
    /// order (`(L, B, out)` for a sequence-first `x`).
    ///
    /// # Errors
    /// [`AttnError::ShapeMismatch`] if `x`'s width is not `in_features` (argument `"x"`),
    /// [`AttnError::BufferLength`] if its buffer is shorter than its view.
    pub fn forward(&self, x: &Tokens, par: Par) -> Result<Vec<f32>> {
        x.validate("x", Some(self.in_features))?;
        let [b, l, _] = x.shape;
        let mut y = zeros_for("y", &[b, l, self.out_features])?;
        let exec = Exec {
            par,
            backend: Backend::default(),
        };
        // SAFETY: `x` validated; the weight is `out × in` dense; `y` is dense `(B, L, out)` in
        // `x`'s order, so every (b, l, c) is a distinct element inside it.
        unsafe {
            project(
                exec,
                x,
                &self.weight,
                self.in_features,
                self.out_features,
                self.bias.as_deref(),
                y.as_mut_ptr(),
                x.dense_strides(self.out_features),
            )
        };
        Ok(y)
    }

    /// `in_features`.
    pub fn in_features(&self) -> usize {
        self.in_features
    }
    /// `out_features`.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
    /// The `(out_features, in_features)` weight, row-major.
    pub fn weight(&self) -> &[f32] {
        &self.weight
    }
    /// The bias, if any.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }
}
