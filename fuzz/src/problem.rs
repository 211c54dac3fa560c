//! The sizes, mask and options of one attention call, decoded from fuzz input, with every
//! deliberate fault recorded in an [`Expect`].

use crate::expect::Expect;
use crate::gen::{chance, product, size, small, wild, Rng};
use arbitrary::{Result, Unstructured};
use attnkit::{Causal, Isa, Kernel, MaskRef, Par, Precision, SdpaOptions};

/// Largest buffer (elements) the targets allocate at full length for small problems (1 MiB).
pub const MAX_LEN: usize = 1 << 18;
/// Largest buffer (elements) allocated at full length when sizes are wild.
pub const WILD_MAX_LEN: usize = 4096;
/// Largest problem (multiply-adds, as attnkit counts them) the targets build; enough for
/// attnkit to go parallel (it does from 2^20).
pub const MAX_WORK: usize = 1 << 21;

/// Sizes of one attention call: `q (B, Hq, Lq, D)`, `k (B, Hkv, Lk, D)`, `v (B, Hkv, Lk, Dv)`.
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
    /// Small sizes (each at most about 40, `Hq` a multiple of `Hkv` 7 times in 8), shrunk to at
    /// most [`MAX_WORK`]; or, with `wild`, sizes that may be huge.
    pub fn decode(u: &mut Unstructured, wild: bool) -> Result<Self> {
        let odds = if wild { 3 } else { 0 };
        let hkv = size(u, 8, odds)?;
        let hq = if chance(u, 7, 8)? {
            hkv.saturating_mul(u.int_in_range(1..=8)?)
        } else {
            size(u, 40, odds)?
        };
        let mut dims = Dims {
            b: size(u, 40, odds)?,
            hq,
            hkv,
            lq: size(u, 40, odds)?,
            lk: size(u, 40, odds)?,
            d: size(u, 40, odds)?,
            dv: size(u, 40, odds)?,
        };
        if !wild {
            dims.shrink(MAX_WORK);
        }
        Ok(dims)
    }

    /// Multiply-adds as attnkit counts them (`None` on overflow).
    pub fn work(&self) -> Option<usize> {
        let d = self.d.checked_add(self.dv)?;
        product(&[self.b, self.hq, self.lq, self.lk.max(1), d.max(1)])
    }

    /// Halves the largest of B, Lq, Lk, D, Dv until the call is at most `max_work`.
    fn shrink(&mut self, max_work: usize) {
        while self.work().is_none_or(|w| w > max_work) {
            let dims = [
                &mut self.b,
                &mut self.lq,
                &mut self.lk,
                &mut self.d,
                &mut self.dv,
            ];
            let largest = dims.into_iter().max_by_key(|x| **x).expect("five sizes");
            *largest /= 2;
        }
    }

    /// Records a head-count fault (`Hq` not a multiple of a non-zero `Hkv`).
    pub fn check_heads(&self, expect: &mut Expect) {
        // `is_multiple_of(0)` holds only for 0: Hkv = 0 needs Hq = 0.
        if !self.hq.is_multiple_of(self.hkv) {
            expect.fault("Hq is not a multiple of Hkv");
        }
    }

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

/// What [`perturb`] records.
const DISAGREES: &str = "an operand's dimension disagrees with the others";

/// Occasionally (1 in 32) replaces one of the dimensions `checked` of `shape` (those the call
/// compares with another operand) by a different size; the call must then refuse the operand.
/// At most one operand of a call is perturbed (two could agree again).
pub fn perturb(
    u: &mut Unstructured,
    mut shape: [usize; 4],
    checked: &[usize],
    expect: &mut Expect,
) -> Result<[usize; 4]> {
    if !expect.has(DISAGREES) && chance(u, 1, 32)? {
        let i = *u.choose(checked)?;
        let new = if chance(u, 1, 2)? {
            shape[i].wrapping_add(1)
        } else {
            wild(u)?
        };
        // No batch of one on either side: K and V of one batch serve every query batch, so a
        // B of 1 that meets another is valid.
        let batch_of_one = i == 0 && (new == 1 || shape[0] == 1);
        if new != shape[i] && !batch_of_one {
            expect.fault(DISAGREES);
            shape[i] = new;
        }
    }
    Ok(shape)
}

/// Every dimension, for [`perturb`].
pub const ALL_DIMS: &[usize] = &[0, 1, 2, 3];

