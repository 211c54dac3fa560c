//! Additive (Bahdanau) attention over the fused kernel `attnkit_kernels::additive_forward`.

use super::init::{linear_bound, InitRng};
use super::linear::{project, Exec};
use super::state_dict::{join, StateDict};
use super::{check_qkv, product, run_tasks, SendConst, SendPtr, Tokens};
use crate::alloc::zeros_for;
use crate::error::{AttnError, Result};
use crate::gemm::{sgemm, Backend};
use crate::options::{AttnMask, Par};
use crate::scratch::run_tasks_scratch;
use attnkit_kernels::{
    additive_forward, additive_scratch_len, AdditiveArgs, Isa, ScoreSpec, ADDITIVE_KEY_PAD,
};
#[cfg(feature = "safetensors")]
use std::path::Path;

/// Query rows per attention task (one batch element each). Fixed, so results do not depend on
/// the thread count.
const Q_BLOCK: usize = 16;

/// Key columns per task of the key projection.
const K_BLOCK: usize = 256;

/// Options of an [`AdditiveAttention`] forward pass.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct AdditiveOptions<'a> {
    /// A mask in the crate's SDPA polarity (bool `true` = *attend*, or an additive bias), with
    /// shape `(1|B, 1, 1|Lq, Lk)` (see [`crate::MaskRef`]).
    pub mask: Option<AttnMask<'a>>,
    /// Valid key count per batch element (`valid_lens` of the d2l formulation): keys
    /// `j ≥ key_lengths[b]` are masked and never read.
    pub key_lengths: Option<&'a [usize]>,
    /// Return the attention weights `(B, Lq, Lk)`.
    pub need_weights: bool,
    /// Return the scores the softmax sees `(B, Lq, Lk)` (`−inf` where masked).
    pub need_scores: bool,
    /// Instruction set; `None` = [`Isa::detect`].
    pub isa: Option<Isa>,
    /// Threading.
    pub par: Par,
    /// GEMM library of the projections.
    pub backend: Backend,
}

impl<'a> AdditiveOptions<'a> {
    /// Defaults: no mask, no extra outputs, best ISA, rayon.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets the mask (`true` = attend, or additive).
    pub fn mask(mut self, mask: AttnMask<'a>) -> Self {
        self.mask = Some(mask);
        self
    }
    /// Sets the valid key counts.
    pub fn key_lengths(mut self, lens: &'a [usize]) -> Self {
        self.key_lengths = Some(lens);
        self
    }
    /// Asks for the weights and/or the scores.
    pub fn outputs(mut self, weights: bool, scores: bool) -> Self {
        self.need_weights = weights;
        self.need_scores = scores;
        self
    }
    /// Forces an instruction set.
    pub fn isa(mut self, isa: Isa) -> Self {
        self.isa = Some(isa);
        self
    }
    /// Sets threading.
    pub fn par(mut self, par: Par) -> Self {
        self.par = par;
        self
    }
    /// Sets the GEMM library.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
}

/// What [`AdditiveAttention::forward`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct AdditiveOutput {
    /// `(B, Lq, Dv)`, dense, in the query's memory order (`(Lq, B, Dv)` if sequence-first).
    pub out: Vec<f32>,
    /// Shape of `out` in its memory order.
    pub shape: [usize; 3],
    /// `(B, Lq, Lk)` attention weights, if asked.
    pub weights: Option<Vec<f32>>,
    /// `(B, Lq, Lk)` scores, if asked.
    pub scores: Option<Vec<f32>>,
}

