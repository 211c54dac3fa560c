//! A BERT encoder with sentence-transformers' mean pooling: all-MiniLM-L6-v2 read from its own
//! checkpoint (`model.safetensors`, `config.json`, `tokenizer.json`).
//!
//! A batch of sentences is padded to its longest; attention sees each sentence's real tokens
//! only through attnkit's key lengths (what transformers does with an additive padding mask),
//! and the pooling averages the real tokens.

use crate::ops::{self, apply, Error, Profile, Result};
use crate::read_config;
use attnkit::{sdpa, Linear, Par, SdpaOptions, StateDict, Tensor, TensorMut};
use std::path::Path;
use std::time::Instant;
use tokenizers::{Tokenizer, TruncationParams};

/// The `config.json` fields the encoder uses.
#[derive(Clone, Debug)]
pub struct BertConfig {
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_positions: usize,
    pub eps: f32,
}

struct LayerNorm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
}

impl LayerNorm {
    fn load(sd: &StateDict, prefix: &str, w: usize) -> Result<Self> {
        Ok(LayerNorm {
            gamma: ops::weight(sd, &format!("{prefix}.weight"), &[w])?,
            beta: ops::weight(sd, &format!("{prefix}.bias"), &[w])?,
        })
    }
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    out: Linear,
    out_norm: LayerNorm,
}

/// The encoder: embeddings, `layers` × (self-attention + GELU feed-forward, post-norm).
pub struct Bert {
    pub cfg: BertConfig,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
}

impl Bert {
    /// Reads `config.json` and `model.safetensors` from `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        let c = read_config(dir)?;
        let get = |k: &str| {
            c[k].as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| Error::Config(format!("{k} missing")))
        };
        let cfg = BertConfig {
            hidden: get("hidden_size")?,
            heads: get("num_attention_heads")?,
            layers: get("num_hidden_layers")?,
            intermediate: get("intermediate_size")?,
            vocab: get("vocab_size")?,
            max_positions: get("max_position_embeddings")?,
            eps: c["layer_norm_eps"].as_f64().unwrap_or(1e-12) as f32,
        };
        if cfg.heads == 0 || !cfg.hidden.is_multiple_of(cfg.heads) {
            return Err(Error::Config(
                "hidden_size is not a multiple of the heads".into(),
            ));
        }
        let sd = StateDict::load(dir.join("model.safetensors"))?;
        let (e, f) = (cfg.hidden, cfg.intermediate);
        let layers = (0..cfg.layers)
            .map(|i| {
                let p = format!("encoder.layer.{i}");
                Ok(Layer {
                    query: ops::linear(&sd, &format!("{p}.attention.self.query"), e, e)?,
                    key: ops::linear(&sd, &format!("{p}.attention.self.key"), e, e)?,
                    value: ops::linear(&sd, &format!("{p}.attention.self.value"), e, e)?,
                    attn_out: ops::linear(&sd, &format!("{p}.attention.output.dense"), e, e)?,
                    attn_norm: LayerNorm::load(&sd, &format!("{p}.attention.output.LayerNorm"), e)?,
                    intermediate: ops::linear(&sd, &format!("{p}.intermediate.dense"), f, e)?,
                    out: ops::linear(&sd, &format!("{p}.output.dense"), e, f)?,
                    out_norm: LayerNorm::load(&sd, &format!("{p}.output.LayerNorm"), e)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Bert {
            word: ops::weight(&sd, "embeddings.word_embeddings.weight", &[cfg.vocab, e])?,
            position: ops::weight(
                &sd,
                "embeddings.position_embeddings.weight",
                &[cfg.max_positions, e],
            )?,
            token_type: ops::weight(&sd, "embeddings.token_type_embeddings.weight", &[2, e])?,
            emb_norm: LayerNorm::load(&sd, "embeddings.LayerNorm", e)?,
            layers,
            cfg,
        })
    }

    /// The last hidden states `(B, L, hidden)` of a padded batch: `ids (B, L)`, sentence `b`
    /// holding `lens[b]` real tokens (the rest padding, whatever their ids).
    pub fn forward(
        &self,
        ids: &[u32],
        lens: &[usize],
        par: Par,
        prof: &mut Profile,
    ) -> Result<Vec<f32>> {
        let (b, e, h) = (lens.len(), self.cfg.hidden, self.cfg.heads);
        let l = ids.len() / b.max(1);
        let d = e / h;
        if l > self.cfg.max_positions || ids.iter().any(|&i| i as usize >= self.cfg.vocab) {
            return Err(Error::Config("token ids or length beyond the model".into()));
        }
        let mut x = ops::embed(&self.word, e, ids.iter().map(|&i| i as usize));
        for (t, row) in x.chunks_exact_mut(e).enumerate() {
            ops::add_into(row, &self.position[(t % l) * e..][..e]);
            ops::add_into(row, &self.token_type[..e]);
        }
        ops::layer_norm(
            &mut x,
            &self.emb_norm.gamma,
            &self.emb_norm.beta,
            self.cfg.eps,
        );

        let rows = b * l;
        let opts = SdpaOptions::new().key_lengths(lens).par(par);
        for layer in &self.layers {
            // The projections are (B, L, H·D) buffers: read in place as (B, L, H, D).
            let q = apply(&layer.query, &x, rows, par)?;
            let k = apply(&layer.key, &x, rows, par)?;
            let v = apply(&layer.value, &x, rows, par)?;
            let mut ctx = vec![0.0f32; rows * e];
            let shape = [b, l, h, d];
            prof.attention(|| {
                sdpa(
                    &Tensor::blhd(&q, shape),
                    &Tensor::blhd(&k, shape),
                    &Tensor::blhd(&v, shape),
                    &mut TensorMut::blhd(&mut ctx, shape),
                    &opts,
                )
            })?;
            let mut a = apply(&layer.attn_out, &ctx, rows, par)?;
            ops::add_into(&mut a, &x);
            ops::layer_norm(
                &mut a,
                &layer.attn_norm.gamma,
                &layer.attn_norm.beta,
                self.cfg.eps,
            );
            let mut f = apply(&layer.intermediate, &a, rows, par)?;
            ops::gelu(&mut f, par);
            x = apply(&layer.out, &f, rows, par)?;
            ops::add_into(&mut x, &a);
            ops::layer_norm(
                &mut x,
                &layer.out_norm.gamma,
                &layer.out_norm.beta,
                self.cfg.eps,
            );
        }
        Ok(x)
    }
}

/// A tokenised, right-padded batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// `(B, L)` token ids, padding with the tokenizer's pad id (0).
    pub ids: Vec<u32>,
    /// Real tokens per sentence.
    pub lens: Vec<usize>,
    /// `L`, the longest sentence.
    pub len: usize,
}

