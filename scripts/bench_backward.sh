#!/usr/bin/env bash
# The backward pass side by side with PyTorch's (f32, 1 and 2 threads): attnkit's
# examples/backward_bench and scripts/bench_torch_backward.py alternated ROUNDS times (default 3),
# each printing medians of 7 calls; read the medians of the rounds. Needs torch (see
# ../shared/MACHINE.md); PYTHON names the interpreter that has it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
cargo build --release -q --example backward_bench
for round in $(seq "${ROUNDS:-3}"); do
    echo "== round $round: attnkit"
    target/release/examples/backward_bench
    echo "== round $round: PyTorch"
    "$PYTHON" scripts/bench_torch_backward.py
done
