#!/usr/bin/env python3
"""Writes a tiny random-weight Llama (Llama 3 RoPE, GQA) and greedy-decoding reference logits.

Output in OUT_DIR (default models/tests/data/tiny_llama):
  config.json, model.safetensors   -- LlamaForCausalLM.save_pretrained, float32
  reference.json                   -- {"torch", "transformers", "prompts": [{"prompt_ids",
                                      "prefill_logits" (one row per prompt position), "generated_ids"
                                      (16), "step_logits" (the 16 rows generated_ids were chosen from)}]}

Everything is float32 on CPU with eager attention, batch 1 per prompt; weights come from a fixed
seed, so rerunning reproduces the same files:
  HF_HUB_OFFLINE=1 python3 scripts/llama_reference.py [OUT_DIR]
"""
import json
import os
import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 15
# INIT_RANGE and SEED were picked by a small search so that every greedy choice wins by a clear
# margin (asserted below); the default 0.02 gives near-uniform logits whose argmax hinges on rounding.
INIT_RANGE = 0.3
MIN_MARGIN = 1e-2
PROMPT_LENS = (7, 12)
NEW_TOKENS = 16
BOS = 1

ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that, with head_dim 16, some frequencies are kept, one is smoothed and the
    # rest are divided by `factor` (checked in check_rope).
    "original_max_position_embeddings": 256,
}


def build_model(seed=SEED, init_range=INIT_RANGE):
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters=dict(ROPE),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=init_range,
        bos_token_id=BOS,
        # No EOS, so that generation always runs the full NEW_TOKENS steps.
        eos_token_id=None,
        dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # The default init sets every RMSNorm weight to 1; perturb them so that a port which forgets
    # the weight multiply fails the reference.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model


def check_rope(model):
    """Returns (llama3 inv_freq, unscaled inv_freq); asserts the llama3 adjustment changes some."""
    cfg = model.config
    dim = cfg.head_dim
    plain = 1.0 / (ROPE["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaled = model.model.rotary_emb.inv_freq.detach().clone()
    changed = int((scaled != plain).sum())
    assert 0 < changed < len(plain), f"llama3 scaling changed {changed} of {len(plain)} frequencies"
    return scaled, plain


def prompts(seed=SEED):
    g = torch.Generator().manual_seed(seed + 1)
    # Ids 0..2 are left out as the usual special ids; BOS starts every prompt.
    return [[BOS] + torch.randint(3, 512, (n - 1,), generator=g).tolist() for n in PROMPT_LENS]


def margin(logits):
    top = torch.topk(logits, 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


@torch.inference_mode()
def reference(model, prompt_ids):
    ids = torch.tensor([prompt_ids])
    prefill = model(ids, use_cache=False).logits[0]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    generated = out.sequences[0, len(prompt_ids):].tolist()
    steps = torch.cat(out.logits, dim=0)
    assert len(generated) == NEW_TOKENS and steps.shape == (NEW_TOKENS, model.config.vocab_size)
    assert torch.equal(steps.argmax(-1), torch.tensor(generated))
    assert torch.allclose(steps[0], prefill[-1], atol=1e-5, rtol=0)

    # The cached generate must agree with a plain greedy loop that reruns the whole sequence.
    seq = ids
    for i in range(NEW_TOKENS):
        last = model(seq, use_cache=False).logits[0, -1]
        assert torch.allclose(last, steps[i], atol=1e-4, rtol=0), f"step {i} logits differ"
        seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)
    assert seq[0, len(prompt_ids):].tolist() == generated, "cached and uncached greedy disagree"

    return {
        "prompt_ids": prompt_ids,
        "prefill_logits": prefill.tolist(),
        "generated_ids": generated,
        "step_logits": steps.tolist(),
    }, margin(steps)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "models/tests/data/tiny_llama"
    torch.set_num_threads(1)
    model = build_model()
    scaled, plain = check_rope(model)
    print("inv_freq (llama3):", scaled.tolist())
    print("inv_freq (plain): ", plain.tolist())

    records, margins = [], []
    for p in prompts():
        rec, m = reference(model, p)
        records.append(rec)
        margins.append(m)
    print("smallest top-1/top-2 margin per prompt:", margins)
    assert min(margins) >= MIN_MARGIN, f"greedy margin {min(margins)} < {MIN_MARGIN}"
    max_abs = max(abs(x) for r in records for k in ("prefill_logits", "step_logits") for row in r[k] for x in row)
    print("max |logit|:", max_abs)

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Generation settings are passed explicitly above; the file would only restate defaults.
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    # The saved files must reproduce the reference on their own.
    reloaded = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        ids = torch.tensor([records[0]["prompt_ids"]])
        assert torch.equal(reloaded(ids).logits[0], torch.tensor(records[0]["prefill_logits"]))
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__, "prompts": records}, f)
        f.write("\n")
    for name in sorted(os.listdir(out_dir)):
        print(f"{name}: {os.path.getsize(os.path.join(out_dir, name))} bytes")


if __name__ == "__main__":
    main()