/// Additive (Bahdanau) attention:
/// `score(q, k) = vᵀ·tanh(W_q·q + W_k·k + b)`, `weights = softmax_k(score)` (with masks and key
/// lengths), `out = weights·V`.
///
/// Shapes: `W_q` `(A, Dq)`, `W_k` `(A, Dk)`, `b` and `v` `(A,)`; queries `(B, Lq, Dq)`, keys
/// `(B, Lk, Dk)`, values `(B, Lk, Dv)`.
///
/// **The concat form.** Bahdanau et al. write the score as `vᵀ·tanh(W·[q; k] + b)` with one
/// `Linear(Dq + Dk → A)` on the concatenation. Splitting `W = [W_q | W_k]` by columns gives
/// `W·[q; k] = W_q·q + W_k·k`, so the two are the same function
/// ([`AdditiveAttention::from_concat`] does the split). The split form is what makes it cheap:
/// each query and each key is projected once, `(Lq·Dq + Lk·Dk)·A` multiply-adds by GEMM, instead
/// of projecting every `(q, k)` pair, `Lq·Lk·(Dq + Dk)·A`.
///
/// **The fused kernel.** After the two GEMMs (`q′ = W_q·q + b`, and `k′ = W_k·k` written
/// transposed, `A × Lk`), each query row streams the keys in blocks: `Σ_a v_a·tanh(q′_a + k′_a)`
/// for a vector of keys at a time with a vectorised tanh (≤ 5.4 ulp, see
/// [`crate::kernels::tanh_slice`]), an online softmax, and the weighted sum of the values. The
/// `(Lq, Lk, A)` tensor of the textbook formulation never exists (nor `(Lq, Lk)`, unless the
/// weights or scores are asked for).
///
/// A query whose keys are all masked gets a zero output row and zero weights.
///
/// State dict names (the d2l `AdditiveAttention` module): `W_q.weight` `(A, Dq)`, `W_k.weight`
/// `(A, Dk)`, `w_v.weight` `(1, A)`, and optionally `W_q.bias` / `W_k.bias` `(A,)` (both are added
/// inside the tanh, so either can hold `b`). A `w_v.bias` is ignored: it shifts every score of a
/// row equally and cancels in the softmax.
///
/// ```
/// use attnkit::{AdditiveAttention, AdditiveDims, AdditiveOptions, AdditiveWeights, Tokens};
/// let (a, dq, dk) = (4, 3, 2);
/// let (w_q, w_k, v) = (vec![0.1; a * dq], vec![0.2; a * dk], vec![1.0; a]);
/// let dims = AdditiveDims { attn_dim: a, query_dim: dq, key_dim: dk };
/// let layer = AdditiveAttention::new(&AdditiveWeights { dims, w_q: &w_q, w_k: &w_k, bias: None, v: &v })?;
/// let (q, k, v) = (vec![1.0f32; 2 * dq], vec![0.5f32; 3 * dk], vec![2.0f32; 3 * 5]);
/// let y = layer.forward(
///     &Tokens::ble(&q, [1, 2, dq]),
///     &Tokens::ble(&k, [1, 3, dk]),
///     &Tokens::ble(&v, [1, 3, 5]),
///     &AdditiveOptions::new(),
/// )?;
/// assert_eq!(y.shape, [1, 2, 5]);
/// assert!(y.out.iter().all(|&x| (x - 2.0).abs() < 1e-6)); // equal values: any weights give 2
/// # Ok::<(), attnkit::AttnError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct AdditiveAttention {
    a: usize,
    dq: usize,
    dk: usize,
    pub(super) w_q: Vec<f32>,
    pub(super) w_k: Vec<f32>,
    b_q: Option<Vec<f32>>,
    b_k: Option<Vec<f32>>,
    /// `b_q + b_k`, added to the query projection.
    pub(super) bias: Option<Vec<f32>>,
    pub(super) v: Vec<f32>,
}

fn check_len(name: &str, data: &[f32], shape: &[usize]) -> Result<()> {
    let n = shape.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
    if n != Some(data.len()) {
        return Err(AttnError::WeightShape {
            name: name.into(),
            expected: shape.to_vec(),
            got: vec![data.len()],
        });
    }
    Ok(())
}

/// The sizes of an [`AdditiveAttention`]: `A` (the attention width), `Dq`, `Dk`. Named fields,
/// so no call passes three sizes in a row by position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdditiveDims {
    /// `A`: the width of the projections inside the tanh.
    pub attn_dim: usize,
    /// `Dq`: the width of the queries.
    pub query_dim: usize,
    /// `Dk`: the width of the keys.
    pub key_dim: usize,
}

