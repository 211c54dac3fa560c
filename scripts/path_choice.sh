#!/usr/bin/env bash
# Measures the prefill/decode crossover behind `Path::Auto` (BENCHMARKS.md, "Path choice"):
# both kernels forced, B = 1, H = 32, D = 128, 1 and 2 threads, three rounds, on
# - Lk = 4096 with 32, 8 and 1 KV heads (1, 4 and 32 query heads per KV head), Lq = 2 … 16;
# - Lk = 64 and 512, one query head per KV head, Lq = 4, 8, 16.
# JSON lines on stdout; `scripts/path_choice.sh > benches/path-choice/NAME.jsonl`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q --bin attnbench
BIN=${CARGO_TARGET_DIR:-target}/release/attnbench
run() { "$BIN" --b 1 --h 32 --d 128 --impl fused-prefill,fused-decode --json "$@" 2>/dev/null; }
for _ in 1 2 3; do
    for th in 1 2; do
        for hkv in 32 8 1; do
            for lq in 2 4 8 12 16; do run --hkv "$hkv" --lq "$lq" --lk 4096 --threads "$th"; done
        done
        for lk in 64 512; do
            for lq in 4 8 16; do run --hkv 32 --lq "$lq" --lk "$lk" --threads "$th"; done
        done
    done
done
