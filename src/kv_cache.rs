//! A key/value cache for incremental decoding, laid out for the decode kernel: keys
//! `(B, Hkv, capacity, D)` and values `(B, Hkv, capacity, Dv)`, so each (batch, KV head) streams
//! its rows contiguously, stored as f32, bf16, f16 (half the bytes per token to stream) or int8
//! with an f32 scale per (token, head) row (a quarter, plus 4 bytes a row).

use crate::alloc::{checked_len, try_zeros};
use crate::error::{AttnError, Result};
use crate::options::{Causal, KeyLengths, SdpaOptions};
use crate::pages::AlignedBuf;
use crate::sdpa::sdpa_scaled;
use crate::view::{check_len, Tensor, TensorMut};
use crate::Extras;
use attnkit_kernels::{Dtype, Elem, Operand};

/// One layer's cache. Capacity is fixed at construction: appending past it is an error, never a
/// silent overwrite or a reallocation behind the caller's back. The buffers are allocated zeroed,
/// on a cache line, and advised for transparent huge pages ([`crate::AlignedBuf`]) before first
/// use (a clone copies into ordinary pages).
///
/// The element type `E` is the storage: `KvCache` (f32, [`KvCache::new`]),
/// `KvCache::<bf16>::new_of(…)` / `f16`, or `KvCache::<i8>::new_of(…)`.
/// [`append`](KvCache::append) takes keys and values of any element type and rounds them to
/// `E` (round to nearest even); the kernels widen them back to f32 as they stream them and
/// compute in f32, so a 16-bit cache's attention equals the f32 attention of the stored
/// (rounded) values.
///
/// **int8.** Each appended row (one token of one KV head, keys and values apart) is quantised
/// symmetrically with its own f32 scale, `scale = max|x| / 127`, `q = round(x / scale)` (see
/// [`Stored::encode`](crate::Stored::encode)); the scales live beside the data
/// ([`key_scales`](KvCache::key_scales)). Attention equals the f32 attention of the
/// dequantised values `scale·q` (the kernels apply the scales in f32 and add no error of their
/// own); the quantisation error itself is measured in BENCHMARKS.md. A row holding NaN or an
/// infinity has no finite scale: the append is refused ([`AttnError::NonFinite`]), nothing is
/// written. The float caches store such values as they are.
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
    /// int8 only (else empty): the row scales of `k` and `v`, `(B, Hkv, capacity)` dense.
    kscale: Vec<f32>,
    vscale: Vec<f32>,
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
        let rows = if E::DTYPE == Dtype::I8 {
            prod(&[b, hkv, capacity])?
        } else {
            0
        };
        let kscale = try_zeros::<f32>(arg, rows)?;
        let vscale = try_zeros::<f32>(arg, rows)?;
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
            kscale,
            vscale,
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
    /// layout and element type, rounded (or, int8, quantised) to the cache's (exact when they
    /// are the same). Nothing is written unless the whole append is accepted. Token `t` of a
    /// longer projection `x`: `x.rows(t..t + 1)?` ([`Tensor::rows`]).
    ///
    /// # Errors
    /// A shape mismatch naming `k`/`v` and the dimension; [`AttnError::Capacity`] if a sequence
    /// would exceed the capacity; for an int8 cache, [`AttnError::NonFinite`] naming the first
    /// row that holds NaN or an infinity.
    pub fn append<A: Elem>(&mut self, k: &Tensor<A>, v: &Tensor<A>) -> Result<()> {
        let t = check_append(k, v, [self.b, self.hkv, self.d, self.dv])?;
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
        if E::DTYPE == Dtype::I8 {
            check_finite(k, v, [self.b, self.hkv, self.d, self.dv])?;
        }
        for (src, dst, scales, ds, w) in [
            (k, &mut self.k, &mut self.kscale, self.ks, self.d),
            (v, &mut self.v, &mut self.vscale, self.vs, self.dv),
        ] {
            if w == 0 {
                continue;
            }
            for (b, h, i) in rows(self.b, self.hkv, t) {
                let tok = self.lens[b] + i;
                let o = b * ds[0] + h * ds[1] + tok * ds[2];
                let scale = E::encode(append_row(src, w, b, h, i), &mut dst[o..o + w]);
                if let Some(s) = scales.get_mut((b * self.hkv + h) * self.cap + tok) {
                    *s = scale;
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

    /// An int8 cache's key scales, `(B, Hkv, capacity)` dense: key row `(b, h, j)` is
    /// `key_scales()[(b·Hkv + h)·capacity + j]` times its int8 values in [`keys`](Self::keys).
    /// Empty for the float caches.
    pub fn key_scales(&self) -> &[f32] {
        &self.kscale
    }

    /// The value scales, as [`key_scales`](Self::key_scales).
    pub fn value_scales(&self) -> &[f32] {
        &self.vscale
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
            key_lengths: Some(KeyLengths::Usize(&self.lens)),
            ..*opts
        };
        let (k, v) = (self.keys(), self.values());
        let (ks, vs) = (self.key_scales_view(), self.value_scales_view());
        let scales = (E::DTYPE == Dtype::I8).then_some([&ks, &vs]);
        sdpa_scaled(q, &k, &v, scales, out, &opts, Extras::default())
    }

    /// The scales as `(B, Hkv, L, 1)` views beside [`keys`](Self::keys) / `values`.
    fn key_scales_view(&self) -> Tensor<'_, f32> {
        let shape = [self.b, self.hkv, self.max_len(), 1];
        Tensor::strided(&self.kscale, shape, [self.hkv * self.cap, self.cap, 1])
    }

    fn value_scales_view(&self) -> Tensor<'_, f32> {
        let shape = [self.b, self.hkv, self.max_len(), 1];
        Tensor::strided(&self.vscale, shape, [self.hkv * self.cap, self.cap, 1])
    }
}