/// Borrowed weights of an [`AdditiveAttention`], row-major; the layer copies them.
#[derive(Clone, Copy, Debug)]
pub struct AdditiveWeights<'a> {
    /// `A`, `Dq`, `Dk`.
    pub dims: AdditiveDims,
    /// `W_q` `(A, Dq)`.
    pub w_q: &'a [f32],
    /// `W_k` `(A, Dk)`.
    pub w_k: &'a [f32],
    /// `b` `(A,)`, added inside the tanh; `None` for none.
    pub bias: Option<&'a [f32]>,
    /// `v` `(A,)`.
    pub v: &'a [f32],
}

impl AdditiveAttention {
    /// From its weights.
    ///
    /// # Errors
    /// [`AttnError::WeightShape`] naming `W_q`, `W_k`, `b` or `v` for a length that does not
    /// match; [`AttnError::Config`] for `A = 0`.
    pub fn new(w: &AdditiveWeights) -> Result<Self> {
        let AdditiveDims {
            attn_dim,
            query_dim,
            key_dim,
        } = w.dims;
        Self::build(
            w.w_q.to_vec(),
            w.w_k.to_vec(),
            w.bias.map(<[f32]>::to_vec),
            None,
            w.v.to_vec(),
            attn_dim,
            query_dim,
            key_dim,
        )
    }

    /// With PyTorch's default initialisation of the d2l module's `nn.Linear` layers: every weight
    /// (and the bias, if asked for) uniform in `±1/√fan_in` (`W_q`: `Dq`, `W_k`: `Dk`, `v`: `A`).
    ///
    /// # Errors
    /// As [`AdditiveAttention::new`]; [`AttnError::Overflow`] / [`AttnError::Alloc`] for sizes
    /// that cannot be held.
    pub fn init(dims: AdditiveDims, bias: bool, rng: &mut InitRng) -> Result<Self> {
        let AdditiveDims {
            attn_dim: a,
            query_dim: dq,
            key_dim: dk,
        } = dims;
        let w_q = rng.uniform_vec("W_q", &[a, dq], linear_bound(dq))?;
        let w_k = rng.uniform_vec("W_k", &[a, dk], linear_bound(dk))?;
        let b = if bias {
            Some(rng.uniform_vec("b", &[a], linear_bound(dq))?)
        } else {
            None
        };
        let v = rng.uniform_vec("v", &[a], linear_bound(a))?;
        Self::build(w_q, w_k, b, None, v, a, dq, dk)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        w_q: Vec<f32>,
        w_k: Vec<f32>,
        b_q: Option<Vec<f32>>,
        b_k: Option<Vec<f32>>,
        v: Vec<f32>,
        a: usize,
        dq: usize,
        dk: usize,
    ) -> Result<Self> {
        if a == 0 {
            return Err(AttnError::Config {
                arg: "attn_dim",
                value: 0,
                reason: "must be positive".into(),
            });
        }
        check_len("W_q", &w_q, &[a, dq])?;
        check_len("W_k", &w_k, &[a, dk])?;
        if let Some(b) = &b_q {
            check_len("b", b, &[a])?;
        }
        if let Some(b) = &b_k {
            check_len("W_k.bias", b, &[a])?;
        }
        check_len("v", &v, &[a])?;
        let bias = match (&b_q, &b_k) {
            (None, None) => None,
            (Some(x), None) | (None, Some(x)) => Some(x.clone()),
            (Some(x), Some(y)) => Some(x.iter().zip(y).map(|(a, b)| a + b).collect()),
        };
        Ok(AdditiveAttention {
            a,
            dq,
            dk,
            w_q,
            w_k,
            b_q,
            b_k,
            bias,
            v,
        })
    }

