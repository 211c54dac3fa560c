//! A key/value cache for incremental decoding, laid out for the decode kernel: keys
//! `(B, Hkv, capacity, D)` and values `(B, Hkv, capacity, Dv)`, so each (batch, KV head) streams
//! its rows contiguously, stored as f32, bf16 or f16 (half the bytes per token to stream).

use crate::alloc::{checked_len, try_zeros};
use crate::error::{AttnError, Result};
use crate::options::{Causal, SdpaOptions};
use crate::pages::AlignedBuf;
use crate::sdpa::sdpa;
use crate::view::{check_len, Tensor, TensorMut};
use attnkit_kernels::{Dtype, Elem, Operand};

/// One layer's cache. Capacity is fixed at construction: appending past it is an error, never a
/// silent overwrite or a reallocation behind the caller's back. The buffers are allocated zeroed,
/// on a cache line, and advised for transparent huge pages ([`crate::AlignedBuf`]) before first
/// use (a clone copies into ordinary pages).
///
/// The element type `E` is the storage: `KvCache` (f32, [`KvCache::new`]) or
/// `KvCache::<bf16>::new_of(…)` / `f16`. [`append`](KvCache::append) takes keys and values of
/// any element type and rounds them to `E` (round to nearest even); the decode kernel widens
/// them back to f32 as it streams them and computes in f32, so a 16-bit cache's attention
/// equals the f32 attention of the stored (rounded) values.
#[derive(Clone, Debug)]
pub struct KvCache<E: Operand = f32> {
    b: usize,
    hkv: usize,
    cap: usize,
    d: usize,
    dv: usize,
    /// Element strides of B, H and L in `k` and `v`.
    ks: [usize; 3],
    vs: [usize; 3],
    k: AlignedBuf<E>,
    v: AlignedBuf<E>,
    lens: Vec<usize>,
}

/// An allocation error of the cache's buffers, named after the argument that sized them.
fn rename(e: AttnError, arg: &'static str) -> AttnError {
    match e {
        AttnError::Alloc { bytes, .. } => AttnError::Alloc { arg, bytes },
        AttnError::Overflow { .. } => AttnError::Overflow { arg },
        e => e,
    }
}

impl KvCache {
    /// An empty f32 cache for `b` sequences, `hkv` KV heads, up to `capacity` tokens, head dims
    /// `d` (keys) and `dv` (values).
    ///
    /// # Errors
    /// [`AttnError::Overflow`] if the buffers' sizes overflow, [`AttnError::Alloc`] if the
    /// allocator refuses them (nothing is allocated before the sizes are checked).
    pub fn new(b: usize, hkv: usize, capacity: usize, d: usize, dv: usize) -> Result<Self> {
        Self::new_of(b, hkv, capacity, d, dv)
    }
}

