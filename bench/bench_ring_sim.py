"""Simulated ring on one GPU: every rank's attention blocks run in turn, rank by rank.

    python bench/bench_ring_sim.py [--lengths 131072 524288] [--worlds 2 4 8] [--modes zigzag dist_flash]

One GPU cannot host several NCCL ranks, so the multi-rank *kernel* work is simulated: the schedule each
mode really runs (``block_plan`` of easy_context.zigzag_ring_attn / easy_context.dist_flash_attn, the
same function the distributed forward uses) is replayed for every rank with the facade's fastest
backend. Reported per (mode, W, L):
  sum/full  = Σ over ranks of the rank's block time / one full causal kernel on the whole sequence
              (1.00 = sequence parallelism adds no kernel work; chunking costs show up above 1)
  max/mean  = the slowest rank over the mean rank (load balance; 1.00 = perfect)
  err       = relative error of the merged outputs (and summed dq/dk/dv) vs the full kernel, bf16
Communication is not simulated (it overlaps the blocks on NVLink); see docs/performance.md for what was measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import cuda_time_ms, env_line, require_cuda, table  # noqa: E402
from easy_context import kernels, shard_sequence, unshard_sequence  # noqa: E402


def zigzag_blocks(rank, world, S):
    """[(q_slice, kv_rank, kv_slice, causal)] in local coordinates of the zigzag layout."""
    from easy_context.zigzag_ring_attn.attention import block_plan
    c = S // (2 * world)
    out = []
    for b in block_plan(rank, world):
        qs = slice(b.q_chunks[0] * c, (b.q_chunks[-1] + 1) * c)
        ks = slice(b.kv_chunks[0] * c, (b.kv_chunks[-1] + 1) * c)
        out.append((rank, qs, b.kv_rank if hasattr(b, "kv_rank") else b.src, ks, b.causal))
    return out


def dist_flash_blocks(rank, world, S):
    from easy_context.dist_flash_attn.schedule import block_plan
    n = S // world
    out = []
    for b in block_plan(rank, world):
        if b is None:
            continue
        out.append((b.q_rank, b.q_rows(n), b.kv_rank, slice(0, n), b.causal))
    return out


LAYOUT = {"zigzag": ("zigzag_ring_attn", zigzag_blocks), "dist_flash": ("dist_flash_attn", dist_flash_blocks)}


def run_rank(blocks, qs, ks, vs, dos, outs, lses, backward):
    """One rank's kernel work: forward blocks (+ merge) and, if asked, backward blocks."""
    res = []
    for q_rank, qsl, kv_rank, ksl, causal in blocks:
        q, k, v = qs[q_rank][:, qsl], ks[kv_rank][:, ksl], vs[kv_rank][:, ksl]
        if backward:
            res.append((q_rank, qsl, kv_rank, ksl,
                        kernels.attn_backward(dos[q_rank][:, qsl], q, k, v, outs[q_rank][:, qsl],
                                              lses[q_rank][:, :, qsl], causal)))
        else:
            res.append((q_rank, qsl, kernels.attn_forward(q, k, v, causal)))
    return res