    /// From the textbook concat form: `w` `(A, Dq + Dk)` applied to `[q; k]`, bias `b`, vector
    /// `v`. Columns `[0, Dq)` become `W_q`, the rest `W_k`.
    ///
    /// # Errors
    /// As [`AdditiveAttention::new`] (the concatenated weight is named `W`).
    pub fn from_concat(
        dims: AdditiveDims,
        w: &[f32],
        bias: Option<&[f32]>,
        v: &[f32],
    ) -> Result<Self> {
        let AdditiveDims {
            attn_dim,
            query_dim,
            key_dim,
        } = dims;
        let cols = query_dim
            .checked_add(key_dim)
            .ok_or(AttnError::Overflow { arg: "W" })?;
        check_len("W", w, &[attn_dim, cols])?;
        let (mut w_q, mut w_k) = (Vec::new(), Vec::new());
        for row in w.chunks_exact(cols.max(1)).take(attn_dim) {
            w_q.extend_from_slice(&row[..query_dim]);
            w_k.extend_from_slice(&row[query_dim..]);
        }
        Self::new(&AdditiveWeights {
            dims,
            w_q: &w_q,
            w_k: &w_k,
            bias,
            v,
        })
    }

    /// Reads `{prefix}.W_q.weight`, `{prefix}.W_k.weight`, `{prefix}.w_v.weight` (`(1, A)` or
    /// `(A,)`) and the optional biases `W_q.bias`, `W_k.bias`.
    ///
    /// # Errors
    /// [`AttnError::MissingTensor`], [`AttnError::WeightShape`] (expected and found shapes),
    /// [`AttnError::WeightDtype`], naming the tensor.
    pub fn from_state_dict(sd: &StateDict, prefix: &str) -> Result<Self> {
        let wq_name = join(prefix, "W_q.weight");
        let wq_shape = sd.shape_of(&wq_name)?.to_vec();
        if wq_shape.len() != 2 {
            let expected = vec![
                wq_shape.first().copied().unwrap_or(0),
                wq_shape.get(1).copied().unwrap_or(0),
            ];
            return Err(AttnError::WeightShape {
                name: wq_name,
                expected,
                got: wq_shape,
            });
        }
        let (a, dq) = (wq_shape[0], wq_shape[1]);
        let wk_name = join(prefix, "W_k.weight");
        let dk = match sd.shape_of(&wk_name)? {
            [rows, cols] if *rows == a => *cols,
            other => {
                let expected = vec![a, other.get(1).copied().unwrap_or(0)];
                return Err(AttnError::WeightShape {
                    name: wk_name,
                    expected,
                    got: other.to_vec(),
                });
            }
        };
        let w_q = sd.weight(&wq_name, &[a, dq])?;
        let w_k = sd.weight(&wk_name, &[a, dk])?;
        let v_name = join(prefix, "w_v.weight");
        let v = if sd.shape(&v_name) == Some(&[a][..]) {
            sd.weight(&v_name, &[a])?
        } else {
            sd.weight(&v_name, &[1, a])?
        };
        let b_q = sd.optional_weight(&join(prefix, "W_q.bias"), &[a])?;
        let b_k = sd.optional_weight(&join(prefix, "W_k.bias"), &[a])?;
        Self::build(w_q, w_k, b_q, b_k, v, a, dq, dk)
    }

    #[cfg(feature = "safetensors")]
    /// [`AdditiveAttention::from_state_dict`] on a `.safetensors` file.
    ///
    /// # Errors
    /// [`AttnError::Checkpoint`] if the file cannot be read, else as `from_state_dict`.
    pub fn load(path: impl AsRef<Path>, prefix: &str) -> Result<Self> {
        Self::from_state_dict(&StateDict::load(path)?, prefix)
    }

