//! Attention on `candle_core::Tensor`s in place (feature `candle`).
//!
//! [`sdpa`] takes `(B, H, L, D)` tensors, candle's layout for attention, and returns a new
//! `(B, Hq, Lq, Dv)` tensor of the inputs' dtype; [`Sdpa`] is the same computation as a
//! `CustomOp3`, for `q.apply_op3(&k, &v, Sdpa { .. })` inside a model. As in [`crate::sdpa`],
//! `Hq` may be a multiple of `Hkv` (GQA: no `repeat_kv` copy), and the options are
//! [`SdpaOptions`].
//!
//! Nothing is copied in: each input is read from candle's CPU storage at its layout's offset
//! and strides, while candle holds the storage's read lock. Contiguous and strided tensors are
//! read alike: `.transpose(1, 2)` of a `(B, L, H, D)` projection, heads or rows taken with
//! `narrow`, K and V broadcast over the batch or heads. Only the last dimension must be
//! contiguous (stride 1): a tensor whose D is not (such as `k.t()`) is refused, not copied
//! behind your back, and `.contiguous()` is the copy that can be read.
//!
//! Supported: the CPU device; dtypes f32, bf16 and f16, one for q, k and v (the output has it
//! too; 16-bit inputs are computed in f32 and rounded once, see [`crate::sdpa`]). Forward only:
//! the op has no backward pass. Errors are attnkit's [`AttnError`] made a `candle_core::Error`
//! by `Error::wrap`: the message names the argument and the sizes, with
//! [`AttnError::Unsupported`] for what the views cannot read.
//!
//! ```
//! use attnkit::{Causal, SdpaOptions};
//! use candle_core::{Device, Tensor};
//!
//! let (b, l, h, d) = (1, 6, 4, 8);
//! // A (B, L, H, D) projection, read per head as (B, H, L, D) without a copy.
//! let x = Tensor::randn(0f32, 1.0, (b, l, h, d), &Device::Cpu)?.transpose(1, 2)?;
//! let out = attnkit::candle::sdpa(&x, &x, &x, &SdpaOptions::new().causal(Causal::TopLeft))?;
//! assert_eq!(out.dims(), &[b, h, l, d]);
//!
//! let op = attnkit::candle::Sdpa { causal: Some(Causal::TopLeft), ..Default::default() };
//! let again = x.apply_op3(&x, &x, op)?;
//! assert_eq!(again.squeeze(0)?.to_vec3::<f32>()?, out.squeeze(0)?.to_vec3::<f32>()?);
//! # Ok::<(), candle_core::Error>(())
//! ```

use super::unsupported;
use crate::alloc::{checked_len, try_zeros_elem};
use crate::error::{AttnError, Result as AttnResult};
use crate::options::{Causal, Extras, SdpaOptions};
use crate::plan::Plan;
use crate::view::{Tensor as View, TensorMut};
use attnkit_kernels::{Elem, Operand};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// Scaled dot-product attention on candle tensors, as [`crate::sdpa`]: `q (B, Hq, Lq, D)`,
/// `k (B, Hkv, Lk, D)`, `v (B, Hkv, Lk, Dv)` on the CPU, read in place; returns a new
/// contiguous `(B, Hq, Lq, Dv)` tensor of their dtype.
///
/// # Errors
/// As [`crate::sdpa`], wrapped in `candle_core::Error`; [`AttnError::Unsupported`] naming `q`,
/// `k` or `v` for a tensor not on the CPU, not 4-D, whose last dimension is not contiguous, or
/// of a dtype other than f32, bf16 and f16 (or different from q's).
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, opts: &SdpaOptions) -> Result<Tensor> {
    for (arg, t) in [("q", q), ("k", k), ("v", v)] {
        if !t.device().is_cpu() {
            return Err(wrap(unsupported(
                arg,
                format!(
                    "is on {:?}; attnkit computes on the CPU (move it with \
                     `to_device(&Device::Cpu)`)",
                    t.device().location()
                ),
            )));
        }
    }
    q.apply_op3_no_bwd(k, v, &WithOptions(opts))
}

/// [`sdpa`] as a candle `CustomOp3`: `q.apply_op3(&k, &v, Sdpa { .. })` (or
/// `apply_op3_no_bwd`). It owns its options, as a custom op must; masks, key lengths and the
/// other borrowed options of [`SdpaOptions`] go through [`sdpa`]. Forward only: backpropagating
/// through it is a `BackwardNotSupported` error.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sdpa {
    /// Multiplies `q·k`; `None` means `1/√D`.
    pub scale: Option<f32>,
    /// Causal masking and its alignment.
    pub causal: Option<Causal>,
    /// Sliding window (with `causal`), as [`SdpaOptions::window`].
    pub window: Option<usize>,
    /// Softcap of the scaled scores, as [`SdpaOptions::softcap`].
    pub softcap: Option<f32>,
}

impl Sdpa {
    /// The [`SdpaOptions`] these fields set.
    pub fn options(&self) -> SdpaOptions<'static> {
        let mut o = SdpaOptions::new();
        o.scale = self.scale;
        o.causal = self.causal;
        o.window = self.window;
        o.softcap = self.softcap;
        o
    }
}