/// Checks an append's `k (B, Hkv, T, D)` and `v (B, Hkv, T, Dv)` against `[B, Hkv, D, Dv]` and
/// their buffers; returns `T`.
pub(crate) fn check_append<A: Elem>(
    k: &Tensor<A>,
    v: &Tensor<A>,
    sizes: [usize; 4],
) -> Result<usize> {
    let [b, hkv, d, dv] = sizes;
    let t = k.shape[2];
    for (arg, x, w) in [("k", k, d), ("v", v, dv)] {
        let want = [b, hkv, t, w];
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
    Ok(t)
}

/// Row `(b, h, i)` of a checked append input, `w` wide (call it only for `w > 0`: an empty
/// view's strides may point anywhere).
pub(crate) fn append_row<'a, A>(
    x: &Tensor<'a, A>,
    w: usize,
    b: usize,
    h: usize,
    i: usize,
) -> &'a [A] {
    let so = b * x.strides[0] + h * x.strides[1] + i * x.strides[2];
    &x.data[so..so + w]
}

/// For an int8 cache: [`AttnError::NonFinite`] naming the first row of a checked append that
/// holds NaN or an infinity (keys first).
pub(crate) fn check_finite<A: Elem>(k: &Tensor<A>, v: &Tensor<A>, sizes: [usize; 4]) -> Result<()> {
    let [b, hkv, d, dv] = sizes;
    for (arg, x, w) in [("k", k, d), ("v", v, dv)] {
        for (bi, h, i) in rows(b, hkv, x.shape[2]).filter(|_| w > 0) {
            if append_row(x, w, bi, h, i)
                .iter()
                .any(|e| !e.to_f32().is_finite())
            {
                return Err(AttnError::NonFinite {
                    arg,
                    batch: bi,
                    head: h,
                    token: i,
                });
            }
        }
    }
    Ok(())
}

/// Every (batch, KV head, token) row of a `t`-token append to `nb` sequences of `nh` heads.
fn rows(nb: usize, nh: usize, t: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..nb).flat_map(move |b| (0..nh).flat_map(move |h| (0..t).map(move |i| (b, h, i))))
}
