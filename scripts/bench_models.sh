#!/usr/bin/env bash
# The two real models (#19) side by side with transformers on this CPU, 1 and 2 threads:
# attnkit's models/examples (bench_minilm, generate --json), built once with the projections
# on matrixmultiply and once on OpenBLAS (`--features blas`), alternated with
# scripts/bench_models_torch.py for ROUNDS rounds (default 3). Every program prints medians of
# its own repetitions as JSON lines; the table at the end is the median over the rounds.
# Needs torch and transformers (see ../shared/MACHINE.md); PYTHON names that interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
REPS=${REPS:-10}
bash scripts/fetch_minilm.sh
bin=target/bench-models
mkdir -p "$bin"
for variant in mm blas; do
    features=""
    [ "$variant" = blas ] && features="--features blas"
    cargo build --release -q -p attnkit-models --example bench_minilm --example generate $features
    cp target/release/examples/bench_minilm "$bin/bench_minilm-$variant"
    cp target/release/examples/generate "$bin/generate-$variant"
done
out=$(mktemp)
for round in $(seq "${ROUNDS:-3}"); do
    for variant in mm blas; do
        echo "== round $round: attnkit ($variant)" >&2
        "$bin/bench_minilm-$variant" --reps "$REPS" | sed "s/\"impl\":\"attnkit\"/\"impl\":\"attnkit-$variant\"/" >>"$out"
        "$bin/generate-$variant" --json | sed "s/\"impl\":\"attnkit\"/\"impl\":\"attnkit-$variant\"/" >>"$out"
    done
    echo "== round $round: transformers" >&2
    HF_HUB_OFFLINE=1 "$PYTHON" scripts/bench_models_torch.py --minilm models/weights/all-MiniLM-L6-v2 \
        --reps "$REPS" 2>/dev/null >>"$out"
done
python3 - "$out" <<'PY'
import json, statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d["model"] == "minilm":
        key = ("minilm", d["threads"], d["batch"], f'{d["B"]}x{d["L"]}', d["impl"])
        rows[key].append((d["ms"], d["attn_ms"]))
    else:
        key = ("llama", d["threads"], d["prompt_len"], "", d["impl"])
        rows[key].append((d["prefill_tok_s"], d["decode_tok_s"]))
med = {k: tuple(statistics.median(x[i] for x in v) for i in range(2)) for k, v in rows.items()}
print("| threads | batch (B×L) | impl | ms | attention ms | share |")
print("|---|---|---|---|---|---|")
for k in sorted(k for k in med if k[0] == "minilm"):
    ms, at = med[k]
    print(f"| {k[1]} | {k[2]} ({k[3]}) | {k[4]} | {ms:.1f} | {at:.2f} | {at / ms:.1%} |")
print()
print("| threads | prompt | impl | prefill tok/s | decode tok/s |")
print("|---|---|---|---|---|")
for k in sorted(k for k in med if k[0] == "llama"):
    p, d = med[k]
    print(f"| {k[1]} | {k[2]} | {k[4]} | {p:.0f} | {d:.0f} |")
PY
echo "raw lines: $out" >&2
