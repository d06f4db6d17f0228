"""``plan --doc-median N``: packed rows of log-normal documents under the ring layouts, predicted per layer.

For one sampled row (seed 0) of the given document length distribution and the recommended candidate's ring size
W: each layout's per-rank attention work (score elements of its q rows: keys attended per token, as the ring
computes them), turned into fwd+bwd milliseconds with the GPU's measured attention throughput; for the dispatch also
its launches, pieces, steps and per-token passes priced by dispatch/plan.py's fitted time model
(dispatch.segments.Estimate.time), with the max/mean of those times (what dispatch.pick balances). Layouts: plain
zigzag, the fixed k-pair zigzag (issue #14) and the cost-balanced dispatch (issue #28, the default for packed rows).
A model, not a measurement: bench/bench_packed.py measures the same rows on a GPU.
"""
from __future__ import annotations

import math

import torch

from ...dispatch.plan import STEP_TIME, estimate, per_token_time, plan_dispatch, token_costs
from ...sharding import pair_chunks, zigzag_pairs


def sample_row(length: int, median: float, sigma: float, seed: int = 0) -> torch.Tensor:
    """(1, length) positions of documents with log-normal lengths (>= 16 tokens; the last one cut at the row end)."""
    g = torch.Generator().manual_seed(seed)
    lens, used = [], 0
    while used < length:
        n = max(16, min(int(math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item())), length - used))
        lens.append(n)
        used += n
    return torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)


def layouts(pos: torch.Tensor, world: int, window: int | None = None) -> list[tuple[str, list[float], list | None]]:
    """(name, work per rank, modelled time per rank in score elements or None) of zigzag, k pairs and the dispatch.
    ``window``: every attention layer's sliding window (keys per token capped; the dispatch planned with it, as
    train.py does)."""
    length = pos.shape[-1]
    tok = token_costs(pos, window)
    out = []
    for k in sorted({1, zigzag_pairs(length, world)}):
        n = 2 * world * k
        if length % n:
            continue
        c = tok.view(n, -1).sum(1)
        out.append((f"zigzag {n} chunks (k={k})", [float(sum(c[i] for i in pair_chunks(r, world, k)))
                                                   for r in range(world)], None))
    d = plan_dispatch(pos, world, window)
    if d is None:  # one document filling the row: nothing to dispatch, plain zigzag runs
        return out
    e = estimate(pos, d.cuts, d.owners, window)
    fixed = per_token_time(length // world)
    out.append((f"dispatch {d.chunks} chunks (<= {d.per_rank} a rank)", list(e.work),
                [t + fixed for t in e.time(STEP_TIME)]))
    return out


def packed_report(length: int, world: int, heads: int, head_dim: int, tflops: float, median: float,
                  sigma: float, window: int | None = None) -> str:
    if world < 2:
        return "packed rows: one sequence-parallel rank, nothing to balance"
    pos = sample_row(length, median, sigma)
    flops = 4 * head_dim * heads * 3.5  # per score element, fwd+bwd
    ms = lambda elems: 1e3 * elems * flops / (tflops * 1e12)  # noqa: E731
    win = f"; every layer windowed, {window} tokens" if window is not None else ""
    lines = [f"packed rows (one sampled row: log-normal documents, median {median:g}, sigma {sigma:g}; {world} ring "
             f"ranks{win}), attention per layer fwd+bwd, predicted:",
             "  layout                         max/mean  slowest rank ms  (all priced: ms, max/mean)"]
    for name, work, timed in layouts(pos, world, window):
        mean = sum(work) / world
        extra = "" if timed is None else f"  ({ms(max(timed)):.1f}, {max(timed) / (sum(timed) / world):.3f})"
        lines.append(f"  {name:<30} {max(work) / mean:8.3f}  {ms(max(work)):15.1f}{extra}")
    lines.append(f"  ideal (sum / W): {ms(sum(work) / world):.1f} ms")
    return "\n".join(lines)