def simulate(mode, world, S, heads, dim, iters, device="cuda"):
    name, plan_fn = LAYOUT[mode]
    torch.manual_seed(0)
    full = [torch.randn(1, S, heads, dim, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32) for _ in range(4)]
    q, k, v, do = full
    shard = [[shard_sequence(name, t, r, world).contiguous() for r in range(world)] for t in full]
    plans = [plan_fn(r, world, S) for r in range(world)]
    # exact merge (fp32) to build each rank's final out/lse, which the backward blocks consume
    outs, lses = [], []
    for r in range(world):
        outs.append(torch.zeros(1, S // world, heads, dim, device=device))
        lses.append(torch.full((1, heads, S // world), -math.inf, device=device))
    for r in range(world):
        for q_rank, qsl, (o, l) in run_rank(plans[r], *shard[:3], None, None, None, False):
            kernels.merge_attn_out(outs[q_rank][:, qsl], lses[q_rank][:, :, qsl], o, l)
    outs_bf = [o.to(q.dtype) for o in outs]
    grads = [[torch.zeros(1, S // world, heads, dim, device=device) for _ in range(world)] for _ in range(3)]
    for r in range(world):
        for q_rank, qsl, kv_rank, ksl, (dq, dk, dv) in run_rank(plans[r], *shard[:3], shard[3], outs_bf, lses, True):
            grads[0][q_rank][:, qsl] += dq.float()
            grads[1][kv_rank][:, ksl] += dk.float()
            grads[2][kv_rank][:, ksl] += dv.float()
    ref_o, ref_l = kernels.attn_forward(q, k, v, True)
    ref_g = kernels.attn_backward(do, q, k, v, ref_o, ref_l, True)
    got = [unshard_sequence(name, outs)] + [unshard_sequence(name, g) for g in grads]
    err = max(((a - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, (ref_o, *ref_g)))
    if device != "cuda":  # --check: correctness of the replayed schedule only
        return dict(mode=mode, W=world, L=S, err=f"{err:.1e}")
    del got, grads, ref_g  # free the correctness pass before timing (512K: ~40 GiB of fp32 buffers)
    torch.cuda.empty_cache()
    # timing: each rank's fwd+bwd block kernels, then one full causal fwd+bwd kernel
    warm = 0 if S >= 262144 else 1  # the correctness pass above already warmed these shapes

    def full_step():
        o, l = kernels.attn_forward(q, k, v, True)
        kernels.attn_backward(do, q, k, v, o, l, True)
    t_full = cuda_time_ms(full_step, warm, iters)
    t_rank = []
    for r in range(world):
        scratch_o = [torch.zeros_like(o) for o in outs]
        scratch_l = [torch.full_like(l, -math.inf) for l in lses]

        def work(r=r):  # forward blocks + the fp32 LSE merges the real ring does, then backward blocks
            for q_rank, qsl, (o, l) in run_rank(plans[r], *shard[:3], None, None, None, False):
                kernels.merge_attn_out(scratch_o[q_rank][:, qsl], scratch_l[q_rank][:, :, qsl], o, l)
            run_rank(plans[r], *shard[:3], shard[3], outs_bf, lses, True)
        t_rank.append(cuda_time_ms(work, warm, iters))
    return dict(mode=mode, W=world, L=S, sum_over_full=f"{sum(t_rank) / t_full:.3f}",
                max_over_mean=f"{max(t_rank) / (sum(t_rank) / world):.3f}", full_ms=f"{t_full:.1f}",
                rank_ms=" ".join(f"{t:.0f}" for t in t_rank), err=f"{err:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--modes", nargs="+", default=["zigzag", "dist_flash"], choices=sorted(LAYOUT))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--max-dist-flash-len", type=int, default=131072)
    ap.add_argument("--check", action="store_true", help="CPU float32 replay of the schedules, errors only")
    args = ap.parse_args()
    if args.check:
        for mode in args.modes:
            for w in args.worlds:
                r = simulate(mode, w, 64 * w, 4, 32, 1, device="cpu")
                assert float(r["err"]) < 1e-5, r
                print(r)
        return
    require_cuda()
    print(env_line(), "| backend:", kernels.choose_backend(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)))
    rows = []
    for S in args.lengths:
        for mode in args.modes:
            if mode == "dist_flash" and S > args.max_dist_flash_len:
                continue
            for w in args.worlds:
                rows.append(simulate(mode, w, S, args.heads, args.head_dim, args.iters))
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    print("\n## Simulated sequence-parallel attention on one GPU (fwd+bwd block kernels)\n")
    print(table(rows, ["mode", "W", "L", "sum_over_full", "max_over_mean", "full_ms", "rank_ms", "err"]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_ring_sim.json"), "w") as f:
            json.dump(dict(env=env_line(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
