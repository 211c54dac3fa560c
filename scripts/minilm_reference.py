#!/usr/bin/env python3
"""Writes reference sentence embeddings of all-MiniLM-L6-v2 for a fixed set of padded batches.

Output OUT_JSON (default models/tests/data/minilm_reference.json):
  {"model", "torch", "transformers", "batches": [{"sentences", "input_ids", "attention_mask",
   "embeddings"}]}
input_ids/attention_mask are exactly what the model saw (padded with 0 to the batch's longest
sentence, truncated to 256 tokens); embeddings are the sentence-transformers outputs (mean
pooling over unmasked tokens, then L2 normalisation), float32 on CPU, 384 floats per sentence.

MODEL_DIR is a sentence-transformers folder (model.safetensors, tokenizer.json, 1_Pooling/...):
  HF_HUB_OFFLINE=1 python3 scripts/minilm_reference.py MODEL_DIR [OUT_JSON]
"""
import json
import os
import sys

import torch
import transformers
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

MAX_LEN = 256  # sentence-transformers' max_seq_length for this model

# Three batches of mixed lengths, so that every batch has padding; similar-meaning pairs are
# spread across batches.
BATCHES = [
    [
        "Hello.",
        "The cat sat on the mat.",
        "A cat was sitting on the rug.",
        "Crème brûlée costs $12.50 at the CAFÉ on 5th Avenue!",
        "Transformers compute attention between every pair of tokens in a sequence, so the cost grows "
        "quadratically with its length; blocked kernels that keep a running maximum and a running sum "
        "avoid ever storing the full score matrix in memory.",
    ],
    [
        "How do I reset my password?",
        "I forgot my login password and need to change it.",
        "Stock markets fell sharply on Monday.",
        "Rust",
    ],
    [
        "The weather today is sunny and warm, perfect for a long walk in the park.",
        "It is a bright, hot day.",
        "Shares dropped steeply at the start of the week.",
    ],
]


def mean_pool_normalise(hidden, mask):
    m = mask.unsqueeze(-1).to(hidden.dtype)
    # sentence-transformers clamps the token count at 1e-9 before dividing.
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


@torch.inference_mode()
def main():
    model_dir = sys.argv[1]
    out_json = sys.argv[2] if len(sys.argv) > 2 else "models/tests/data/minilm_reference.json"
    torch.set_num_threads(1)

    st = SentenceTransformer(model_dir, device="cpu")
    assert st.max_seq_length == MAX_LEN
    tok = AutoTokenizer.from_pretrained(model_dir)
    bert = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    batches, worst = [], 0.0
    for sentences in BATCHES:
        enc = tok(sentences, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        assert (enc["attention_mask"] == 0).any(), "every batch should need padding"
        # sentence-transformers must have fed the model the same ids.
        st_enc = st.preprocess(sentences)
        assert torch.equal(st_enc["input_ids"], enc["input_ids"])

        st_emb = st.encode(sentences, batch_size=len(sentences), convert_to_tensor=True)
        manual = mean_pool_normalise(bert(**enc).last_hidden_state, enc["attention_mask"])
        diff = float((st_emb - manual).abs().max())
        worst = max(worst, diff)
        assert diff < 1e-5, f"sentence-transformers and manual pooling differ by {diff}"

        batches.append({
            "sentences": sentences,
            "input_ids": enc["input_ids"].tolist(),
            "attention_mask": enc["attention_mask"].tolist(),
            "embeddings": st_emb.float().tolist(),
        })
        print(f"batch of {len(sentences)}, padded length {enc['input_ids'].shape[1]}, "
              f"lengths {enc['attention_mask'].sum(1).tolist()}")
    print("max |sentence-transformers - manual pooling|:", worst)

    os.makedirs(os.path.dirname(out_json) or ".", exist_ok=True)
    with open(out_json, "w") as f:
        json.dump({
            "model": "sentence-transformers/all-MiniLM-L6-v2",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "batches": batches,
        }, f)
        f.write("\n")
    print(f"{out_json}: {os.path.getsize(out_json)} bytes")


if __name__ == "__main__":
    main()