impl<E: Operand> KvCache<E> {
    /// [`KvCache::new`] storing `E`: `KvCache::<bf16>::new_of(b, hkv, capacity, d, dv)`.
    ///
    /// # Errors
    /// As [`KvCache::new`].
    pub fn new_of(b: usize, hkv: usize, capacity: usize, d: usize, dv: usize) -> Result<Self> {
        let arg = "capacity";
        // Every product of the caller's sizes that is ever formed (lengths, strides, the row
        // count of the append loop) is checked, including those a zero dimension would hide.
        let prod = |dims: &[usize]| checked_len(arg, dims);
        prod(&[b, hkv, capacity])?;
        let ks = [prod(&[hkv, capacity, d])?, prod(&[capacity, d])?, d];
        let vs = [prod(&[hkv, capacity, dv])?, prod(&[capacity, dv])?, dv];
        let (klen, vlen) = (
            prod(&[b, hkv, capacity, d])?,
            prod(&[b, hkv, capacity, dv])?,
        );
        let lens = try_zeros::<usize>("B", b)?;
        // Decode streams the whole cache per token: ask for huge pages, and start on a cache
        // line (see `pages.rs`).
        let k = AlignedBuf::try_zeroed_of(klen, true).map_err(|e| rename(e, arg))?;
        let v = AlignedBuf::try_zeroed_of(vlen, true).map_err(|e| rename(e, arg))?;
        Ok(KvCache {
            b,
            hkv,
            cap: capacity,
            d,
            dv,
            ks,
            vs,
            k,
            v,
            lens,
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

    /// The storage type.
    pub fn dtype(&self) -> Dtype {
        E::DTYPE
    }

    /// Appends `T` new tokens to every sequence: `k (B, Hkv, T, D)`, `v (B, Hkv, T, Dv)` in any
    /// layout and element type, rounded to the cache's (exact when they are the same). Nothing
    /// is written unless every sequence has room. Token `t` of a longer projection `x`:
    /// `x.rows(t..t + 1)?` ([`Tensor::rows`]).
    ///
    /// # Errors
    /// A shape mismatch naming `k`/`v` and the dimension; [`AttnError::Capacity`] if a sequence
    /// would exceed the capacity.
    pub fn append<A: Elem>(&mut self, k: &Tensor<A>, v: &Tensor<A>) -> Result<()> {
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
        // `len ≤ cap` always, so `cap − len` is the room left (`len + t` could wrap).
        if let Some((batch, &len)) = self
            .lens
            .iter()
            .enumerate()
            .find(|(_, &l)| t > self.cap - l)
        {
            return Err(AttnError::Capacity {
                batch,
                len,
                append: t,
                capacity: self.cap,
            });
        }
        // Empty rows have nothing to copy (and an empty view's strides may point anywhere).
        for (src, dst, ds, w) in [
            (k, &mut self.k, self.ks, self.d),
            (v, &mut self.v, self.vs, self.dv),
        ] {
            if w == 0 {
                continue;
            }
            for b in 0..self.b {
                for h in 0..self.hkv {
                    for i in 0..t {
                        let o = b * ds[0] + h * ds[1] + (self.lens[b] + i) * ds[2];
                        let so = b * src.strides[0] + h * src.strides[1] + i * src.strides[2];
                        store(&mut dst[o..o + w], &src.data[so..so + w]);
                    }
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
    pub fn keys(&self) -> Tensor<'_, E> {
        let l = self.max_len();
        Tensor::strided(&self.k, [self.b, self.hkv, l, self.d], self.ks)
    }

    /// The cached values as a `(B, Hkv, L, Dv)` view, `L` the longest sequence.
    pub fn values(&self) -> Tensor<'_, E> {
        let l = self.max_len();
        Tensor::strided(&self.v, [self.b, self.hkv, l, self.dv], self.vs)
    }

    fn max_len(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }

    /// Attention of `q (B, Hq, Lq, D)` — the newest `Lq` tokens, already appended — over the
    /// cache: bottom-right causal per sequence (query `i` of sequence `b` sees keys
    /// `j ≤ lens[b] − Lq + i`), key padding from the lengths, plus whatever else `opts` sets
    /// (window, mask, ISA, path). Writes `out (B, Hq, Lq, Dv)`, in f32 or the 16-bit types.
    /// The queries may be of any operand type: f32 queries over a bf16 or f16 cache keep their
    /// precision (the cache's values are widened exactly on load).
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
    pub fn attend<Q: Elem, O: Elem>(
        &self,
        q: &Tensor<Q>,
        out: &mut TensorMut<O>,
        opts: &SdpaOptions,
    ) -> Result<()> {
        let opts = SdpaOptions {
            causal: Some(Causal::BottomRight),
            key_lengths: Some(&self.lens),
            ..*opts
        };
        sdpa(q, &self.keys(), &self.values(), out, &opts)
    }
}

/// `src` rounded to `E` into `dst` (a copy when the types agree).
fn store<A: Elem, E: Elem>(dst: &mut [E], src: &[A]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = E::from_f32(s.to_f32());
    }
}
