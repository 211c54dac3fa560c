#!/usr/bin/env python3
"""Times the PyTorch references of MiniLM and the tiny Llama on this CPU, for comparison only.

Prints JSON lines, for 1 and 2 threads, each the median of --reps timed calls after two warm-up
calls, float32, under torch.inference_mode():
  {"model":"minilm","impl" (transformers-sdpa|eager),"threads","batch","B","L","ms","attn_ms","attn_share","attn_fn"}
      one batch of models/tests/data/minilm_reference.json (re-tokenised as there), or the fourth,
      long one built as models/examples/bench_minilm.rs does: transformer
      forward + mean pooling + L2 normalisation, tokenisation excluded; attn_ms is the time spent
      in attn_fn (scaled_dot_product_attention for impl "sdpa", BERT's eager_attention_forward
      for "eager"), attn_share its fraction of the call (median over reps).
  {"model":"llama","impl","threads","prompt_len","prefill_tok_s","decode_tok_s"}
      the tiny Llama with sdpa attention, batch 1: prefill = one forward over the prompt with a
      fresh cache; decode = 64 greedy steps of one token with the cache, after an untimed prefill.
      Prompts: the two of reference.json and a 512-token one of random ids.

  HF_HUB_OFFLINE=1 python3 scripts/bench_models_torch.py --minilm MODEL_DIR \
      --llama models/tests/data/tiny_llama [--reps 20]
"""
import argparse
import json
import statistics
import time

import torch
import transformers.models.bert.modeling_bert as modeling_bert
from transformers import AutoModel, AutoTokenizer, LlamaForCausalLM

WARMUP = 2
DECODE_STEPS = 64
LONG_PROMPT = 512


class AttnTimer:
    """Accumulates wall time spent in one module-level function, replaced in place.

    Both callers look the function up at call time (torch.nn.functional.scaled_dot_product_attention
    in transformers.integrations.sdpa_attention, eager_attention_forward in modeling_bert), so
    swapping the module attribute is enough."""

    def __init__(self, module, name):
        self.module, self.name, self.total = module, name, 0.0
        self.inner = getattr(module, name)

    def __enter__(self):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t

        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.inner)


def median_time(fn, reps):
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def mean_pool_normalise(hidden, mask):
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def bench_minilm(model_dir, reference, threads, reps):
    with open(reference) as f:
        batches = [b["sentences"] for b in json.load(f)["batches"]]
    # A fourth batch where attention weighs more, built as models/examples/bench_minilm.rs does:
    # the longest reference sentence repeated 1..8 times (truncated at 256 tokens).
    longest = max((s for b in batches for s in b), key=len)
    batches.append([" ".join([longest] * k) for k in range(1, 9)])
    tok = AutoTokenizer.from_pretrained(model_dir)
    encs = [tok(s, padding=True, truncation=True, max_length=256, return_tensors="pt") for s in batches]
    targets = {
        "sdpa": (torch.nn.functional, "scaled_dot_product_attention"),
        "eager": (modeling_bert, "eager_attention_forward"),
    }
    for impl, (module, name) in targets.items():
        model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=impl).eval()
        for i, enc in enumerate(encs):
            def run():
                return mean_pool_normalise(model(**enc).last_hidden_state, enc["attention_mask"])

            ms = median_time(run, reps) * 1e3
            # Attention is timed in separate calls so that the wrapper does not inflate `ms`.
            attn, share = [], []
            with AttnTimer(module, name) as timer:
                run()
                for _ in range(reps):
                    timer.total = 0.0
                    t = time.perf_counter()
                    run()
                    total = time.perf_counter() - t
                    attn.append(timer.total)
                    share.append(timer.total / total)
            B, L = enc["input_ids"].shape
            print(json.dumps({
                "model": "minilm", "impl": f"transformers-{impl}", "threads": threads, "batch": i, "B": B, "L": L,
                "ms": round(ms, 4), "attn_ms": round(statistics.median(attn) * 1e3, 4),
                "attn_share": round(statistics.median(share), 4), "attn_fn": f"{module.__name__}.{name}",
            }), flush=True)


def bench_llama(llama_dir, threads, reps):
    model = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with open(f"{llama_dir}/reference.json") as f:
        prompts = [p["prompt_ids"] for p in json.load(f)["prompts"]]
    g = torch.Generator().manual_seed(0)
    prompts.append([1] + torch.randint(3, model.config.vocab_size, (LONG_PROMPT - 1,), generator=g).tolist())

    for prompt in prompts:
        ids = torch.tensor([prompt])
        prefill_s = median_time(lambda: model(ids, use_cache=True), reps)

        def decode():
            out = model(ids, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            cache = out.cache
            t = time.perf_counter()
            for _ in range(DECODE_STEPS):
                out = model(nxt, cache=cache, use_cache=True)
                nxt, cache = out.logits[:, -1:].argmax(-1), out.cache
            return time.perf_counter() - t

        for _ in range(WARMUP):
            decode()
        decode_s = statistics.median([decode() for _ in range(reps)])
        print(json.dumps({
            "model": "llama", "impl": "transformers-sdpa", "threads": threads, "prompt_len": len(prompt),
            "prefill_tok_s": round(len(prompt) / prefill_s, 1),
            "decode_tok_s": round(DECODE_STEPS / decode_s, 1),
        }), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minilm", required=True, help="sentence-transformers folder of all-MiniLM-L6-v2")
    ap.add_argument("--llama", default="models/tests/data/tiny_llama")
    ap.add_argument("--reference", default="models/tests/data/minilm_reference.json")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    with torch.inference_mode():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            bench_minilm(args.minilm, args.reference, threads, args.reps)
            bench_llama(args.llama, threads, args.reps)


if __name__ == "__main__":
    main()