    /// The weights under the names [`AdditiveAttention::from_state_dict`] reads (`w_v.weight`
    /// as `(1, A)`; the bias given to [`AdditiveAttention::new`] as `W_q.bias`).
    pub fn state_dict(&self, prefix: &str) -> StateDict {
        let mut sd = StateDict::new();
        sd.insert_unchecked(join(prefix, "W_q.weight"), vec![self.a, self.dq], &self.w_q);
        sd.insert_unchecked(join(prefix, "W_k.weight"), vec![self.a, self.dk], &self.w_k);
        sd.insert_unchecked(join(prefix, "w_v.weight"), vec![1, self.a], &self.v);
        if let Some(b) = &self.b_q {
            sd.insert_unchecked(join(prefix, "W_q.bias"), vec![self.a], b);
        }
        if let Some(b) = &self.b_k {
            sd.insert_unchecked(join(prefix, "W_k.bias"), vec![self.a], b);
        }
        sd
    }

    /// A holder of gradients shaped as `like`: each parameter's gradient in its place, and the
    /// shared bias gradient `db` under each bias `like` has (both enter the same sum).
    pub(super) fn from_grads(
        like: &Self,
        w_q: Vec<f32>,
        w_k: Vec<f32>,
        db: Vec<f32>,
        v: Vec<f32>,
    ) -> Self {
        AdditiveAttention {
            a: like.a,
            dq: like.dq,
            dk: like.dk,
            w_q,
            w_k,
            b_q: like.b_q.as_ref().map(|_| db.clone()),
            b_k: like.b_k.as_ref().map(|_| db.clone()),
            bias: None,
            v,
        }
    }

