#!/usr/bin/env python3
"""Times PyTorch's F.scaled_dot_product_attention on attnbench's shapes, for comparison only.

Prints attnbench's JSON-lines schema with impl="torch-sdpa":
  impl, b, h, hkv, lq, lk, d, causal, threads, isa, median_s, gflops, pct_peak
under the same conventions: FLOPs = 4*B*H*Lq*Lk*D per call (halved for causal when Lq = Lk),
median of >= --reps calls and >= --min-time seconds after one warm-up call, inputs uniform in
[-1, 1) from a fixed seed, dense (B, H, L, D) tensors in --dtype (float32 by default; bf16 and
f16 tag the impl torch-sdpa+bf16 / +f16 as attnbench does), is_causal=True for causal
(top-left, as attnbench). pct_peak uses the FMA peak that attnbench measured, read from its
JSON lines (--peak-from), or --peak (one thread's GFLOP/s, scaled by the thread count).

PyTorch is not a dependency of the project; see BENCHMARKS.md for how it was installed.

  python3 scripts/bench_torch.py --preset core --threads 1,2 --peak-from results/attnbench.jsonl
"""
import argparse
import json
import statistics
import sys
import time

PRESETS = {
    "quick": [(1, 16, 16, 512, 512, 64, c) for c in (False, True)]
    + [(1, 16, 16, 1024, 1024, 64, c) for c in (False, True)]
    + [(1, 4, 4, 64, 64, 32, False)],
    "core": [
        (b, h, h, l, l, d, c)
        for c in (False, True)
        for (b, h, l, d) in [(1, 16, 512, 64), (1, 16, 1024, 64), (1, 16, 2048, 64), (1, 8, 2048, 128), (4, 12, 512, 64), (1, 16, 4096, 64)]
    ],
    "decode": [(1, 32, hkv, 1, lk, 128, False) for lk in (1024, 8192, 32768) for hkv in (32, 8)],
    "small": [(b, h, h, l, l, d, c) for c in (False, True) for (b, h, l, d) in [(2, 8, 10, 16), (1, 4, 64, 32)]],
}


def flops(b, h, lq, lk, d, causal):
    f = 4.0 * b * h * lq * lk * d
    return f / 2 if causal and lq == lk else f


def peaks_from(paths):
    """{threads: peak GFLOP/s} implied by attnbench records (gflops / pct_peak)."""
    peaks = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                r = json.loads(line)
                if r.get("pct_peak") and not r["impl"].startswith("torch-sdpa"):
                    peaks.setdefault(r["threads"], r["gflops"] / (r["pct_peak"] / 100.0))
    return peaks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    ap.add_argument("--name", default="torch-sdpa", help="impl field (e.g. torch-sdpa+thp for a run under THP_MEM_ALLOC_ENABLE=1)")
    ap.add_argument("--b", type=int)
    ap.add_argument("--h", type=int)
    ap.add_argument("--hkv", type=int)
    ap.add_argument("--lq", type=int)
    ap.add_argument("--lk", type=int)
    ap.add_argument("--d", type=int)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", default="1", help="comma-separated, e.g. 1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--max-time", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"], help="Q, K, V element type")
    ap.add_argument("--kv-dtype", choices=["f32", "bf16", "f16"], help="K, V element type; PyTorch needs one type for Q, K, V, so Q is cast to it too (tag +kv-T)")
    ap.add_argument("--cold", action="store_true", help="each timed call on its own copy of the inputs, >= 1 GiB of copies (at most 64), as attnbench --cold")
    ap.add_argument("--peak", type=float, help="one thread's FMA peak in GFLOP/s")
    ap.add_argument("--peak-from", action="append", default=[], help="attnbench JSON lines to read the peak from")
    args = ap.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("bench_torch.py: PyTorch is not installed (see BENCHMARKS.md)", file=sys.stderr)
        return 3

    if args.lq or args.lk or args.b or args.h or args.d:
        h = args.h or 16
        lq = args.lq or args.lk or 1024
        cases = [(args.b or 1, h, args.hkv or h, lq, args.lk or lq, args.d or 64, args.causal)]
    else:
        cases = PRESETS[args.preset]
    peaks = peaks_from(args.peak_from)
    isa = torch.backends.cpu.get_cpu_capability().lower()
    types = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    kv_t = args.kv_dtype if args.kv_dtype and args.kv_dtype != args.dtype else None
    dtype = types[kv_t or args.dtype]
    name = args.name + ("" if args.dtype == "f32" else "+" + args.dtype) + (f"+kv-{kv_t}" if kv_t else "")

    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        peak = args.peak * threads if args.peak else peaks.get(threads)
        for (b, h, hkv, lq, lk, d, causal) in cases:
            g = torch.Generator().manual_seed(args.seed)
            q = torch.rand(b, h, lq, d, generator=g) * 2 - 1
            k = torch.rand(b, hkv, lk, d, generator=g) * 2 - 1
            v = torch.rand(b, hkv, lk, d, generator=g) * 2 - 1
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            copies = [(q, k, v)]
            if args.cold:
                nbytes = q.element_size() * (q.numel() + k.numel() + v.numel())
                n = int(min(64, max(1, (1 << 30) // nbytes)))
                copies += [(q.clone(), k.clone(), v.clone()) for _ in range(n - 1)]
            kw = {"is_causal": causal}
            if hkv != h:
                kw["enable_gqa"] = True
            with torch.inference_mode():
                F.scaled_dot_product_attention(q, k, v, **kw)  # warm-up
                times, start = [], time.perf_counter()
                while True:
                    qq, kk, vv = copies[len(times) % len(copies)]
                    t = time.perf_counter()
                    F.scaled_dot_product_attention(qq, kk, vv, **kw)
                    times.append(time.perf_counter() - t)
                    total = time.perf_counter() - start
                    if (len(times) >= args.reps and total >= args.min_time) or (len(times) >= 3 and total >= args.max_time):
                        break
            median = statistics.median(times)
            gflops = flops(b, h, lq, lk, d, causal) / median / 1e9
            rec = {
                "impl": name,
                "b": b, "h": h, "hkv": hkv, "lq": lq, "lk": lk, "d": d,
                "causal": causal,
                "threads": threads,
                "isa": isa,
                "median_s": median,
                "gflops": round(gflops, 3),
                "pct_peak": round(100.0 * gflops / peak, 2) if peak else None,
            }
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
