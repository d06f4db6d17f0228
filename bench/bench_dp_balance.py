"""Data-parallel balance of packed rows (CPU): max/mean of the dp ranks' sum of squared document lengths per step,
with the plain seeded shuffle (what DistributedSampler gives) vs easy_context_train/dp_balance.py's balanced order.

    python bench/bench_dp_balance.py [--dp 4] [--batch 1] [--seq-length 65536] [--rows 2048] [--seed 0]

Rows are packed like prepare_data.py's --document-masking rows: documents back to back, a document that does not
fit the rest of a row is cut there and continues in the next row (so long documents fill whole rows). Document
lengths: log-normal, median 1500 tokens, sigma 1.5 (the bench_packed distribution: mean ~4.6K, long tail), and a
second, heavier-tailed mix (70% short chat-like documents, median 400, plus 30% books, median 20K, sigma 1.0).
Reported per distribution: the mean / p90 / max over steps of max/mean, and the step-time ratio sum(max)/sum(mean)
(attention time of a synchronous dp step follows the slowest rank).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import table  # noqa: E402
from easy_context_train.dp_balance import balanced_order, doc_square_sums, step_balance  # noqa: E402


def sample_lengths(kind: str, g: torch.Generator) -> int:
    if kind == "lognormal":
        return max(16, int(math.exp(math.log(1500) + 1.5 * torch.randn(1, generator=g).item())))
    if torch.rand(1, generator=g).item() < 0.7:
        return max(16, int(math.exp(math.log(400) + 1.0 * torch.randn(1, generator=g).item())))
    return max(16, int(math.exp(math.log(20000) + 1.0 * torch.randn(1, generator=g).item())))


def packed_rows(kind: str, rows: int, seq_length: int, seed: int) -> torch.Tensor:
    """(rows, seq_length) position ids of rows packed from a stream of documents (a document crossing a row end
    continues as a new document of the next row)."""
    g = torch.Generator().manual_seed(seed)
    total, lens = rows * seq_length, []
    used = 0
    while used < total:
        lens.append(sample_lengths(kind, g))
        used += lens[-1]
    starts = torch.zeros(total, dtype=torch.bool)
    starts[torch.tensor([0] + lens[:-1]).cumsum(0)] = True
    starts = starts.view(rows, seq_length)
    starts[:, 0] = True  # row cuts start a document
    idx = torch.arange(seq_length).expand(rows, -1)
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - first


def shuffled_order(n: int, dp: int, batch: int, seed: int) -> list[int]:
    """The plain seeded shuffle in (step, rank, slot) order (DistributedSampler's split, regrouped per step)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    per_step = dp * batch
    perm += perm[: (-n) % per_step]
    # DistributedSampler gives rank j the indices j, j+dp, ...: step t's rows of rank j are perm[(t*batch+i)*dp+j]
    order = []
    for t in range(len(perm) // per_step):
        for j in range(dp):
            order += [perm[(t * batch + i) * dp + j] for i in range(batch)]
    return order


def summary(name, kind, ratios, costs, order, dp, batch):
    per_step = dp * batch
    maxes, means = [], []
    for s in range(0, len(order) - per_step + 1, per_step):
        loads = [sum(costs[i] for i in order[s + j * batch:s + (j + 1) * batch]) for j in range(dp)]
        maxes.append(max(loads))
        means.append(sum(loads) / dp)
    r = sorted(ratios)
    return dict(distribution=kind, order=name, steps=len(r), mean_max_over_mean=f"{sum(r) / len(r):.3f}",
                p90=f"{r[int(0.9 * (len(r) - 1))]:.3f}", worst=f"{r[-1]:.3f}",
                step_time_ratio=f"{sum(maxes) / sum(means):.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-length", type=int, default=65536)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = []
    for kind in ("lognormal", "chat+books"):
        pos = packed_rows(kind, args.rows, args.seq_length, args.seed)
        costs = doc_square_sums(pos).tolist()
        for name, order in (("shuffle", shuffled_order(len(costs), args.dp, args.batch, args.seed)),
                            ("balanced", balanced_order(costs, args.dp, args.batch, args.seed, 0))):
            out.append(summary(name, kind, step_balance(costs, order, args.dp, args.batch), costs, order, args.dp,
                               args.batch))
    print(f"\n## sum(L^2) per dp rank per step: {args.dp} dp ranks x batch {args.batch}, rows of {args.seq_length} "
          f"tokens, {args.rows} rows\n")
    print(table(out, ["distribution", "order", "steps", "mean_max_over_mean", "p90", "worst", "step_time_ratio"]))


if __name__ == "__main__":
    main()
