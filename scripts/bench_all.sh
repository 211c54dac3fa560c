#!/usr/bin/env bash
# Runs every comparison of BENCHMARKS.md: attnbench (fused, unfused-mm, unfused-blas, naive)
# and, when `import torch` works, PyTorch's SDPA (scripts/bench_torch.py), on the presets below,
# for 1 and 2 threads; then builds the markdown tables and the plot from the JSON lines.
#
#   scripts/bench_all.sh              # results in benches/results/ (JSON lines, tables.md, core.svg)
#   scripts/bench_all.sh --update     # ... and replace the results section of BENCHMARKS.md
#
# Environment: OUT (results folder), THREADS (default 1,2), PRESETS (default "core decode small"),
# AVX2 (default 1: also the core shapes with both libraries forced to AVX2), ROUNDS (default 1:
# with N > 1 every measurement is repeated N times, ours and PyTorch's in turn, and each cell
# keeps the round with the median time; the rounds stay in OUT/rounds/), CARGO_TARGET_DIR,
# PYTHON (default python3). Needs a quiet machine: nothing else running.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benches/results}
THREADS=${THREADS:-1,2}
PRESETS=${PRESETS:-core decode small}
PYTHON=${PYTHON:-python3}
ROUNDS=${ROUNDS:-1}
UPDATE=0
[[ ${1:-} == --update ]] && UPDATE=1

# unfused-blas needs the system OpenBLAS; without it, measure the rest and say so.
FEATURES=()
BLAS_IMPL=""
if pkg-config --exists openblas 2>/dev/null || compgen -G "/usr/lib/*/libopenblas.so" >/dev/null; then
    FEATURES=(--features blas)
    BLAS_IMPL=",unfused-blas"
else
    echo "bench_all: libopenblas not found (apt-get install libopenblas-dev): no unfused-blas" >&2
fi
cargo build --release --bin attnbench "${FEATURES[@]}"
BIN=${CARGO_TARGET_DIR:-target}/release/attnbench
# Debian's pthread OpenBLAS starts a worker per core when it loads, and on the Xeon VM the idle
# worker spun in sched_yield for the whole run, taking a vCPU from every implementation: fused at
# (1, 16, 1024, 64) one thread read 72–84 GFLOP/s with it, 92–97 without. attnkit runs BLAS on
# one thread per task anyway, so no worker is needed.
export OPENBLAS_NUM_THREADS=1

