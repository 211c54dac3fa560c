//! A Llama-architecture decoder (RMSNorm, rotary embeddings with Llama 3 frequency scaling,
//! grouped-query attention, SwiGLU) read from a transformers checkpoint, with greedy
//! generation over a KV cache.
//!
//! A batch of prompts of different lengths is prefilled in one padded call
//! ([`attnkit::sdpa`], causal, key lengths), its keys and values appended to the cache, each
//! sequence then cut back to its own length; every decode step appends one token per sequence
//! and attends over the cache, whose per-sequence lengths align the causal diagonal.

use crate::cache::KvStore;
use crate::ops::{self, apply, Error, Profile, Result};
use crate::read_config;
use attnkit::{sdpa, Causal, Linear, Par, SdpaOptions, StateDict, Tensor, TensorMut};
use std::path::Path;
use std::time::Instant;

/// Llama 3's rotary frequency scaling (`rope_scaling` with `rope_type: "llama3"`).
#[derive(Clone, Copy, Debug)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_context: f64,
}

/// The `config.json` fields the decoder uses.
#[derive(Clone, Debug)]
pub struct LlamaConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
}

impl LlamaConfig {
    /// The rotary inverse frequencies, `θ^(−2i/D)`, rescaled as Llama 3 does: long wavelengths
    /// divided by `factor`, short ones kept, a smooth blend between.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        (0..d / 2)
            .map(|i| {
                let f = 1.0 / self.rope_theta.powf((2 * i) as f64 / d as f64);
                let Some(s) = self.rope_scaling else {
                    return f as f32;
                };
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let (low_wl, high_wl) = (
                    s.original_context / s.low_freq_factor,
                    s.original_context / s.high_freq_factor,
                );
                let scaled = if wavelen > low_wl {
                    f / s.factor
                } else if wavelen < high_wl {
                    f
                } else {
                    let smooth = (s.original_context / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                };
                scaled as f32
            })
            .collect()
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    mlp_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// The decoder and its weights.
pub struct Llama {
    pub cfg: LlamaConfig,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    inv_freq: Vec<f32>,
}

/// What [`Llama::generate`] returns for each prompt.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// `(prompt_len, vocab)`: the logits at every prompt position.
    pub prefill_logits: Vec<f32>,
    /// The chosen tokens, one per step.
    pub tokens: Vec<u32>,
    /// `(steps, vocab)`: the logits each token was chosen from (step 0's are the last prompt
    /// position's).
    pub step_logits: Vec<f32>,
}

/// Where [`Llama::generate`] spent its time.
#[derive(Clone, Copy, Debug, Default)]
pub struct GenProfile {
    pub prefill: Profile,
    pub decode: Profile,
}

impl Llama {
    pub fn load(dir: &Path) -> Result<Self> {
        let c = read_config(dir)?;
        let get = |k: &str| {
            c[k].as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| Error::Config(format!("{k} missing")))
        };
        let heads = get("num_attention_heads")?;
        let hidden = get("hidden_size")?;
        // transformers 5 writes `rope_parameters` (θ inside); Hub checkpoints `rope_theta` and
        // `rope_scaling`.
        let rope = match &c["rope_parameters"] {
            serde_json::Value::Null => &c["rope_scaling"],
            p => p,
        };
        let rope_theta = rope["rope_theta"]
            .as_f64()
            .or(c["rope_theta"].as_f64())
            .unwrap_or(10000.0);
        let rope_scaling = match rope["rope_type"].as_str().or(rope["type"].as_str()) {
            None | Some("default") => None,
            Some("llama3") => {
                let f = |k: &str| {
                    rope[k]
                        .as_f64()
                        .ok_or_else(|| Error::Config(format!("rope parameter {k} missing")))
                };
                Some(Llama3Scaling {
                    factor: f("factor")?,
                    low_freq_factor: f("low_freq_factor")?,
                    high_freq_factor: f("high_freq_factor")?,
                    original_context: f("original_max_position_embeddings")?,
                })
            }
            Some(t) => return Err(Error::Config(format!("unsupported rope type {t}"))),
        };
        let cfg = LlamaConfig {
            hidden,
            intermediate: get("intermediate_size")?,
            layers: get("num_hidden_layers")?,
            heads,
            kv_heads: get("num_key_value_heads").unwrap_or(heads),
            head_dim: get("head_dim").unwrap_or(hidden / heads.max(1)),
            vocab: get("vocab_size")?,
            eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
        };
        if cfg.kv_heads == 0 || !cfg.heads.is_multiple_of(cfg.kv_heads) {
            return Err(Error::Config("heads not a multiple of the KV heads".into()));
        }
        let sd = StateDict::load(dir.join("model.safetensors"))?;
        let (e, f, dq, dkv) = (
            cfg.hidden,
            cfg.intermediate,
            cfg.heads * cfg.head_dim,
            cfg.kv_heads * cfg.head_dim,
        );
        let layers = (0..cfg.layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let lin = |name: &str, o, i| ops::linear(&sd, &format!("{p}.{name}"), o, i);
                Ok(Layer {
                    attn_norm: ops::weight(&sd, &format!("{p}.input_layernorm.weight"), &[e])?,
                    q: lin("self_attn.q_proj", dq, e)?,
                    k: lin("self_attn.k_proj", dkv, e)?,
                    v: lin("self_attn.v_proj", dkv, e)?,
                    o: lin("self_attn.o_proj", e, dq)?,
                    mlp_norm: ops::weight(
                        &sd,
                        &format!("{p}.post_attention_layernorm.weight"),
                        &[e],
                    )?,
                    gate: lin("mlp.gate_proj", f, e)?,
                    up: lin("mlp.up_proj", f, e)?,
                    down: lin("mlp.down_proj", e, f)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = ops::weight(&sd, "model.embed_tokens.weight", &[cfg.vocab, e])?;
        Ok(Llama {
            norm: ops::weight(&sd, "model.norm.weight", &[e])?,
            lm_head: if c["tie_word_embeddings"] == true {
                Linear::new(embed.clone(), None, cfg.vocab, e)?
            } else {
                ops::linear(&sd, "lm_head", cfg.vocab, e)?
            },
            embed,
            inv_freq: cfg.inv_freq(),
            layers,
            cfg,
        })
    }

    /// Runs `x (B, T, hidden)` through every layer and the final norm. `positions` holds each
    /// token's position; `attend(layer, q, k, v, out)` does the attention of one layer, given
    /// its rotated `q (B, T, Hq, D)`, `k`/`v (B, T, Hkv, D)` as dense buffers.
    fn layers(
        &self,
        mut x: Vec<f32>,
        b: usize,
        positions: &[usize],
        par: Par,
        prof: &mut Profile,
        mut attend: impl FnMut(usize, [&[f32]; 3], &mut [f32], &mut Profile) -> Result<()>,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let rows = positions.len();
        debug_assert_eq!(rows % b.max(1), 0);
        for (i, layer) in self.layers.iter().enumerate() {
            let h = ops::rms_norm(&x, &layer.attn_norm, c.eps);
            let mut q = apply(&layer.q, &h, rows, par)?;
            let mut k = apply(&layer.k, &h, rows, par)?;
            let v = apply(&layer.v, &h, rows, par)?;
            ops::rope(&mut q, c.heads, c.head_dim, positions, &self.inv_freq);
            ops::rope(&mut k, c.kv_heads, c.head_dim, positions, &self.inv_freq);
            let mut ctx = vec![0.0f32; rows * c.heads * c.head_dim];
            attend(i, [&q, &k, &v], &mut ctx, prof)?;
            ops::add_into(&mut x, &apply(&layer.o, &ctx, rows, par)?);
            let h = ops::rms_norm(&x, &layer.mlp_norm, c.eps);
            let mut gate = apply(&layer.gate, &h, rows, par)?;
            ops::swiglu(&mut gate, &apply(&layer.up, &h, rows, par)?);
            ops::add_into(&mut x, &apply(&layer.down, &gate, rows, par)?);
        }
        Ok(ops::rms_norm(&x, &self.norm, c.eps))
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&i| i as usize >= self.cfg.vocab) {
            Some(i) => Err(Error::Config(format!(
                "token id {i} ≥ vocab {}",
                self.cfg.vocab
            ))),
            None => Ok(()),
        }
    }

    /// Prefills `prompts` (one per cache sequence) as one right-padded batch: their keys and
    /// values go into `cache`, and the logits of every prompt position come back, `(len, vocab)`
    /// per prompt.
    pub fn prefill(
        &self,
        prompts: &[Vec<u32>],
        cache: &mut impl KvStore,
        par: Par,
        prof: &mut Profile,
    ) -> Result<Vec<Vec<f32>>> {
        let start = Instant::now();
        let c = &self.cfg;
        let (b, t) = (
            prompts.len(),
            prompts.iter().map(Vec::len).max().unwrap_or(0),
        );
        let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let mut ids = vec![0u32; b * t];
        for (row, p) in ids.chunks_exact_mut(t.max(1)).zip(prompts) {
            self.check_ids(p)?;
            row[..p.len()].copy_from_slice(p);
        }
        let positions: Vec<usize> = (0..b * t).map(|r| r % t).collect();
        let x = ops::embed(&self.embed, c.hidden, ids.iter().map(|&i| i as usize));
        let (qs, kvs) = ([b, t, c.heads, c.head_dim], [b, t, c.kv_heads, c.head_dim]);
        let opts = SdpaOptions::new()
            .causal(Causal::TopLeft)
            .key_lengths(&lens[..])
            .par(par);
        let x = self.layers(
            x,
            b,
            &positions,
            par,
            prof,
            |layer, [q, k, v], ctx, prof| {
                let (k, v) = (Tensor::blhd(k, kvs), Tensor::blhd(v, kvs));
                prof.attention(|| {
                    sdpa(
                        &Tensor::blhd(q, qs),
                        &k,
                        &v,
                        &mut TensorMut::blhd(ctx, qs),
                        &opts,
                    )
                })?;
                // The padded tail of a shorter prompt goes in too, and is cut off below.
                Ok(cache.append(layer, &k, &v)?)
            },
        )?;
        for (seq, &len) in lens.iter().enumerate() {
            cache.truncate(seq, len)?;
        }
        let logits = apply(&self.lm_head, &x, b * t, par)?;
        prof.total += start.elapsed();
        Ok(lens
            .iter()
            .enumerate()
            .map(|(s, &len)| logits[s * t * c.vocab..][..len * c.vocab].to_vec())
            .collect())
    }

    /// One decode step: token `tokens[s]` at position `positions[s]` of every sequence `s`
    /// (all of them, one each), appended to `cache`; returns the logits `(B, vocab)`.
    pub fn decode(
        &self,
        tokens: &[u32],
        positions: &[usize],
        cache: &mut impl KvStore,
        par: Par,
        prof: &mut Profile,
    ) -> Result<Vec<f32>> {
        let start = Instant::now();
        let c = &self.cfg;
        self.check_ids(tokens)?;
        let b = tokens.len();
        let x = ops::embed(&self.embed, c.hidden, tokens.iter().map(|&i| i as usize));
        let (qs, kvs) = ([b, 1, c.heads, c.head_dim], [b, 1, c.kv_heads, c.head_dim]);
        let opts = SdpaOptions::new().par(par);
        let x = self.layers(x, b, positions, par, prof, |layer, [q, k, v], ctx, prof| {
            cache.append(layer, &Tensor::blhd(k, kvs), &Tensor::blhd(v, kvs))?;
            let q = Tensor::blhd(q, qs);
            Ok(prof.attention(|| cache.attend(layer, &q, &mut TensorMut::blhd(ctx, qs), &opts))?)
        })?;
        let logits = apply(&self.lm_head, &x, b, par)?;
        prof.total += start.elapsed();
        Ok(logits)
    }

    /// Greedy generation of `steps` tokens after each prompt, all prompts as one batch over
    /// `cache` (one sequence per prompt, empty at the start).
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        steps: usize,
        cache: &mut impl KvStore,
        par: Par,
        prof: &mut GenProfile,
    ) -> Result<Vec<Generation>> {
        let v = self.cfg.vocab;
        let mut gens: Vec<Generation> = self
            .prefill(prompts, cache, par, &mut prof.prefill)?
            .into_iter()
            .map(|prefill_logits| Generation {
                prefill_logits,
                ..Default::default()
            })
            .collect();
        let mut positions: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let mut last: Vec<Vec<f32>> = gens
            .iter()
            .map(|g| g.prefill_logits[g.prefill_logits.len().saturating_sub(v)..].to_vec())
            .collect();
        for step in 0..steps {
            let mut tokens = Vec::with_capacity(gens.len());
            for (g, logits) in gens.iter_mut().zip(&last) {
                let tok = ops::argmax(logits) as u32;
                g.tokens.push(tok);
                g.step_logits.extend_from_slice(logits);
                tokens.push(tok);
            }
            if step + 1 == steps {
                break;
            }
            let logits = self.decode(&tokens, &positions, cache, par, &mut prof.decode)?;
            for (l, row) in last.iter_mut().zip(logits.chunks_exact(v)) {
                l.copy_from_slice(row);
            }
            positions.iter_mut().for_each(|p| *p += 1);
        }
        Ok(gens)
    }
}
