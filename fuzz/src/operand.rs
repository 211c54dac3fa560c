//! Owned `(B, H, L, D)` operands in any of attnkit's view forms, with their buffers sized from
//! the input: exact, padded, too short, or (for sizes the target will not allocate) tiny.

use crate::expect::Expect;
use crate::gen::{chance, small, wild, Rng};
use arbitrary::{Result, Unstructured};
use attnkit::{Layout, Tensor, TensorMut};

/// A NaN with a payload no computation produces: output elements that must not be written are
/// pre-filled with it and compared bit for bit afterwards.
pub const SENTINEL: f32 = f32::from_bits(0x7fc0_dead);

/// How the operand is handed to attnkit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// `Tensor::bhld` / `TensorMut::bhld`.
    Bhld,
    /// `Tensor::blhd` / `TensorMut::blhd`.
    Blhd,
    /// `Tensor::strided` / `TensorMut::strided`.
    Strided,
}

/// What the operand is for, which limits the strides it may get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A read-only input: any strides, 0 (broadcast) and overlaps included.
    Input,
    /// A read-only input whose elements must each have their own memory (no broadcast), so that
    /// the buffer length bounds the work a valid call can ask for.
    DenseInput,
    /// The output: non-overlapping strides, or arbitrary ones that the call must refuse if the
    /// view overlaps itself.
    Output,
}

/// Limits on what the target allocates for one operand.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Largest buffer (elements) allocated at the length the view needs.
    pub max_len: usize,
    /// Strides may be wild (huge) sizes.
    pub wild_strides: bool,
}

/// An owned operand: buffer, logical shape, element strides of B, H and L.
#[derive(Clone, Debug)]
pub struct Operand {
    pub form: Form,
    pub shape: [usize; 4],
    pub strides: [usize; 3],
    pub data: Vec<f32>,
    /// Elements the view needs (`None`: the extent overflows).
    pub needed: Option<usize>,
    /// The strides were built to be non-overlapping (always true for the dense forms).
    pub nested: bool,
}

/// Elements a view needs, as attnkit computes it: the largest offset plus one row; 0 when a
/// dimension is 0; `None` on overflow.
pub fn needed_len(shape: [usize; 4], strides: [usize; 3]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    (0..3).try_fold(shape[3], |acc, i| {
        (shape[i] - 1)
            .checked_mul(strides[i])
            .and_then(|s| acc.checked_add(s))
    })
}

impl Operand {
    /// Decodes the form, strides and buffer of an operand of logical `shape`. Faults it
    /// introduces (a buffer too short for the view) are recorded in `expect`. Inputs are filled
    /// from `rng`, outputs with [`SENTINEL`].
    pub fn decode(
        u: &mut Unstructured,
        shape: [usize; 4],
        role: Role,
        budget: Budget,
        rng: &mut Rng,
        expect: &mut Expect,
    ) -> Result<Self> {
        let form = *u.choose(&[Form::Bhld, Form::Blhd, Form::Strided])?;
        let (strides, nested) = match form {
            Form::Bhld => (Layout::Bhld.strides(shape), true),
            Form::Blhd => (Layout::Blhd.strides(shape), true),
            Form::Strided => decode_strides(u, shape, role, budget)?,
        };
        let needed = needed_len(shape, strides);
        let len = decode_len(u, needed, budget.max_len)?;
        match needed {
            Some(n) if n <= len => {}
            _ => expect.fault("buffer shorter than its view"),
        }
        let data = match role {
            Role::Output => vec![SENTINEL; len],
            Role::Input | Role::DenseInput => rng.values(len),
        };
        Ok(Operand {
            form,
            shape,
            strides,
            data,
            needed,
            nested,
        })
    }

    /// An output operand (filled with [`SENTINEL`]). A view that overlaps itself must be refused;
    /// one with free strides permits either outcome (attnkit may judge them conservatively).
    pub fn decode_output(
        u: &mut Unstructured,
        shape: [usize; 4],
        budget: Budget,
        rng: &mut Rng,
        expect: &mut Expect,
    ) -> Result<Self> {
        let out = Operand::decode(u, shape, Role::Output, budget, rng, expect)?;
        match out.overlaps(1 << 16) {
            Some(true) => expect.fault("an output view that overlaps itself"),
            _ if !out.nested => expect.unsure("free output strides"),
            _ => {}
        }
        Ok(out)
    }

    /// Panics unless `got` (this output's buffer after an accepted call) has every element of
    /// the view written and every other element still [`SENTINEL`].
    pub fn assert_written(&self, got: &[f32]) {
        let idx = self
            .elements(self.data.len())
            .expect("an accepted output view has its own memory for each element");
        let mut inside = vec![false; got.len()];
        for i in idx {
            assert!(!inside[i], "accepted an output view that overlaps itself");
            inside[i] = true;
            assert!(
                is_written(got[i]),
                "out[{i}] inside the view was not written"
            );
        }
        let outside = (0..got.len()).find(|&i| !inside[i] && is_written(got[i]));
        assert!(
            outside.is_none(),
            "out[{outside:?}] outside the view was written"
        );
    }

