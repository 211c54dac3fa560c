//! [`StateDict`]: named weight tensors, as PyTorch's `module.state_dict()`, read from and written
//! to `.safetensors` files with the `safetensors` crate (the `safetensors` feature, default on).

use crate::error::{AttnError, Result};
#[cfg(feature = "safetensors")]
use safetensors::tensor::{SafeTensors, TensorView};
use std::collections::BTreeMap;
#[cfg(feature = "safetensors")]
use std::path::Path;

/// `{prefix}.{name}`, or `name` for an empty prefix; a prefix may already end with `.`.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else if prefix.ends_with('.') {
        format!("{prefix}{name}")
    } else {
        format!("{prefix}.{name}")
    }
}

/// A stored tensor's element type: the four a layer reads, or (from a file) any other.
// Without files, tensors come from `insert` (F32) only.
#[cfg_attr(not(feature = "safetensors"), allow(dead_code))]
#[derive(Clone, Debug, PartialEq)]
enum Dtype {
    F32,
    F64,
    BF16,
    F16,
    #[cfg(feature = "safetensors")]
    Other(safetensors::Dtype),
}

#[cfg(feature = "safetensors")]
impl Dtype {
    fn from_file(d: safetensors::Dtype) -> Self {
        use safetensors::Dtype as S;
        match d {
            S::F32 => Dtype::F32,
            S::F64 => Dtype::F64,
            S::BF16 => Dtype::BF16,
            S::F16 => Dtype::F16,
            other => Dtype::Other(other),
        }
    }
    fn to_file(&self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            Dtype::F32 => S::F32,
            Dtype::F64 => S::F64,
            Dtype::BF16 => S::BF16,
            Dtype::F16 => S::F16,
            Dtype::Other(d) => *d,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    /// Little-endian element bytes, as stored in the file.
    bytes: Vec<u8>,
}

/// Named tensors, PyTorch `state_dict` style (`"attn.in_proj_weight"` → a `(3E, E)` tensor).
///
/// Tensors keep the dtype they were stored with and are converted to f32 when a layer reads
/// them: F32 as is, F64 rounded to nearest, F16 and BF16 exactly. Other dtypes (integers,
/// bools, 8-bit floats) load fine, since a checkpoint may hold them for other modules, but a
/// layer asking for one as a weight gets [`AttnError::WeightDtype`].
///
/// A PyTorch checkpoint becomes a `.safetensors` file with
/// `safetensors.torch.save_file(model.state_dict(), "model.safetensors")`; reading and writing
/// files needs the `safetensors` feature (default on).
///
/// ```
/// use attnkit::StateDict;
/// let mut sd = StateDict::new();
/// sd.insert("proj.weight", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
/// let bytes = sd.to_safetensors()?;
/// let back = StateDict::from_safetensors(&bytes)?;
/// let (shape, data) = back.tensor("proj.weight")?;
/// assert_eq!((shape, data[5]), (vec![2, 3], 6.0));
/// # Ok::<(), attnkit::AttnError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateDict {
    entries: BTreeMap<String, Entry>,
}

