#!/usr/bin/env python3
"""Times PyTorch's nn.MultiheadAttention on the MHA shape of `examples/layers_bench.rs`
(B = 2, L = 512, E = 1024, 16 heads, self-attention, need_weights=False), for comparison only:
the median of 7 forward passes after one warm-up, per thread count, in ms.

  python3 scripts/bench_torch_layers.py --threads 1,2
"""
import argparse
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated, e.g. 1,2")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_torch_layers.py: PyTorch is not installed (see BENCHMARKS.md)", file=sys.stderr)
        return 3
    b, l, e, heads = 2, 512, 1024, 16
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(e, heads, batch_first=True).eval()
    x = torch.rand(b, l, e) * 2 - 1
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            mha(x, x, x, need_weights=False)  # warm-up
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                mha(x, x, x, need_weights=False)
                times.append(time.perf_counter() - t)
        print(f"torch nn.MultiheadAttention B={b} L={l} E={e} heads={heads}, {threads} thread(s): "
              f"{1e3 * statistics.median(times):.1f} ms (median of {args.reps})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