    /// `(A, Dq, Dk)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.a, self.dq, self.dk)
    }

    /// The forward pass: queries `(B, Lq, Dq)`, keys `(B, Lk, Dk)`, values `(B, Lk, Dv)`.
    ///
    /// # Errors
    /// [`AttnError`] naming the argument: widths other than `Dq`/`Dk`, batch sizes or key/value
    /// lengths that differ, buffers shorter than their views, a mask whose shape is not
    /// `(1|B, 1, 1|Lq, Lk)` ([`AttnError::InputShape`]), key lengths `> Lk` or not `B` of them, an
    /// unsupported ISA.
    pub fn forward(
        &self,
        queries: &Tokens,
        keys: &Tokens,
        values: &Tokens,
        opts: &AdditiveOptions,
    ) -> Result<AdditiveOutput> {
        self.check_inputs(queries, keys, values)?;
        let [b, lq, _] = queries.shape;
        let (lk, dv) = (keys.shape[1], values.shape[2]);
        let mut out = zeros_for("out", &[b, lq, dv])?;
        let shape = if queries.is_seq_first() {
            [lq, b, dv]
        } else {
            [b, lq, dv]
        };
        let dims = [b, lq, lk];
        let need = |yes: bool, arg| yes.then(|| zeros_for(arg, &dims)).transpose();
        let mut weights = need(opts.need_weights, "weights")?;
        let mut scores = need(opts.need_scores, "scores")?;
        self.forward_into(
            queries,
            keys,
            values,
            &mut out,
            weights.as_deref_mut(),
            scores.as_deref_mut(),
            opts,
        )?;
        Ok(AdditiveOutput {
            out,
            shape,
            weights,
            scores,
        })
    }

    fn check_inputs(&self, queries: &Tokens, keys: &Tokens, values: &Tokens) -> Result<()> {
        check_qkv(
            ["queries", "keys", "values"],
            [queries, keys, values],
            [Some(self.dq), Some(self.dk), None],
        )
    }

    /// [`AdditiveAttention::forward`] into caller buffers: `out` dense in the query's memory
    /// order, `weights` and `scores` dense `(B, Lq, Lk)` if given (`opts.need_*` are ignored).
    ///
    /// # Errors
    /// As `forward`, plus wrong buffer lengths ([`AttnError::BufferLength`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into(
        &self,
        queries: &Tokens,
        keys: &Tokens,
        values: &Tokens,
        out: &mut [f32],
        weights: Option<&mut [f32]>,
        scores: Option<&mut [f32]>,
        opts: &AdditiveOptions,
    ) -> Result<()> {
        let isa = crate::exec::resolve_isa(opts.isa)?;
        self.check_inputs(queries, keys, values)?;
        let [b, lq, _] = queries.shape;
        let (lk, dv, a) = (keys.shape[1], values.shape[2], self.a);
        let needed = product("out", &[b, lq, dv])?;
        if out.len() != needed {
            return Err(AttnError::BufferLength {
                arg: "out",
                needed,
                got: out.len(),
            });
        }
        let nw = product("weights", &[b, lq, lk])?;
        for (arg, buf) in [("weights", &weights), ("scores", &scores)] {
            if let Some(w) = buf {
                if w.len() != nw {
                    return Err(AttnError::BufferLength {
                        arg,
                        needed: nw,
                        got: w.len(),
                    });
                }
            }
        }
        // Mask: (1|B, 1, 1|Lq, Lk) dense; broadcast strides.
        let (mut bias_p, mut mask_p) = (
            (SendConst(core::ptr::null::<f32>()), [0usize; 2]),
            (SendConst(core::ptr::null::<u8>()), [0usize; 2]),
        );
        if let Some(m) = opts.mask {
            let (shape, len) = match m {
                AttnMask::Bool(r) => (r.shape, r.data.len()),
                AttnMask::Bytes(r) => (r.shape, r.data.len()),
                AttnMask::Bias(r) => (r.shape, r.data.len()),
            };
            let [mb, mh, mq, mk] = shape;
            if !((mb == 1 || mb == b) && mh == 1 && (mq == 1 || mq == lq) && mk == lk) {
                return Err(AttnError::InputShape {
                    arg: "mask",
                    expected: vec![b, 1, lq, lk],
                    got: shape.to_vec(),
                });
            }
            let needed = product("mask", &shape)?;
            if len != needed {
                return Err(AttnError::BufferLength {
                    arg: "mask",
                    needed,
                    got: len,
                });
            }
            let st = [
                if mb == 1 { 0 } else { mq * mk },
                if mq == 1 { 0 } else { mk },
            ];
            match m {
                AttnMask::Bool(r) => mask_p = (SendConst(r.as_bytes().data.as_ptr()), st),
                AttnMask::Bytes(r) => mask_p = (SendConst(r.data.as_ptr()), st),
                AttnMask::Bias(r) => bias_p = (SendConst(r.data.as_ptr()), st),
            }
        }
        if let Some(lens) = opts.key_lengths {
            if lens.len() != b {
                return Err(AttnError::InputShape {
                    arg: "key_lengths",
                    expected: vec![b],
                    got: vec![lens.len()],
                });
            }
            if let Some((batch, &len)) = lens.iter().enumerate().find(|(_, &l)| l > lk) {
                return Err(AttnError::KeyLength { batch, len, lk });
            }
        }
        let exec = Exec {
            par: opts.par,
            backend: opts.backend,
        };

        // q′ = queries·W_qᵀ + b, dense (B, Lq, A).
        let mut qp = zeros_for("queries", &[b, lq, a])?;
        // SAFETY: `queries` validated with width Dq; `w_q` is `A × Dq`; `qp` is dense (B, Lq, A).
        unsafe {
            project(
                exec,
                queries,
                &self.w_q,
                self.dq,
                a,
                self.bias.as_deref(),
                qp.as_mut_ptr(),
                [lq * a, a],
            )
        };

        // k′ᵀ per batch element: (A, ldkt), zero padding columns.
        let ldkt = lk
            .checked_next_multiple_of(ADDITIVE_KEY_PAD)
            .ok_or(AttnError::Overflow { arg: "keys" })?;
        let per_b = product("keys", &[a, ldkt])?;
        let mut kt = zeros_for("keys", &[b, per_b])?;
        if self.dk > 0 && lk > 0 {
            let kblocks = lk.div_ceil(K_BLOCK);
            let (kp, wk, ktp) = (
                SendConst(keys.data.as_ptr()),
                SendConst(self.w_k.as_ptr()),
                SendPtr(kt.as_mut_ptr()),
            );
            let [ksb, ksl] = keys.addr_strides();
            let dk = self.dk;
            run_tasks(exec.par, b * kblocks, b * lk * dk * a, |t| {
                let (bi, j0) = (t / kblocks, (t % kblocks) * K_BLOCK);
                let nc = K_BLOCK.min(lk - j0);
                // SAFETY: keys (bi, j0..j0+nc, ·) are inside the validated view; `w_k` is A × Dk;
                // each task writes its own column block of its own batch element's k′ᵀ.
                unsafe {
                    sgemm(
                        exec.backend,
                        a,
                        dk,
                        nc,
                        1.0,
                        wk.get(),
                        dk as isize,
                        1,
                        kp.get().add(bi * ksb + j0 * ksl),
                        1,
                        ksl as isize,
                        0.0,
                        ktp.get().add(bi * per_b + j0),
                        ldkt as isize,
                        1,
                    )
                };
            });
        }

        // Attention: tasks of (batch element, query block).
        let os = queries.dense_strides(dv);
        let qblocks = lq.div_ceil(Q_BLOCK);
        let [vsb, vsl] = values.addr_strides();
        let ptrs = (
            SendConst(qp.as_ptr()),
            SendConst(kt.as_ptr()),
            SendConst(self.v.as_ptr()),
            SendConst(values.data.as_ptr()),
            SendPtr(out.as_mut_ptr()),
            SendPtr(weights.map_or(core::ptr::null_mut(), |w| w.as_mut_ptr())),
            SendPtr(scores.map_or(core::ptr::null_mut(), |w| w.as_mut_ptr())),
        );
        let lens = opts.key_lengths;
        let work = b
            .saturating_mul(lq)
            .saturating_mul(lk)
            .saturating_mul(a)
            .saturating_mul(16);
        run_tasks_scratch(
            exec.par,
            b * qblocks,
            work,
            additive_scratch_len(dv),
            |t, scratch| {
                let (bi, row0) = (t / qblocks, (t % qblocks) * Q_BLOCK);
                let m = Q_BLOCK.min(lq - row0);
                let wrow = (bi * lq + row0) * lk;
                let opt_add = |p: *mut f32| if p.is_null() { p } else { p.wrapping_add(wrow) };
                // SAFETY: every offset addresses rows validated above: `qp` (B, Lq, A),
                // `kt` (B, A, ldkt), values (B, Lk, Dv) per its strides, `out` dense in query order,
                // masks per their broadcast strides, weights/scores dense (B, Lq, Lk).
                let args = unsafe {
                    AdditiveArgs {
                        m,
                        n: lk,
                        a,
                        dv,
                        spec: ScoreSpec {
                            bias: if bias_p.0.get().is_null() {
                                core::ptr::null()
                            } else {
                                bias_p.0.get().add(bi * bias_p.1[0] + row0 * bias_p.1[1])
                            },
                            ldbias: bias_p.1[1],
                            mask: if mask_p.0.get().is_null() {
                                core::ptr::null()
                            } else {
                                mask_p.0.get().add(bi * mask_p.1[0] + row0 * mask_p.1[1])
                            },
                            ldmask: mask_p.1[1],
                            row0,
                            ..ScoreSpec::new(lens.map_or(lk, |l| l[bi]))
                        },
                        qp: ptrs.0.get().add((bi * lq + row0) * a),
                        ldq: a,
                        kpt: ptrs.1.get().add(bi * per_b),
                        ldkt,
                        wv: ptrs.2.get(),
                        v: ptrs.3.get().wrapping_add(bi * vsb),
                        ldv: vsl,
                        o: ptrs.4.get().wrapping_add(bi * os[0] + row0 * os[1]),
                        ldo: os[1],
                        scores: opt_add(ptrs.6.get()),
                        weights: opt_add(ptrs.5.get()),
                        ldw: lk,
                    }
                };
                // SAFETY: `args` describes validated, in-bounds extents (k′ᵀ rows are `ldkt`
                // long, a multiple of the key padding, zero beyond Lk); this task's output rows
                // are disjoint from every other task's; the ISA was checked.
                unsafe { additive_forward(isa, &args, scratch) }
            },
        )
    }
}
