//! A key/value cache for incremental decoding, laid out for the decode kernel: keys
//! `(B, Hkv, capacity, D)` and values `(B, Hkv, capacity, Dv)`, so each (batch, KV head) streams
//! its rows contiguously.

use crate::error::{AttnError, Result};
use crate::options::{Causal, SdpaOptions};
use crate::pages::AlignedBuf;
use crate::sdpa::sdpa;
use crate::view::{check_len, Tensor, TensorMut};

/// One layer's cache. Capacity is fixed at construction: appending past it is an error, never a
/// silent overwrite or a reallocation behind the caller's back. The buffers are allocated zeroed,
/// on a cache line, and advised for transparent huge pages ([`crate::AlignedBuf`]) before first
/// use (a clone copies into ordinary pages).
#[derive(Clone, Debug)]
pub struct KvCache {
    b: usize,
    hkv: usize,
    cap: usize,
    d: usize,
    dv: usize,
    k: AlignedBuf,
    v: AlignedBuf,
    lens: Vec<usize>,
}

impl KvCache {
    /// An empty cache for `b` sequences, `hkv` KV heads, up to `capacity` tokens, head dims `d`
    /// (keys) and `dv` (values).
    ///
    /// # Errors
    /// [`AttnError::Overflow`] if the buffers' sizes overflow.
    pub fn new(b: usize, hkv: usize, capacity: usize, d: usize, dv: usize) -> Result<Self> {
        let size = |x: usize| {
            [b, hkv, capacity, x]
                .iter()
                .try_fold(1usize, |a, &y| a.checked_mul(y))
                .ok_or(AttnError::Overflow { arg: "capacity" })
        };
        // Decode streams the whole cache per token: ask for huge pages, and start on a cache
        // line (see `pages.rs`).
        let k = AlignedBuf::zeroed(size(d)?, true);
        let v = AlignedBuf::zeroed(size(dv)?, true);
        Ok(KvCache {
            b,
            hkv,
            cap: capacity,
            d,
            dv,
            k,
            v,
            lens: vec![0; b],
        })
    }

    /// Valid tokens per sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Tokens each sequence can hold.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Appends `T` new tokens to every sequence: `k (B, Hkv, T, D)`, `v (B, Hkv, T, Dv)` in any
    /// layout. Nothing is written unless every sequence has room.
    ///
    /// # Errors
    /// A shape mismatch naming `k`/`v` and the dimension; [`AttnError::Capacity`] if a sequence
    /// would exceed the capacity.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.shape[2];
        for (arg, x, d) in [("k", k, self.d), ("v", v, self.dv)] {
            let want = [self.b, self.hkv, t, d];
            for (i, dim) in ["B", "H", "L", "D"].into_iter().enumerate() {
                if x.shape[i] != want[i] {
                    return Err(AttnError::ShapeMismatch {
                        arg,
                        dim,
                        expected: want[i],
                        got: x.shape[i],
                    });
                }
            }
            check_len(arg, x.data.len(), x.shape, x.strides)?;
        }
        if let Some((batch, &len)) = self
            .lens
            .iter()
            .enumerate()
            .find(|(_, &l)| l + t > self.cap)
        {
            return Err(AttnError::Capacity {
                batch,
                len,
                append: t,
                capacity: self.cap,
            });
        }
        for b in 0..self.b {
            for h in 0..self.hkv {
                for i in 0..t {
                    let row = (b * self.hkv + h) * self.cap + self.lens[b] + i;
                    let ko = b * k.strides[0] + h * k.strides[1] + i * k.strides[2];
                    let vo = b * v.strides[0] + h * v.strides[1] + i * v.strides[2];
                    self.k[row * self.d..(row + 1) * self.d]
                        .copy_from_slice(&k.data[ko..ko + self.d]);
                    self.v[row * self.dv..(row + 1) * self.dv]
                        .copy_from_slice(&v.data[vo..vo + self.dv]);
                }
            }
        }
        for l in &mut self.lens {
            *l += t;
        }
        Ok(())
    }

    /// Shortens sequence `b` to `len` tokens (rollback, e.g. after rejected speculative tokens).
    ///
    /// # Errors
    /// [`AttnError::ShapeMismatch`] for a bad batch index; [`AttnError::KeyLength`] if `len` is
    /// longer than the sequence.
    pub fn truncate(&mut self, b: usize, len: usize) -> Result<()> {
        if b >= self.b {
            return Err(AttnError::ShapeMismatch {
                arg: "batch",
                dim: "B",
                expected: self.b,
                got: b,
            });
        }
        if len > self.lens[b] {
            return Err(AttnError::KeyLength {
                batch: b,
                len,
                lk: self.lens[b],
            });
        }
        self.lens[b] = len;
        Ok(())
    }

    /// Shortens every sequence to at most `len` tokens.
    pub fn truncate_all(&mut self, len: usize) {
        for l in &mut self.lens {
            *l = (*l).min(len);
        }
    }

    /// The cached keys as a `(B, Hkv, L, D)` view, `L` the longest sequence.
    pub fn keys(&self) -> Tensor<'_> {
        let l = self.max_len();
        Tensor::strided(
            &self.k,
            [self.b, self.hkv, l, self.d],
            [self.hkv * self.cap * self.d, self.cap * self.d, self.d],
        )
    }

    /// The cached values as a `(B, Hkv, L, Dv)` view, `L` the longest sequence.
    pub fn values(&self) -> Tensor<'_> {
        let l = self.max_len();
        Tensor::strided(
            &self.v,
            [self.b, self.hkv, l, self.dv],
            [self.hkv * self.cap * self.dv, self.cap * self.dv, self.dv],
        )
    }

    fn max_len(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }

    /// Attention of `q (B, Hq, Lq, D)` — the newest `Lq` tokens, already appended — over the
    /// cache: bottom-right causal per sequence (query `i` of sequence `b` sees keys
    /// `j ≤ lens[b] − Lq + i`), key padding from the lengths, plus whatever else `opts` sets
    /// (window, mask, ISA, path). Writes `out (B, Hq, Lq, Dv)`.
    ///
    /// # Errors
    /// As [`crate::sdpa`].
    ///
    /// ```
    /// use attnkit::{KvCache, SdpaOptions, Tensor, TensorMut};
    /// let (b, h, d) = (1, 2, 4);
    /// let mut cache = KvCache::new(b, h, 16, d, d)?;
    /// let kv = vec![0.5f32; b * h * d];
    /// cache.append(&Tensor::bhld(&kv, [b, h, 1, d]), &Tensor::bhld(&kv, [b, h, 1, d]))?;
    /// let mut out = vec![0.0f32; b * h * d];
    /// cache.attend(&Tensor::bhld(&kv, [b, h, 1, d]), &mut TensorMut::bhld(&mut out, [b, h, 1, d]), &SdpaOptions::new())?;
    /// assert_eq!(out, kv);
    /// # Ok::<(), attnkit::AttnError>(())
    /// ```
    pub fn attend(&self, q: &Tensor, out: &mut TensorMut, opts: &SdpaOptions) -> Result<()> {
        let opts = SdpaOptions {
            causal: Some(Causal::BottomRight),
            key_lengths: Some(&self.lens),
            ..*opts
        };
        sdpa(q, &self.keys(), &self.values(), out, &opts)
    }
}