/// The values of a mask.
#[derive(Clone, Debug)]
pub enum MaskData {
    /// `true` = attend.
    Bool(Vec<bool>),
    /// Added to the scaled scores; `-inf` masks.
    Bias(Vec<f32>),
}

/// A `MaskRef` shape `(mb, mh, mq, Lk)` and its buffer.
#[derive(Clone, Debug)]
pub struct MaskSpec {
    pub shape: [usize; 4],
    pub data: MaskData,
}

impl MaskSpec {
    /// A bool or bias mask broadcast over some of B, H, Lq; rarely a wrong dimension or length.
    pub fn decode(
        u: &mut Unstructured,
        dims: &Dims,
        rng: &mut Rng,
        expect: &mut Expect,
        max_len: usize,
    ) -> Result<Self> {
        let full = [dims.b, dims.hq, dims.lq, dims.lk];
        let mut shape = [0; 4];
        for (i, s) in shape.iter_mut().enumerate() {
            *s = if i < 3 && chance(u, 1, 2)? {
                1
            } else {
                full[i]
            };
            if chance(u, 1, 32)? {
                *s = s.wrapping_add(1);
                if *s != full[i] && (i == 3 || *s != 1) {
                    expect.fault("a mask dimension is neither 1 nor the full size");
                }
            }
        }
        let len = match product(&shape) {
            Some(n) if n <= max_len => {
                if chance(u, 1, 16)? {
                    expect.fault("a mask buffer of the wrong length");
                    if n > 0 && chance(u, 1, 2)? {
                        n - 1
                    } else {
                        n + 1
                    }
                } else {
                    n
                }
            }
            _ => {
                expect.fault("a mask buffer of the wrong length");
                small(u, 16)?
            }
        };
        let data = if chance(u, 1, 2)? {
            let p = *u.choose(&[192, 256, 0, 128, 240])?;
            MaskData::Bool((0..len).map(|_| rng.bit(p)).collect())
        } else {
            let ninf = *u.choose(&[0, 32, 128, 256])?;
            let mut bias: Vec<f32> = (0..len)
                .map(|_| {
                    if rng.bit(ninf) {
                        f32::NEG_INFINITY
                    } else {
                        rng.value()
                    }
                })
                .collect();
            if chance(u, 1, 16)? {
                crate::gen::inject_specials(u, &mut bias)?;
            }
            MaskData::Bias(bias)
        };
        Ok(MaskSpec { shape, data })
    }

    /// The bias of `(b, h, i, j)`: `Some(0)` for an attended bool, `None` where masked.
    pub fn bias(&self, b: usize, h: usize, i: usize, j: usize) -> Option<f64> {
        let s = self.shape;
        let pick = |n: usize, x: usize| if n == 1 { 0 } else { x };
        let idx = ((pick(s[0], b) * s[1] + pick(s[1], h)) * s[2] + pick(s[2], i)) * s[3] + j;
        match &self.data {
            MaskData::Bool(m) => m[idx].then_some(0.0),
            MaskData::Bias(m) if m[idx] == f32::NEG_INFINITY => None,
            MaskData::Bias(m) => Some(f64::from(m[idx])),
        }
    }

    /// Whether every value is finite or `-inf` (the reference then applies).
    pub fn is_tame(&self) -> bool {
        match &self.data {
            MaskData::Bool(_) => true,
            MaskData::Bias(m) => m.iter().all(|x| x.is_finite() || *x == f32::NEG_INFINITY),
        }
    }
}

/// The options of a call, owned.
#[derive(Clone, Debug)]
pub struct OptSpec {
    pub scale: Option<f32>,
    pub causal: Option<Causal>,
    pub window: Option<usize>,
    pub key_lengths: Option<Vec<usize>>,
    pub mask: Option<MaskSpec>,
    pub path: Kernel,
    pub isa: Option<Isa>,
    pub par: Par,
    /// ALiBi slopes, softcap, sink logits.
    pub alibi: Option<Vec<f32>>,
    pub softcap: Option<f32>,
    pub sinks: Option<Vec<f32>>,
    /// The precision of f32 products: [`Precision::Highest`] unless a target sets it
    /// ([`OptSpec::decode_precision`]).
    pub precision: Precision,
}

