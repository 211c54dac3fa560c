//! A decoder's KV cache, one per layer, over either of attnkit's caches: the dense
//! [`KvCache`] or the paged [`PagedKvCache`], each storing f32, bf16, f16 or int8.

use attnkit::{KvCache, Operand, PagedKvCache, Result, SdpaOptions, SeqId, Tensor, TensorMut};

/// The cache of every layer of a model, for a fixed batch of sequences.
pub trait KvStore {
    /// Appends `T` tokens to every sequence of layer `layer`: `k`, `v (B, Hkv, T, D)`.
    fn append(&mut self, layer: usize, k: &Tensor<f32>, v: &Tensor<f32>) -> Result<()>;
    /// Cuts sequence `seq` back to `len` tokens in every layer.
    fn truncate(&mut self, seq: usize, len: usize) -> Result<()>;
    /// Attention of the newest `Lq` tokens' queries `q (B, Hq, Lq, D)` over layer `layer`.
    fn attend(
        &self,
        layer: usize,
        q: &Tensor<f32>,
        out: &mut TensorMut<f32>,
        opts: &SdpaOptions,
    ) -> Result<()>;
}

/// One [`KvCache`] per layer.
pub struct Dense<E: Operand>(pub Vec<KvCache<E>>);

impl<E: Operand> Dense<E> {
    /// `layers` caches of `batch` sequences of up to `capacity` tokens.
    pub fn new(
        layers: usize,
        batch: usize,
        kv_heads: usize,
        capacity: usize,
        head_dim: usize,
    ) -> Result<Self> {
        (0..layers)
            .map(|_| KvCache::new_of(batch, kv_heads, capacity, head_dim, head_dim))
            .collect::<Result<_>>()
            .map(Dense)
    }
}

impl<E: Operand> KvStore for Dense<E> {
    fn append(&mut self, layer: usize, k: &Tensor<f32>, v: &Tensor<f32>) -> Result<()> {
        self.0[layer].append(k, v)
    }
    fn truncate(&mut self, seq: usize, len: usize) -> Result<()> {
        self.0.iter_mut().try_for_each(|c| c.truncate(seq, len))
    }
    fn attend(
        &self,
        layer: usize,
        q: &Tensor<f32>,
        out: &mut TensorMut<f32>,
        opts: &SdpaOptions,
    ) -> Result<()> {
        self.0[layer].attend(q, out, opts)
    }
}

/// One [`PagedKvCache`] pool per layer, holding the batch's sequences.
pub struct Paged<E: Operand> {
    pub pools: Vec<PagedKvCache<E>>,
    /// The batch's sequences, by layer.
    pub seqs: Vec<Vec<SeqId>>,
}

impl<E: Operand> Paged<E> {
    /// `layers` pools of `pages` pages of `page_len` tokens, each with `batch` empty sequences.
    pub fn new(
        layers: usize,
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
        page_len: usize,
        pages: usize,
    ) -> Result<Self> {
        let mut pools = Vec::with_capacity(layers);
        let mut seqs = Vec::with_capacity(layers);
        for _ in 0..layers {
            let mut pool = PagedKvCache::new_of(kv_heads, head_dim, head_dim, page_len, pages)?;
            seqs.push((0..batch).map(|_| pool.add_sequence()).collect());
            pools.push(pool);
        }
        Ok(Paged { pools, seqs })
    }
}

impl<E: Operand> KvStore for Paged<E> {
    fn append(&mut self, layer: usize, k: &Tensor<f32>, v: &Tensor<f32>) -> Result<()> {
        self.pools[layer].append(&self.seqs[layer], k, v)
    }
    fn truncate(&mut self, seq: usize, len: usize) -> Result<()> {
        for (pool, seqs) in self.pools.iter_mut().zip(&self.seqs) {
            pool.truncate(seqs[seq], len)?;
        }
        Ok(())
    }
    fn attend(
        &self,
        layer: usize,
        q: &Tensor<f32>,
        out: &mut TensorMut<f32>,
        opts: &SdpaOptions,
    ) -> Result<()> {
        self.pools[layer].attend(&self.seqs[layer], q, out, opts)
    }
}
