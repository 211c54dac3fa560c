//! Helpers shared by the integration tests: the ISA list, random data, strided views with
//! NaN-filled padding, and a naive f64 attention reference written independently of the crate.
#![allow(dead_code)]

use attnkit::{Causal, Dtype, Isa, Kernel, Layout};
use rand::rngs::SmallRng;
use rand::Rng;

/// Every ISA this CPU supports. Prints the ones skipped; with `ATTNKIT_REQUIRE_ISAS=avx2,avx512`
/// set, panics if a named one is missing so CI cannot pass by skipping it.
pub fn isas() -> Vec<Isa> {
    if let Ok(req) = std::env::var("ATTNKIT_REQUIRE_ISAS") {
        for name in req.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let isa: Isa = name
                .parse()
                .expect("ATTNKIT_REQUIRE_ISAS names an unknown ISA");
            assert!(
                isa.is_supported(),
                "ATTNKIT_REQUIRE_ISAS: required ISA {isa} is not supported here"
            );
        }
    }
    let avail = Isa::available();
    for isa in Isa::ALL {
        if !avail.contains(&isa) {
            eprintln!("skipping ISA {isa}: not supported by this CPU");
        }
    }
    assert!(
        avail.contains(&Isa::Scalar),
        "the portable path must always be available"
    );
    avail
}

/// `n` samples of N(0, 1)·`scale` (Box–Muller; rand 0.8 has no normal distribution).
pub fn randn(rng: &mut SmallRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
            let u2: f64 = rng.gen();
            ((-2.0 * u1.ln()).sqrt() * (2.0 * core::f64::consts::PI * u2).cos()) as f32 * scale
        })
        .collect()
}

/// `|got − want| ≤ atol + rtol·|want|`; false for NaN. Infinities must match exactly.
pub fn close(got: f32, want: f64, atol: f64, rtol: f64) -> bool {
    if want.is_infinite() || got.is_infinite() {
        return got as f64 == want;
    }
    (got as f64 - want).abs() <= atol + rtol * want.abs()
}

/// The end-to-end tolerance of the brief: 1e-5 absolute + 1e-5 relative.
pub const ATOL: f64 = 1e-5;
/// See [`ATOL`].
pub const RTOL: f64 = 1e-5;

/// Max |got − want| over finite pairs, and how many elements are outside `ATOL + RTOL·|want|`
/// (with the first offending index).
pub fn compare(got: &[f32], want: &[f64]) -> (f64, usize, Option<usize>) {
    assert_eq!(got.len(), want.len(), "compare: length mismatch");
    let (mut max, mut bad, mut first) = (0.0f64, 0, None);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !close(g, w, ATOL, RTOL) {
            bad += 1;
            first.get_or_insert(i);
        }
        let e = if g as f64 == w {
            0.0
        } else {
            (g as f64 - w).abs()
        };
        max = if e.is_nan() || max.is_nan() {
            f64::NAN
        } else {
            max.max(e)
        };
    }
    (max, bad, first)
}

/// Sizes of one attention problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub lq: usize,
    pub lk: usize,
    pub d: usize,
    pub dv: usize,
}

impl Dims {
    pub fn q(&self) -> [usize; 4] {
        [self.b, self.hq, self.lq, self.d]
    }
    pub fn k(&self) -> [usize; 4] {
        [self.b, self.hkv, self.lk, self.d]
    }
    pub fn v(&self) -> [usize; 4] {
        [self.b, self.hkv, self.lk, self.dv]
    }
    pub fn out(&self) -> [usize; 4] {
        [self.b, self.hq, self.lq, self.dv]
    }
}

/// A mask as the reference sees it: dense row-major with the broadcast shape `(mb, mh, mq, Lk)`.
#[derive(Clone, Copy, Debug)]
pub enum RefMask<'a> {
    None,
    Bool(&'a [bool], [usize; 4]),
    Bias(&'a [f32], [usize; 4]),
}

/// Index of `(b, h, i, j)` in a broadcast mask of shape `s`.
pub fn mask_index(s: [usize; 4], b: usize, h: usize, i: usize, j: usize) -> usize {
    let pick = |n: usize, x: usize| if n == 1 { 0 } else { x };
    ((pick(s[0], b) * s[1] + pick(s[1], h)) * s[2] + pick(s[2], i)) * s[3] + j
}

/// One attention problem over dense `(B, H, L, D)` inputs.
#[derive(Clone, Copy, Debug)]
pub struct Problem<'a> {
    pub dims: Dims,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// The scale actually applied (the default `1/√D` must be resolved by the caller).
    pub scale: f64,
    pub causal: Option<Causal>,
    /// Sliding window (with `causal`): query `i` sees only keys `j > diag(i) − window`.
    pub window: Option<usize>,
    pub mask: RefMask<'a>,
    pub key_lengths: Option<&'a [usize]>,
    /// ALiBi slopes per query head: `−slope[h]·|i + off − j|`, `off = 0` under top-left causal
    /// masking, else `len_b − Lq`.
    pub alibi: Option<&'a [f32]>,
    /// `cap·tanh(x/cap)` on the scaled score, before bias and masks.
    pub softcap: Option<f64>,
    /// Sink logit per query head, in the softmax denominator only.
    pub sinks: Option<&'a [f32]>,
}