impl OptSpec {
    /// Decodes options for `dims`. With `cache`, leaves out what `KvCache::attend` sets itself
    /// (causal alignment and key lengths) and treats the call as causal.
    pub fn decode(
        u: &mut Unstructured,
        dims: &Dims,
        cache: bool,
        rng: &mut Rng,
        expect: &mut Expect,
        max_len: usize,
    ) -> Result<Self> {
        let scale = decode_scale(u, expect)?;
        let causal = if cache {
            None
        } else {
            *u.choose(&[
                None,
                Some(Causal::TopLeft),
                Some(Causal::BottomRight),
                Some(Causal::BottomRightAtLk),
            ])?
        };
        let window = decode_window(u, dims.lk, cache || causal.is_some(), expect)?;
        let key_lengths = if !cache && chance(u, 1, 4)? {
            Some(decode_key_lengths(u, dims, expect)?)
        } else {
            None
        };
        let mask = if chance(u, 1, 3)? {
            Some(MaskSpec::decode(u, dims, rng, expect, max_len)?)
        } else {
            None
        };
        let path = *u.choose(&[Kernel::Auto, Kernel::Prefill, Kernel::Decode])?;
        let isa = if chance(u, 1, 2)? {
            let isa = *u.choose(&Isa::ALL)?;
            if !isa.is_supported() {
                expect.fault("an ISA this CPU lacks");
            }
            Some(isa)
        } else {
            None
        };
        let par = *u.choose(&[Par::Rayon, Par::Seq])?;
        let alibi = decode_per_head(u, dims.hq, rng, "alibi", expect)?;
        let softcap = decode_softcap(u, expect)?;
        let sinks = decode_per_head(u, dims.hq, rng, "sinks", expect)?;
        Ok(OptSpec {
            scale,
            causal,
            window,
            key_lengths,
            mask,
            path,
            isa,
            par,
            alibi,
            softcap,
            sinks,
            precision: Precision::Highest,
        })
    }

    /// `Precision::Medium` (1 in 4) for an all-f32 call: refused when `isa` is forced to one
    /// without bf16 products, else bf16 products where the CPU has them, f32 ones elsewhere.
    pub fn decode_precision(&mut self, u: &mut Unstructured, expect: &mut Expect) -> Result<()> {
        if chance(u, 1, 4)? {
            self.precision = Precision::Medium;
            if self
                .isa
                .is_some_and(|isa| !matches!(isa, Isa::Avx512Bf16 | Isa::Amx))
            {
                expect.fault("Precision::Medium with an ISA that has no bf16 products");
            }
        }
        Ok(())
    }

    /// The options with threading `par`.
    pub fn options(&self, par: Par) -> SdpaOptions<'_> {
        let mut o = SdpaOptions::new()
            .kernel(self.path)
            .par(par)
            .precision(self.precision);
        if let Some(s) = self.scale {
            o = o.scale(s);
        }
        if let Some(c) = self.causal {
            o = o.causal(c);
        }
        if let Some(w) = self.window {
            o = o.window(w);
        }
        if let Some(l) = &self.key_lengths {
            o = o.key_lengths(l);
        }
        if let Some(isa) = self.isa {
            o = o.isa(isa);
        }
        if let Some(a) = &self.alibi {
            o = o.alibi(a);
        }
        if let Some(c) = self.softcap {
            o = o.softcap(c);
        }
        if let Some(x) = &self.sinks {
            o = o.sinks(x);
        }
        match &self.mask {
            None => o,
            Some(MaskSpec {
                shape,
                data: MaskData::Bool(m),
            }) => o.bool_mask(MaskRef::new(m, *shape)),
            Some(MaskSpec {
                shape,
                data: MaskData::Bias(m),
            }) => o.bias(MaskRef::new(m, *shape)),
        }
    }

    /// The scale the call applies: the given one, else `1/√D`.
    pub fn scale_for(&self, d: usize) -> f64 {
        f64::from(self.scale.unwrap_or(1.0 / (d.max(1) as f32).sqrt()))
    }

    /// Whether the f64 reference is meaningful: a moderate scale and a tame mask (an f32 kernel
    /// overflows where the f64 reference does not once `scale·q` nears `f32::MAX`), and f32
    /// products (bf16 ones are checked against rounded inputs in tests/precision.rs).
    pub fn reference_applies(&self, d: usize) -> bool {
        self.scale_for(d).abs() <= 16.0
            && self.mask.as_ref().is_none_or(MaskSpec::is_tame)
            && self.precision == Precision::Highest
    }
}