    /// The read-only view.
    pub fn tensor(&self) -> Tensor<'_> {
        match self.form {
            Form::Bhld => Tensor::bhld(&self.data, self.shape),
            Form::Blhd => Tensor::blhd(&self.data, Layout::Blhd.sizes(self.shape)),
            Form::Strided => Tensor::strided(&self.data, self.shape, self.strides),
        }
    }

    /// The writable view.
    pub fn tensor_mut(&mut self) -> TensorMut<'_> {
        match self.form {
            Form::Bhld => TensorMut::bhld(&mut self.data, self.shape),
            Form::Blhd => TensorMut::blhd(&mut self.data, Layout::Blhd.sizes(self.shape)),
            Form::Strided => TensorMut::strided(&mut self.data, self.shape, self.strides),
        }
    }

    /// Buffer index of row `(b, h, l)`; only for views known to fit their buffer.
    pub fn row(&self, b: usize, h: usize, l: usize) -> usize {
        b * self.strides[0] + h * self.strides[1] + l * self.strides[2]
    }

    /// Element `(b, h, l, x)` as f64.
    pub fn at(&self, b: usize, h: usize, l: usize, x: usize) -> f64 {
        f64::from(self.data[self.row(b, h, l) + x])
    }

    /// Whether the view fits its buffer.
    pub fn fits(&self) -> bool {
        self.needed.is_some_and(|n| n <= self.data.len())
    }

    /// Buffer indices of the view's elements, if there are at most `max` of them and the view
    /// fits its buffer (else `None`).
    pub fn elements(&self, max: usize) -> Option<Vec<usize>> {
        let [b, h, l, w] = self.shape;
        let count = crate::gen::product(&self.shape)?;
        if count > max || !self.fits() {
            return None;
        }
        let mut idx = Vec::with_capacity(count);
        if count == 0 {
            return Some(idx); // B·H·L may be huge when rows are empty
        }
        for bi in 0..b {
            for hi in 0..h {
                for li in 0..l {
                    let r = self.row(bi, hi, li);
                    idx.extend(r..r + w);
                }
            }
        }
        Some(idx)
    }

    /// Whether two elements of the view share memory (`None`: too many elements to tell).
    pub fn overlaps(&self, max: usize) -> Option<bool> {
        let idx = self.elements(max)?;
        let mut seen = vec![false; self.data.len()];
        Some(
            idx.into_iter()
                .any(|i| std::mem::replace(&mut seen[i], true)),
        )
    }
}

/// Strides for `Tensor::strided`: nested (each dimension steps over everything inside it, plus
/// padding, in a random dimension order), or free (any value, 0 included) where the role allows.
fn decode_strides(
    u: &mut Unstructured,
    shape: [usize; 4],
    role: Role,
    budget: Budget,
) -> Result<([usize; 3], bool)> {
    let free = match role {
        Role::Input => chance(u, 1, 2)?,
        Role::Output => chance(u, 1, 4)?,
        Role::DenseInput => false,
    };
    if !free {
        return Ok((nested_strides(u, shape, budget)?, true));
    }
    let mut strides = [0; 3];
    for s in &mut strides {
        *s = if budget.wild_strides && chance(u, 1, 4)? {
            wild(u)?
        } else {
            small(u, 64)?
        };
    }
    Ok((strides, false))
}

/// Non-overlapping strides: dimensions in a random order from the innermost out, each stride at
/// least the extent of the ones inside it (saturating for huge shapes).
fn nested_strides(u: &mut Unstructured, shape: [usize; 4], budget: Budget) -> Result<[usize; 3]> {
    const ORDERS: [[usize; 3]; 6] = [
        [2, 1, 0],
        [1, 2, 0],
        [2, 0, 1],
        [0, 2, 1],
        [1, 0, 2],
        [0, 1, 2],
    ];
    let order = *u.choose(&ORDERS)?;
    let mut span = shape[3];
    let mut strides = [0; 3];
    for dim in order {
        let pad = if budget.wild_strides && chance(u, 1, 8)? {
            wild(u)?
        } else if chance(u, 1, 2)? {
            small(u, 16)?
        } else {
            0
        };
        strides[dim] = span.saturating_add(pad);
        span = strides[dim]
            .saturating_mul(shape[dim].saturating_sub(1))
            .saturating_add(span);
    }
    Ok(strides)
}

/// A buffer length for a view needing `needed` elements: the exact length, some padding, or
/// (rarely) too short; a tiny buffer when the view needs more than `max_len` or overflows.
fn decode_len(u: &mut Unstructured, needed: Option<usize>, max_len: usize) -> Result<usize> {
    match needed {
        Some(n) if n <= max_len => {
            if n > 0 && chance(u, 1, 16)? {
                Ok(u.int_in_range(0..=n - 1)?)
            } else if chance(u, 1, 4)? {
                Ok(n + u.int_in_range(1..=8)?)
            } else {
                Ok(n)
            }
        }
        _ => u.int_in_range(0..=64),
    }
}

/// Whether `x` is no longer the [`SENTINEL`].
pub fn is_written(x: f32) -> bool {
    x.to_bits() != SENTINEL.to_bits()
}

/// Panics unless `buf` is all [`SENTINEL`] (a refused call wrote nothing).
pub fn assert_untouched(what: &str, buf: &[f32]) {
    let i = buf.iter().position(|&x| is_written(x));
    assert!(i.is_none(), "a refused call wrote {what}[{i:?}]");
}

/// Panics unless `a` and `b` are equal bit for bit (`what` names them in the message).
pub fn assert_same_bits(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let i = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(i.is_none(), "{what}[{i:?}] differs");
}
