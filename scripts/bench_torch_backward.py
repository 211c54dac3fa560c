"""PyTorch's f32 SDPA forward and backward on the shapes of examples/backward_bench.rs, 1 and 2
threads, medians of 7 (after one warm-up): the side-by-side numbers for the backward pass.

    python3 scripts/bench_torch_backward.py   # needs torch (see ../shared/MACHINE.md)
"""
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(1, 16, 1024, 64, False), (1, 16, 1024, 64, True), (1, 8, 2048, 128, False),
          (1, 8, 2048, 128, True), (4, 12, 512, 64, False), (4, 12, 512, 64, True)]
REPS = 7

print("| B,H,L,D | causal | threads | torch fwd ms | torch bwd ms | bwd/fwd | backend |")
print("|---|---|---|---|---|---|---|")
for b, h, l, d, causal in SHAPES:
    for threads in (1, 2):
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, l, d, generator=g).requires_grad_() for _ in range(3))
        dout = torch.randn(b, h, l, d, generator=g)
        tf, tb = [], []
        for _ in range(REPS + 1):
            t = time.perf_counter()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            tf.append(time.perf_counter() - t)
            t = time.perf_counter()
            out.backward(dout)
            tb.append(time.perf_counter() - t)
            q.grad = k.grad = v.grad = None
        fn = out.grad_fn.name() if out.grad_fn is not None else "?"
        f, bw = statistics.median(tf[1:]), statistics.median(tb[1:])
        print(f"| {b},{h},{l},{d} | {causal} | {threads} | {f*1e3:.1f} | {bw*1e3:.1f} | {bw/f:.2f} | {fn} |")