# Which kernels OpenBLAS runs (attnbench restarts itself with OPENBLAS_CORETYPE set when
# OpenBLAS picks generic SSE3 kernels on an AVX2/AVX-512 CPU, as 0.3.21 did on the Xeon VM).
BLAS_CORE=""
if [[ ${#FEATURES[@]} -gt 0 ]]; then
    BLAS_CORE=$("$BIN" --b 1 --h 1 --lq 8 --d 8 --impl unfused-blas --threads 1 --reps 1 \
        --min-time 0 --warmup 0 2>/dev/null | grep -m1 '^OpenBLAS kernels' || true)
fi

mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl
rm -rf "$OUT/rounds"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet -- . ':!benches/results' ':!BENCHMARKS.md' 2>/dev/null || echo ' (modified)')"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
    echo "rustc: $(rustc --version)"
    echo "openblas: $(dpkg-query -W -f='${Version}' libopenblas0-pthread 2>/dev/null || echo 'not installed')${BLAS_CORE:+; $BLAS_CORE}"
    echo "torch: $($PYTHON -c 'import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())' 2>/dev/null || echo 'not installed')"
    echo "load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
    if [[ $ROUNDS -gt 1 ]]; then
        echo "rounds: $ROUNDS (ours and PyTorch's in turn; each cell is the round with the median time)"
    fi
} > "$OUT/meta.txt"
cat "$OUT/meta.txt" >&2

HAVE_TORCH=0
$PYTHON -c 'import torch' 2>/dev/null && HAVE_TORCH=1
[[ $HAVE_TORCH == 1 ]] || echo "bench_all: torch is not importable: no torch-sdpa column (see BENCHMARKS.md)" >&2

measure() { # measure DIR: one round of every measurement, JSON lines into DIR
    local R=$1
    for p in $PRESETS; do
        # Decode reads each input copy once in turn (--cold): K and V from memory, as in a model
        # whose layers' caches together exceed the L3, not from the L3 the last call filled.
        COLD=()
        [[ $p == decode ]] && COLD=(--cold)
        echo "bench_all: attnbench --preset $p --threads $THREADS ${COLD[*]}" >&2
        "$BIN" --preset "$p" --threads "$THREADS" --json "${COLD[@]}" \
            --impl "fused,read-kv,fused-prefill,fused-decode,unfused-mm$BLAS_IMPL,naive" > "$R/attnbench-$p.jsonl"
        if [[ $HAVE_TORCH == 1 ]]; then
            echo "bench_all: bench_torch.py --preset $p --threads $THREADS ${COLD[*]}" >&2
            $PYTHON scripts/bench_torch.py --preset "$p" --threads "$THREADS" "${COLD[@]}" \
                --peak-from "$R/attnbench-$p.jsonl" > "$R/torch-$p.jsonl"
        fi
    done

    # Decode streams K and V from memory, where page size matters on this VM (BENCHMARKS.md): run it
    # again with transparent huge pages for the inputs, ours through --huge-pages (what KvCache does)
    # and PyTorch's through its allocator switch THP_MEM_ALLOC_ENABLE=1. Rows are named NAME+thp.
    if [[ " $PRESETS " == *" decode "* ]]; then
        echo "bench_all: attnbench --preset decode --huge-pages --threads $THREADS" >&2
        "$BIN" --preset decode --threads "$THREADS" --json --huge-pages --cold \
            --impl fused,read-kv,unfused-mm > "$R/attnbench-decode-thp.jsonl"
        if [[ $HAVE_TORCH == 1 ]]; then
            THP_MEM_ALLOC_ENABLE=1 $PYTHON scripts/bench_torch.py --preset decode --threads "$THREADS" --cold \
                --name torch-sdpa+thp --peak-from "$R/attnbench-decode.jsonl" > "$R/torch-decode-thp.jsonl"
        fi
    fi

    # The AVX2 path, forced, on the core shapes; PyTorch forced to AVX2 too: ATEN_CPU_CAPABILITY
    # for its own kernels, MKL_ENABLE_INSTRUCTIONS for MKL's GEMMs (without it, MKL kept its
    # AVX-512 GEMMs on the Xeon).
    # Rows are named NAME@avx2. AVX2=0 skips it.
    if [[ ${AVX2:-1} == 1 && " $PRESETS " == *" core "* ]]; then
        echo "bench_all: attnbench --preset core --isa avx2 --threads $THREADS" >&2
        "$BIN" --preset core --threads "$THREADS" --json --isa avx2 --impl fused \
            | sed 's/"impl":"fused"/"impl":"fused@avx2"/' > "$R/attnbench-core-avx2.jsonl"
        if [[ $HAVE_TORCH == 1 ]]; then
            ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 $PYTHON scripts/bench_torch.py --preset core --threads "$THREADS" \
                --name torch-sdpa@avx2 --peak-from "$R/attnbench-core-avx2.jsonl" > "$R/torch-core-avx2.jsonl"
        fi
    fi
}

if [[ $ROUNDS -le 1 ]]; then
    measure "$OUT"
else
    for r in $(seq 1 "$ROUNDS"); do
        echo "bench_all: round $r of $ROUNDS" >&2
        mkdir -p "$OUT/rounds/$r"
        measure "$OUT/rounds/$r"
    done
    # Per file and cell, keep the record of the round with the median time (the lower middle
    # one for an even count), so every field of a row comes from one measurement.
    $PYTHON - "$OUT" "$ROUNDS" <<'EOF'
import json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for name in sorted(os.listdir(os.path.join(out, "rounds", "1"))):
    cells = {}
    for r in range(1, rounds + 1):
        path = os.path.join(out, "rounds", str(r), name)
        if not os.path.exists(path):
            continue
        for line in open(path):
            rec = json.loads(line)
            key = tuple(rec[k] for k in ("impl", "b", "h", "hkv", "lq", "lk", "d", "causal", "threads"))
            cells.setdefault(key, []).append(rec)
    with open(os.path.join(out, name), "w") as f:
        for recs in cells.values():
            recs.sort(key=lambda x: x["median_s"])
            f.write(json.dumps(recs[(len(recs) - 1) // 2]) + "\n")
EOF
fi

FROM=()
for f in "$OUT"/*.jsonl; do FROM+=(--from "$f"); done
CORE=()
for f in "$OUT"/*-core.jsonl; do [[ -e $f ]] && CORE+=(--from "$f"); done
{
    echo "Generated by \`scripts/bench_all.sh\` (threads $THREADS; presets $PRESETS):"
    echo
    sed 's/^/- /' "$OUT/meta.txt"
    "$BIN" "${FROM[@]}" --markdown
} > "$OUT/tables.md"
if [[ ${#CORE[@]} -gt 0 ]]; then
    "$BIN" "${CORE[@]}" --json --plot "$OUT/core.svg" > /dev/null
fi
echo "bench_all: wrote $OUT/tables.md${CORE:+ and $OUT/core.svg}" >&2

if [[ $UPDATE == 1 ]]; then
    # Replace what lies between the two markers of BENCHMARKS.md with the new tables.
    $PYTHON - "$OUT/tables.md" <<'EOF'
import re, sys
tables = open(sys.argv[1]).read().strip()
doc = open("BENCHMARKS.md").read()
begin, end = "<!-- results:begin -->", "<!-- results:end -->"
if begin not in doc or end not in doc:
    sys.exit("BENCHMARKS.md has no results markers")
head, rest = doc.split(begin, 1)
_, tail = rest.split(end, 1)
open("BENCHMARKS.md", "w").write(head + begin + "\n" + tables + "\n" + end + tail)
print("bench_all: updated BENCHMARKS.md", file=sys.stderr)
EOF
fi