#[cfg(feature = "safetensors")]
fn st_err(path: &str, e: impl std::fmt::Display) -> AttnError {
    AttnError::Checkpoint {
        path: path.to_string(),
        reason: e.to_string(),
    }
}

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        Self::default()
    }

    #[cfg(feature = "safetensors")]
    /// Reads a `.safetensors` file.
    ///
    /// # Errors
    /// [`AttnError::Checkpoint`] naming the path, for an I/O error or a malformed file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| st_err(&shown, e))?;
        Self::parse(&bytes, &shown)
    }

    #[cfg(feature = "safetensors")]
    /// Parses the bytes of a `.safetensors` file.
    ///
    /// # Errors
    /// [`AttnError::Checkpoint`] for a malformed buffer.
    pub fn from_safetensors(bytes: &[u8]) -> Result<Self> {
        Self::parse(bytes, "<bytes>")
    }

    #[cfg(feature = "safetensors")]
    fn parse(bytes: &[u8], shown: &str) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| st_err(shown, e))?;
        let mut entries = BTreeMap::new();
        for (name, view) in st.iter() {
            let entry = Entry {
                dtype: Dtype::from_file(view.dtype()),
                shape: view.shape().to_vec(),
                bytes: view.data().to_vec(),
            };
            entries.insert(name.to_string(), entry);
        }
        Ok(StateDict { entries })
    }

    #[cfg(feature = "safetensors")]
    /// Serialises to the bytes of a `.safetensors` file (tensors keep their dtypes).
    ///
    /// # Errors
    /// [`AttnError::Checkpoint`] if the `safetensors` crate refuses the tensors.
    pub fn to_safetensors(&self) -> Result<Vec<u8>> {
        let views = self.views("<bytes>")?;
        safetensors::serialize(views, None).map_err(|e| st_err("<bytes>", e))
    }

    #[cfg(feature = "safetensors")]
    /// Writes a `.safetensors` file.
    ///
    /// # Errors
    /// [`AttnError::Checkpoint`] naming the path, for an I/O or serialisation error.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let views = self.views(&shown)?;
        safetensors::serialize_to_file(views, None, path).map_err(|e| st_err(&shown, e))
    }

    #[cfg(feature = "safetensors")]
    fn views(&self, shown: &str) -> Result<Vec<(&str, TensorView<'_>)>> {
        self.entries
            .iter()
            .map(|(name, e)| {
                TensorView::new(e.dtype.to_file(), e.shape.clone(), &e.bytes)
                    .map(|v| (name.as_str(), v))
                    .map_err(|err| st_err(shown, err))
            })
            .collect()
    }

    /// Adds (or replaces) an f32 tensor.
    ///
    /// # Errors
    /// [`AttnError::WeightShape`] if `data.len()` is not the product of `shape` (reported as
    /// `got: [data.len()]`).
    pub fn insert(&mut self, name: impl Into<String>, shape: &[usize], data: &[f32]) -> Result<()> {
        let name = name.into();
        let n = shape.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
        if n != Some(data.len()) {
            return Err(AttnError::WeightShape {
                name,
                expected: shape.to_vec(),
                got: vec![data.len()],
            });
        }
        self.insert_unchecked(name, shape.to_vec(), data);
        Ok(())
    }

    pub(crate) fn insert_unchecked(&mut self, name: String, shape: Vec<usize>, data: &[f32]) {
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.entries.insert(
            name,
            Entry {
                dtype: Dtype::F32,
                shape,
                bytes,
            },
        );
    }

    /// Removes a tensor, returning whether it was there.
    pub fn remove(&mut self, name: &str) -> bool {
        self.entries.remove(name).is_some()
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// A tensor's shape and its elements converted to f32 (row-major).
    ///
    /// # Errors
    /// [`AttnError::MissingTensor`], or [`AttnError::WeightDtype`] for a dtype other than F32,
    /// F64, F16, BF16.
    pub fn tensor(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| AttnError::MissingTensor {
                name: name.to_string(),
            })?;
        Ok((e.shape.clone(), convert(name, e)?))
    }

    pub(crate) fn shape_of(&self, name: &str) -> Result<&[usize]> {
        self.shape(name).ok_or_else(|| AttnError::MissingTensor {
            name: name.to_string(),
        })
    }

    /// The tensor `name`, which must have exactly `expected` shape.
    pub(crate) fn weight(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| AttnError::MissingTensor {
                name: name.to_string(),
            })?;
        if e.shape != expected {
            return Err(AttnError::WeightShape {
                name: name.to_string(),
                expected: expected.to_vec(),
                got: e.shape.clone(),
            });
        }
        convert(name, e)
    }

    /// As [`StateDict::weight`], `None` if absent.
    pub(crate) fn optional_weight(
        &self,
        name: &str,
        expected: &[usize],
    ) -> Result<Option<Vec<f32>>> {
        if self.contains(name) {
            self.weight(name, expected).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Elements of `e` as f32.
#[cfg_attr(not(feature = "safetensors"), allow(unused_variables))]
fn convert(name: &str, e: &Entry) -> Result<Vec<f32>> {
    let b = &e.bytes;
    let out = match e.dtype {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        #[cfg(feature = "safetensors")]
        Dtype::Other(other) => {
            return Err(AttnError::WeightDtype {
                name: name.to_string(),
                dtype: other.to_string(),
            })
        }
    };
    Ok(out)
}

/// IEEE binary16 → binary32, exact (subnormals, infinities and NaN included).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: man · 2^-24, exactly representable in f32.
            let v = man as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::f16_to_f32;

    #[test]
    fn f16_conversion() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
    }
}