impl CustomOp3 for Sdpa {
    fn name(&self) -> &'static str {
        "attnkit-sdpa"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        forward(&self.options(), [(s1, l1), (s2, l2), (s3, l3)])
    }
}

/// The op behind [`sdpa`]: borrowed options, which `apply_op3_no_bwd` allows.
struct WithOptions<'o, 'a>(&'o SdpaOptions<'a>);

impl CustomOp3 for WithOptions<'_, '_> {
    fn name(&self) -> &'static str {
        "attnkit-sdpa"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        forward(self.0, [(s1, l1), (s2, l2), (s3, l3)])
    }
}

/// Attention over three CPU storages of one dtype, the result in that dtype.
fn forward(
    opts: &SdpaOptions,
    [q, k, v]: [(&CpuStorage, &Layout); 3],
) -> Result<(CpuStorage, Shape)> {
    use CpuStorage::{BF16, F16, F32};
    let (out, shape) = match (q.0, k.0, v.0) {
        (F32(qs), F32(ks), F32(vs)) => {
            let (o, s) = attend((qs, q.1), (ks, k.1), (vs, v.1), opts)?;
            (F32(o), s)
        }
        (BF16(qs), BF16(ks), BF16(vs)) => {
            let (o, s) = attend((qs, q.1), (ks, k.1), (vs, v.1), opts)?;
            (BF16(o), s)
        }
        (F16(qs), F16(ks), F16(vs)) => {
            let (o, s) = attend((qs, q.1), (ks, k.1), (vs, v.1), opts)?;
            (F16(o), s)
        }
        _ => return Err(wrap(dtype_error([q.0, k.0, v.0]))),
    };
    Ok((out, Shape::from(shape.to_vec())))
}

/// Attention over slices of candle storage read through their layouts.
fn attend<E: Elem + Operand>(
    q: (&[E], &Layout),
    k: (&[E], &Layout),
    v: (&[E], &Layout),
    opts: &SdpaOptions,
) -> Result<(Vec<E>, [usize; 4])> {
    let run = || -> AttnResult<(Vec<E>, [usize; 4])> {
        let (q, k, v) = (
            view("q", q.0, q.1)?,
            view("k", k.0, k.1)?,
            view("v", v.0, v.1)?,
        );
        let [b, hq, lq, _] = q.shape();
        let shape = [b, hq, lq, v.shape()[3]];
        // Validate before allocating: a bad argument is reported as such.
        Plan::<E, E, E>::validate(&q, &k, &v, shape, opts, &mut Extras::default())?;
        let mut out = try_zeros_elem::<E>("out", checked_len("out", &shape)?)?;
        crate::sdpa::sdpa(&q, &k, &v, &mut TensorMut::bhld(&mut out, shape), opts)?;
        Ok((out, shape))
    };
    run().map_err(wrap)
}

/// An attnkit view of a tensor's storage at its layout's offset and strides.
fn view<'s, E: Elem>(arg: &'static str, data: &'s [E], layout: &Layout) -> AttnResult<View<'s, E>> {
    let (dims, stride) = (layout.dims(), layout.stride());
    let &[b, h, l, d] = dims else {
        return Err(unsupported(
            arg,
            format!("has shape {dims:?}; attnkit reads 4-D (B, H, L, D) tensors"),
        ));
    };
    if d > 1 && stride[3] != 1 {
        return Err(unsupported(
            arg,
            format!(
                "the last dimension (D) has stride {}; attnkit reads rows of D contiguous \
                 elements (stride 1): make it contiguous with `.contiguous()`",
                stride[3]
            ),
        ));
    }
    // An offset past the storage (an empty tensor) leaves the call to judge the empty rest.
    let data = data.get(layout.start_offset()..).unwrap_or_default();
    Ok(View::strided(
        data,
        [b, h, l, d],
        [stride[0], stride[1], stride[2]],
    ))
}

/// The refusal of dtypes the op does not compute with, naming the first offending argument.
fn dtype_error(s: [&CpuStorage; 3]) -> AttnError {
    let dt = s.map(|s| s.dtype());
    let readable = |i: usize| {
        matches!(
            s[i],
            CpuStorage::F32(_) | CpuStorage::BF16(_) | CpuStorage::F16(_)
        )
    };
    let (arg, i) = if !readable(0) {
        ("q", 0)
    } else if dt[1] != dt[0] {
        ("k", 1)
    } else {
        ("v", 2)
    };
    let reason = if readable(i) {
        format!(
            "dtype {} differs from q's {}; q, k and v must share one dtype (convert with \
             `to_dtype`)",
            dt[i].as_str(),
            dt[0].as_str()
        )
    } else {
        format!(
            "dtype {}; attnkit reads f32, bf16 and f16 (convert with `to_dtype`)",
            dt[i].as_str()
        )
    };
    unsupported(arg, reason)
}

/// An attnkit error as a candle error; its message is attnkit's.
fn wrap(e: AttnError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}