/// Reference results: output `(B, Hq, Lq, Dv)`, logsumexp `(B, Hq, Lq)`, weights `(B, Hq, Lq, Lk)`.
pub struct RefOut {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub w: Vec<f64>,
}

/// Naive attention in f64, PyTorch SDPA semantics: masked keys (bool false, causal, past the key
/// length, bias −inf) take no part; a row with no visible key gives zeros and lse = −inf.
///
/// Causal masking as the crate documents it: query `i` of batch `b` sees key `j` iff
/// `j ≤ i + off`, with `off = 0` for top-left and `off = len_b − Lq` for bottom-right, where
/// `len_b` is `key_lengths[b]` if given, else `Lk` (a ragged KV cache aligns each sequence's
/// diagonal to its own end). A window `w` further hides keys `j ≤ i + off − w`.
pub fn reference(p: &Problem) -> RefOut {
    let Dims {
        b,
        hq,
        hkv,
        lq,
        lk,
        d,
        dv,
    } = p.dims;
    let group = hq.checked_div(hkv).unwrap_or(1);
    let mut out = vec![0.0f64; b * hq * lq * dv];
    let mut lse = vec![f64::NEG_INFINITY; b * hq * lq];
    let mut w = vec![0.0f64; b * hq * lq * lk];
    let mut s = vec![f64::NEG_INFINITY; lk];
    for bi in 0..b {
        let klen = p.key_lengths.map_or(lk, |l| l[bi]);
        for h in 0..hq {
            let kh = h / group;
            for i in 0..lq {
                let row = (bi * hq + h) * lq + i;
                let qrow = &p.q[row * d..(row + 1) * d];
                for (j, sj) in s.iter_mut().enumerate() {
                    *sj = f64::NEG_INFINITY;
                    if j >= klen {
                        continue;
                    }
                    let off = match p.causal {
                        None => None,
                        Some(Causal::TopLeft) => Some(0),
                        Some(Causal::BottomRight) => Some(klen as isize - lq as isize),
                        Some(Causal::BottomRightAtLk) => Some(lk as isize - lq as isize),
                    };
                    if let Some(off) = off {
                        let diag = i as isize + off;
                        if j as isize > diag
                            || p.window.is_some_and(|w| j as isize <= diag - w as isize)
                        {
                            continue;
                        }
                    }
                    let mut bias = 0.0;
                    match p.mask {
                        RefMask::None => {}
                        RefMask::Bool(m, sh) => {
                            if !m[mask_index(sh, bi, h, i, j)] {
                                continue;
                            }
                        }
                        RefMask::Bias(m, sh) => bias = m[mask_index(sh, bi, h, i, j)] as f64,
                    }
                    let krow = &p.k[((bi * hkv + kh) * lk + j) * d..][..d];
                    let dot: f64 = qrow
                        .iter()
                        .zip(krow)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    let x = p.scale * dot;
                    let x = p.softcap.map_or(x, |c| c * (x / c).tanh());
                    let alibi = p.alibi.map_or(0.0, |a| {
                        let off = match p.causal {
                            Some(Causal::TopLeft) => 0.0,
                            Some(Causal::BottomRightAtLk) => lk as f64 - lq as f64,
                            _ => klen as f64 - lq as f64,
                        };
                        -(a[h] as f64) * (i as f64 + off - j as f64).abs()
                    });
                    *sj = x + bias + alibi;
                }
                let sink = p.sinks.map_or(f64::NEG_INFINITY, |x| x[h] as f64);
                let mx = s.iter().cloned().fold(sink, f64::max);
                if mx == f64::NEG_INFINITY {
                    continue;
                }
                let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum::<f64>() + (sink - mx).exp();
                lse[row] = mx + sum.ln();
                let o = &mut out[row * dv..(row + 1) * dv];
                for (j, &sj) in s.iter().enumerate() {
                    let pj = (sj - mx).exp() / sum;
                    w[row * lk + j] = pj;
                    if pj == 0.0 {
                        continue;
                    }
                    let vrow = &p.v[((bi * hkv + kh) * lk + j) * dv..][..dv];
                    for (oc, &vc) in o.iter_mut().zip(vrow) {
                        *oc += pj * vc as f64;
                    }
                }
            }
        }
    }
    RefOut { out, lse, w }
}

/// How a test lays a logical `(B, H, L, D)` tensor out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ViewSpec {
    pub layout: Layout,
    /// Extra elements after every row and after every head/batch block (0 = dense).
    pub pad: usize,
}

impl ViewSpec {
    pub const BHLD: ViewSpec = ViewSpec {
        layout: Layout::Bhld,
        pad: 0,
    };
    pub const BLHD: ViewSpec = ViewSpec {
        layout: Layout::Blhd,
        pad: 0,
    };

