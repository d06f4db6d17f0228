"""Where one simulated rank's gated DeltaNet parallel path spends its time (issue #49): the plain layer ("own") and
the parallel path on one piece ("par", bench_hybrid's par/rank) on the same tokens, each iteration's wall time, then
the top CUDA kernels of one profiled fwd+bwd of each. GPU only; run with /tmp/fla-site on PYTHONPATH
(bench/gpu_hybrid_fla.sh unpacks it there):
    python bench/gdn_profile.py --tokens 16384 --size qwen35 --spans 0 1024 2048 4096
"par": the default passes; "fused": EASY_CONTEXT_DELTA_FUSED=1 (delta_fla.py) at its default sub-sequence cut;
--spans: the fused path also at these cuts (EASY_CONTEXT_DELTA_SPAN; 0: none), each timed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the rank (L / W)")
    p.add_argument("--size", default="qwen35")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--top", type=int, default=22)
    p.add_argument("--spans", type=int, nargs="*", default=[], help="also time the parallel path at these cuts")
    args = p.parse_args(argv)
    from bench.bench_hybrid import _layer
    from easy_context.recurrent.adapter import get_adapter
    from easy_context.recurrent.pieces import Piece, Plan
    dev, dt = torch.device("cuda"), torch.bfloat16
    layer, hidden = _layer("gated_deltanet", args.size, dev, dt)
    adapter, n = get_adapter(layer), args.tokens
    one = Plan(0, (Piece(0, 0, n, 0),), None)
    x = torch.randn(1, n, hidden, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(1, n, hidden, device=dev, dtype=dt)
    from easy_context.recurrent.delta_fla import SPAN, SPAN_ENV
    from easy_context.recurrent.delta_kernels import FUSED_ENV
    steps = {"own": lambda: layer(x), "par": lambda: adapter.run_plan(one, layer, x)}
    spans = {"fused": SPAN, **{f"fused span {s}": s for s in args.spans}}
    steps.update({name: steps["par"] for name in spans})

    def step(name):
        os.environ[SPAN_ENV] = str(spans.get(name, SPAN))
        os.environ[FUSED_ENV] = "1" if name in spans else "0"
        steps[name]().backward(dy)
        x.grad = None
        layer.zero_grad(set_to_none=True)

    for name in steps:
        walls = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(name)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
        print(f"{name}: wall ms per iteration " + " ".join(f"{w:.1f}" for w in walls), flush=True)
    from torch.profiler import ProfilerActivity, profile
    for name in ("own", "par", "fused"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(name)
            torch.cuda.synchronize()
        print(f"\n## {name}: {n} tokens, {args.size}\n" + prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