/// all-MiniLM-L6-v2 as sentence-transformers runs it: tokenise (at most 256 tokens), encode,
/// mean-pool the real tokens, L2-normalise.
pub struct SentenceEncoder {
    pub bert: Bert,
    tokenizer: Tokenizer,
}

/// sentence-transformers' `max_seq_length` for this model (`sentence_bert_config.json`); the
/// tokenizer file's own truncation (128) and fixed padding are not what the model was run with.
const MAX_TOKENS: usize = 256;

impl SentenceEncoder {
    pub fn load(dir: &Path) -> Result<Self> {
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: MAX_TOKENS,
                ..Default::default()
            }))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(SentenceEncoder {
            bert: Bert::load(dir)?,
            tokenizer,
        })
    }

    pub fn tokenize(&self, sentences: &[&str]) -> Result<Batch> {
        let enc = sentences
            .iter()
            .map(|s| self.tokenizer.encode(*s, true))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let len = enc.iter().map(|e| e.get_ids().len()).max().unwrap_or(0);
        let mut ids = vec![0u32; sentences.len() * len];
        for (row, e) in ids.chunks_exact_mut(len.max(1)).zip(&enc) {
            row[..e.get_ids().len()].copy_from_slice(e.get_ids());
        }
        let lens = enc.iter().map(|e| e.get_ids().len()).collect();
        Ok(Batch { ids, lens, len })
    }

    /// Unit-length embeddings `(B, hidden)` of a batch.
    pub fn embed_batch(&self, batch: &Batch, par: Par, prof: &mut Profile) -> Result<Vec<f32>> {
        let start = Instant::now();
        let e = self.bert.cfg.hidden;
        let hidden = self.bert.forward(&batch.ids, &batch.lens, par, prof)?;
        let mut out = vec![0.0f32; batch.lens.len() * e];
        for (b, (emb, &n)) in out.chunks_exact_mut(e).zip(&batch.lens).enumerate() {
            for t in 0..n {
                ops::add_into(emb, &hidden[(b * batch.len + t) * e..][..e]);
            }
            // Mean over the real tokens (at least one: [CLS] and [SEP] are always there).
            let inv = 1.0 / n.max(1) as f32;
            emb.iter_mut().for_each(|v| *v *= inv);
            // F.normalize: x / max(‖x‖, 1e-12).
            let norm = emb.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
            emb.iter_mut().for_each(|v| *v /= norm);
        }
        prof.total += start.elapsed();
        Ok(out)
    }

    /// Tokenises and embeds `sentences` as one padded batch.
    pub fn embed(&self, sentences: &[&str], par: Par) -> Result<Vec<f32>> {
        let batch = self.tokenize(sentences)?;
        self.embed_batch(&batch, par, &mut Profile::default())
    }
}

/// Cosine similarity of two vectors.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb)
}