    /// Strides of B, H, L and the buffer length.
    pub fn strides(self, shape: [usize; 4]) -> ([usize; 3], usize) {
        let [b, h, l, d] = shape;
        let p = self.pad;
        match self.layout {
            Layout::Bhld => {
                let row = d + p;
                let head = l * row + p;
                let batch = h * head + p;
                ([batch, head, row], b * batch)
            }
            Layout::Blhd => {
                let head = d + p;
                let row = h * head + p;
                let batch = l * row + p;
                ([batch, head, row], b * batch)
            }
        }
    }
}

/// A strided buffer: the logical tensor inside, `fill` (NaN in the tests) everywhere else.
#[derive(Clone, Debug)]
pub struct Strided {
    pub buf: Vec<f32>,
    pub shape: [usize; 4],
    pub strides: [usize; 3],
}

impl Strided {
    /// An all-`fill` buffer for a view of `shape` laid out as `spec`.
    pub fn filled(shape: [usize; 4], spec: ViewSpec, fill: f32) -> Strided {
        let (strides, len) = spec.strides(shape);
        Strided {
            buf: vec![fill; len],
            shape,
            strides,
        }
    }

    /// `dense` (row-major `(B, H, L, D)`) written into a `fill`ed buffer laid out as `spec`.
    pub fn scatter(dense: &[f32], shape: [usize; 4], spec: ViewSpec, fill: f32) -> Strided {
        let mut s = Strided::filled(shape, spec, fill);
        assert_eq!(dense.len(), shape.iter().product::<usize>());
        for (idx, off) in s.offsets().into_iter().enumerate() {
            s.buf[off] = dense[idx];
        }
        s
    }

    /// Buffer offset of every logical element, in row-major `(B, H, L, D)` order.
    pub fn offsets(&self) -> Vec<usize> {
        let [b, h, l, d] = self.shape;
        let st = self.strides;
        let mut v = Vec::with_capacity(b * h * l * d);
        for bi in 0..b {
            for hi in 0..h {
                for li in 0..l {
                    for x in 0..d {
                        v.push(bi * st[0] + hi * st[1] + li * st[2] + x);
                    }
                }
            }
        }
        v
    }

    /// The logical tensor, dense row-major `(B, H, L, D)`.
    pub fn gather(&self) -> Vec<f32> {
        self.offsets().into_iter().map(|o| self.buf[o]).collect()
    }

    /// Number of elements outside the view that are not NaN (padding that was written).
    pub fn padding_written(&self) -> usize {
        let mut inside = vec![false; self.buf.len()];
        for o in self.offsets() {
            inside[o] = true;
        }
        self.buf
            .iter()
            .zip(&inside)
            .filter(|(x, &i)| !i && !x.is_nan())
            .count()
    }

    pub fn view(&self) -> attnkit::Tensor<'_> {
        attnkit::Tensor::strided(&self.buf, self.shape, self.strides)
    }

    pub fn view_mut(&mut self) -> attnkit::TensorMut<'_> {
        attnkit::TensorMut::strided(&mut self.buf, self.shape, self.strides)
    }
}

/// The memory-order sizes `[B, L, H, D]` of a logical `(B, H, L, D)` shape (what
/// `Tensor::blhd` takes).
pub fn lh(shape: [usize; 4]) -> [usize; 4] {
    [shape[0], shape[2], shape[1], shape[3]]
}

/// Dense `(B, H, L, D)` re-laid-out as dense `(B, L, H, D)`.
pub fn to_blhd(x: &[f32], shape: [usize; 4]) -> Vec<f32> {
    Strided::scatter(x, shape, ViewSpec::BLHD, f32::NAN).buf
}

/// Dense `(B, L, H, D)` memory of logical shape `shape` back to dense `(B, H, L, D)`.
pub fn from_blhd(x: &[f32], shape: [usize; 4]) -> Vec<f32> {
    let (strides, _) = ViewSpec::BLHD.strides(shape);
    Strided {
        buf: x.to_vec(),
        shape,
        strides,
    }
    .gather()
}

/// Whether the decode kernel may sum in another order than on f32 operands holding the same
/// values: it reads bf16 K and V as pairs on every SIMD ISA (even and odd elements in separate
/// registers). `Auto` may pick it; `Prefill` never does.
pub fn decode_reorders(kv: Dtype, isa: Isa, kernel: Kernel) -> bool {
    kv == Dtype::Bf16 && isa != Isa::Scalar && kernel != Kernel::Prefill
}

/// `got` against `want` computed on f32 operands holding the same values: bitwise, or, where
/// the kernel sums in another order (`reordered`), within 1e-5·(1 + |want|) (the f64-reference
/// tests bound both).
pub fn same_values(got: &[f32], want: &[f32], reordered: bool, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if reordered {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()) || g.to_bits() == w.to_bits(),
                "{what}: [{i}] {g} vs {w}"
            );
        } else {
            assert_eq!(g.to_bits(), w.to_bits(), "{what}: [{i}] {g} vs {w}");
        }
    }
}
