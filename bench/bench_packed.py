"""Packed documents under the zigzag ring: attention time with document masking + block skipping vs the same
row as one causal stream, and the load balance across ranks (simulated ring on one GPU, like bench_ring_sim).

    python bench/bench_packed.py [--lengths 131072 524288] [--world 8] [--median 1500] [--sigma 1.5]
    python bench/bench_packed.py --count        # CPU: score elements per rank only (no kernels, no GPU)

Rows are filled with documents whose lengths are drawn from a log-normal distribution (median 1500 tokens,
sigma 1.5: mean ~4.6K, a long tail of 30K+ documents; clipped to [16, L]; the last document is cut at the row
end), seed fixed. Each rank's work is exactly what ``zigzag_ring_forward``/``backward`` run: per ring step the
facade call on (its q rows, the visiting kv rows) with the packed documents — pieces the mask removes cost
nothing, diagonal runs of documents go to one varlen launch (FA4) — plus the fp32 LSE merges. Reported:
Σ rank time (packed) / Σ rank time (the same row as one causal stream), max/mean rank time, and the packed
output's error against per-document attention on the full row.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import cuda_time_ms, env_line, table  # noqa: E402
from easy_context import kernels, packing  # noqa: E402
from easy_context.sharding import zigzag_shard, zigzag_unshard  # noqa: E402
from easy_context.zigzag_ring_attn.attention import block_plan  # noqa: E402


def doc_lengths(total: int, median: float, sigma: float, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out, used = [], 0
    while used < total:
        n = int(math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item()))
        n = max(16, min(n, total - used))
        out.append(n)
        used += n
    return out


def positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def rank_blocks(rank, world, L, docs):
    """(q local slice, src, kv local slice, causal, BlockDocs or None) of every ring step of ``rank``."""
    c = L // (2 * world)
    idx = [zigzag_shard(torch.arange(L), r, world, dim=0) for r in range(world)]
    out = []
    for blk in block_plan(rank, world):
        qs, ks = blk.q_slice(c), blk.kv_slice(c)
        bd = None if docs is None else docs.block(idx[rank][qs], idx[blk.src][ks])
        out.append((qs, blk.src, ks, blk.causal, bd))
    return out


def score_elements(blocks, L, world) -> int:
    """Attention score elements a rank computes (causal pieces count half)."""
    c = L // (2 * world)
    total = 0
    for qs, _, ks, causal, bd in blocks:
        if bd is None:
            n = (qs.stop - qs.start) * (ks.stop - ks.start)
            total += n // 2 if causal else n
        else:
            for pq, pk, pc in bd.pieces():
                n = (pq.stop - pq.start) * (pk.stop - pk.start)
                total += n // 2 if pc else n
    return total


def count_only(lengths_L, world, median, sigma):
    rows = []
    for L in lengths_L:
        lens = doc_lengths(L, median, sigma)
        docs = packing.documents(positions(lens))
        packed = [score_elements(rank_blocks(r, world, L, docs), L, world) for r in range(world)]
        dense = [score_elements(rank_blocks(r, world, L, None), L, world) for r in range(world)]
        rows.append(dict(L=L, W=world, docs=len(lens), mean_doc=f"{L / len(lens):.0f}",
                         max_doc=max(lens), work_vs_stream=f"{sum(packed) / sum(dense):.3f}",
                         max_over_mean=f"{max(packed) / (sum(packed) / world):.3f}"))
    return rows


def balance_study(lengths_L, world, median, sigma, per_rank=(1, 2, 4, 8)):
    """What a finer, cost-aware split would give (a design study; not what the ring runs today): the row cut into
    2W·k equal chunks, a rank's work = sum over its q tokens of the keys they attend to (position in document + 1,
    which is what a ring computes for its q rows); chunks dealt as mirrored pairs (zigzag's rule, k pairs a rank)
    vs greedily by cost (largest first to the least-loaded rank)."""
    rows = []
    for L in lengths_L:
        cost = positions(doc_lengths(L, median, sigma))[0].double() + 1
        for k in per_rank:
            n = 2 * world * k
            if L % n:
                continue
            c = cost.view(n, -1).sum(1)
            mirrored = torch.zeros(world, dtype=torch.float64)
            for i in range(n // 2):
                mirrored[i % world] += c[i] + c[n - 1 - i]
            greedy = torch.zeros(world, dtype=torch.float64)
            for v in sorted(c.tolist(), reverse=True):
                greedy[greedy.argmin()] += v
            rows.append(dict(L=L, W=world, chunks=n, mirrored_max_over_mean=f"{float(mirrored.max() / mirrored.mean()):.3f}",
                             greedy_max_over_mean=f"{float(greedy.max() / greedy.mean()):.3f}"))
    return rows


def simulate(L, world, heads, dim, median, sigma, iters, device="cuda"):
    lens = doc_lengths(L, median, sigma)
    docs = packing.documents(positions(lens))
    torch.manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, do = (torch.randn(1, L, heads, dim, device=device, dtype=dt) for _ in range(4))
    sh = [[zigzag_shard(t, r, world).contiguous() for r in range(world)] for t in (q, k, v, do)]
    n = L // world

    def forward(r, blocks):
        out = torch.zeros(1, n, heads, dim, device=device)
        lse = torch.full((1, heads, n), -math.inf, device=device)
        for qs, src, ks, causal, bd in blocks:
            res = kernels.attn_forward(sh[0][r][:, qs], sh[1][src][:, ks], sh[2][src][:, ks], causal, docs=bd)
            if res is not None:
                kernels.merge_attn_out(out[:, qs], lse[:, :, qs], *res)
        return out, lse

    def backward(r, blocks, out, lse):
        for qs, src, ks, causal, bd in blocks:
            kernels.attn_backward(sh[3][r][:, qs], sh[0][r][:, qs], sh[1][src][:, ks], sh[2][src][:, ks],
                                  out[:, qs], lse[:, :, qs], causal, docs=bd)

    res = {}
    for name, d in (("packed", docs), ("stream", None)):
        times, outs = [], []
        for r in range(world):
            blocks = rank_blocks(r, world, L, d)
            o, l = forward(r, blocks)
            ob = o.to(dt)
            outs.append(ob)

            def work(r=r, blocks=blocks, ob=ob, l=l):
                forward(r, blocks)
                backward(r, blocks, ob, l)
            times.append(cuda_time_ms(work, 1, iters) if device == "cuda" else (work(), 1.0)[1])
        res[name] = (times, outs)
    # correctness of the packed ring: merged rows vs per-document attention over the full row
    idx = torch.arange(L)
    ref, _ = kernels.attn_forward(q, k, v, True, docs=docs.block(idx, idx))
    got = zigzag_unshard(res["packed"][1], dim=1)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    pt, st = res["packed"][0], res["stream"][0]
    return dict(L=L, W=world, docs=len(lens), mean_doc=f"{L / len(lens):.0f}", max_doc=max(lens),
                packed_ms=f"{sum(pt):.0f}", stream_ms=f"{sum(st):.0f}", speedup=f"{sum(st) / sum(pt):.2f}x",
                max_over_mean=f"{max(pt) / (sum(pt) / world):.3f}",
                stream_max_over_mean=f"{max(st) / (sum(st) / world):.3f}", err=f"{err:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--median", type=float, default=1500)
    ap.add_argument("--sigma", type=float, default=1.5)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--count", action="store_true", help="CPU: score elements per rank only")
    ap.add_argument("--check", action="store_true", help="CPU float32 run of the simulation's code path (errors only)")
    args = ap.parse_args()
    if args.check:
        r = simulate(4096, 4, 4, 32, 300, 1.0, 1, device="cpu")
        print(r)
        assert float(r["err"]) < 1e-5, r
        return
    counts = count_only(args.lengths, args.world, args.median, args.sigma)
    print(f"\n## Score elements (zigzag W={args.world}, log-normal documents, median {args.median:g}, "
          f"sigma {args.sigma:g})\n")
    print(table(counts, ["L", "W", "docs", "mean_doc", "max_doc", "work_vs_stream", "max_over_mean"]))
    print("\n## Balance study: finer chunks, mirrored pairs vs greedy by cost (q-side work per rank)\n")
    print(table(balance_study(args.lengths, args.world, args.median, args.sigma),
                ["L", "W", "chunks", "mirrored_max_over_mean", "greedy_max_over_mean"]))
    if args.count:
        return
    if not torch.cuda.is_available():
        raise SystemExit("timings need a CUDA GPU (--count works on CPU)")
    print(env_line(), "| backend:", kernels.choose_backend(torch.empty(1, 1, 1, 128, device="cuda",
                                                                       dtype=torch.bfloat16)), flush=True)
    rows = []
    for L in args.lengths:
        rows.append(simulate(L, args.world, args.heads, args.head_dim, args.median, args.sigma, args.iters))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    print("\n## Simulated zigzag ring, packed documents vs one causal stream (fwd+bwd, bf16)\n")
    print(table(rows, ["L", "W", "docs", "mean_doc", "max_doc", "packed_ms", "stream_ms", "speedup",
                       "max_over_mean", "stream_max_over_mean", "err"]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_packed.json"), "w") as f:
            json.dump(dict(env=env_line(), counts=counts, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