/// No scale (1 in 2), a plain one, or any bits; a non-finite scale must be refused.
fn decode_scale(u: &mut Unstructured, expect: &mut Expect) -> Result<Option<f32>> {
    if !chance(u, 1, 2)? {
        return Ok(None);
    }
    let s = if chance(u, 1, 8)? {
        f32::from_bits(u.arbitrary()?)
    } else {
        *u.choose(&[
            1.0,
            0.5,
            0.125,
            0.0,
            -1.0,
            2.0,
            16.0,
            f32::NAN,
            f32::INFINITY,
        ])?
    };
    if !s.is_finite() {
        expect.fault("a non-finite scale");
    }
    Ok(Some(s))
}

/// No window (3 in 4), a small one, or a wild one (`usize::MAX` included); 0 and a window
/// without causal masking must be refused.
fn decode_window(
    u: &mut Unstructured,
    lk: usize,
    causal: bool,
    expect: &mut Expect,
) -> Result<Option<usize>> {
    if !chance(u, 1, 4)? {
        return Ok(None);
    }
    let w = if chance(u, 1, 4)? {
        wild(u)?
    } else {
        u.int_in_range(0..=lk.saturating_add(2))?
    };
    if w == 0 {
        expect.fault("a window of 0");
    }
    if !causal {
        expect.fault("a window without causal masking");
    }
    Ok(Some(w))
}

/// `B` key lengths in `0..=Lk`; rarely a wrong count or a length past `Lk`.
fn decode_key_lengths(
    u: &mut Unstructured,
    dims: &Dims,
    expect: &mut Expect,
) -> Result<Vec<usize>> {
    let mut n = dims.b;
    if n > 64 || chance(u, 1, 32)? {
        n = small(u, 4)?;
        if n != dims.b {
            expect.fault("key_lengths of the wrong count");
        }
    }
    let mut lens = Vec::with_capacity(n);
    for _ in 0..n {
        let len = if chance(u, 1, 32)? {
            wild(u)?
        } else {
            u.int_in_range(0..=dims.lk)?
        };
        if len > dims.lk {
            expect.fault("a key length past Lk");
        }
        lens.push(len);
    }
    Ok(lens)
}

/// ALiBi slopes or sink logits (1 in 4 each): one per query head, the standard slopes or values
/// in [-8, 8] (sinks also -inf); rarely a wrong count or a value the call must refuse (NaN, or
/// infinite where that means nothing).
fn decode_per_head(
    u: &mut Unstructured,
    hq: usize,
    rng: &mut Rng,
    what: &'static str,
    expect: &mut Expect,
) -> Result<Option<Vec<f32>>> {
    if !chance(u, 1, 4)? {
        return Ok(None);
    }
    let mut n = hq.min(4096);
    if n != hq || chance(u, 1, 32)? {
        n = small(u, 8)?;
        if n != hq {
            expect.fault("per-head values of the wrong count");
        }
    }
    let mut x: Vec<f32> = if what == "alibi" && chance(u, 1, 2)? {
        attnkit::alibi_slopes(n, 8.0)
    } else {
        (0..n).map(|_| 8.0 * rng.value()).collect()
    };
    if what == "sinks" && n > 0 && chance(u, 1, 4)? {
        x[0] = f32::NEG_INFINITY;
    }
    if n > 0 && chance(u, 1, 32)? {
        let bad = *u.choose(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY])?;
        let i = u.choose_index(n)?;
        x[i] = bad;
        if bad.is_nan() || bad == f32::INFINITY || what == "alibi" {
            expect.fault("a NaN or meaningless infinite per-head value");
        }
    }
    Ok(Some(x))
}

/// No softcap (3 in 4), a usual one, or one the call must refuse (not positive and finite).
fn decode_softcap(u: &mut Unstructured, expect: &mut Expect) -> Result<Option<f32>> {
    if !chance(u, 1, 4)? {
        return Ok(None);
    }
    let c = *u.choose(&[
        30.0,
        1.0,
        0.25,
        50.0,
        1e-3,
        0.0,
        -1.0,
        f32::NAN,
        f32::INFINITY,
    ])?;
    if !(c > 0.0 && c.is_finite()) {
        expect.fault("a softcap that is not positive and finite");
    }
    Ok(Some(c))
}
