"""Data-parallel balance of packed rows: every dp rank gets about the same attention work per step.

A packed row's attention costs sum(doc_len^2) (its documents are causal within themselves), so two rows of the same
length differ by up to ~L x in attention work, and in synchronous data parallelism every step waits for the rank
with the heaviest rows. Balancing dp ranks by sum L^2 is the idea of WLB-LLM (Wang et al. 2025), ByteScale and
FlexSP; the scheme here is a small deterministic one of ours:

  1. the epoch's rows in a seeded random order (seed + epoch; the last step padded with other rows, as
     DistributedSampler pads);
  2. pools of POOL_STEPS steps (POOL_STEPS x dp x batch rows): rows sorted by cost, cut into steps of dp x batch
     rows of similar cost, each step dealt to the dp ranks largest first to the least loaded rank with room (LPT);
  3. the steps of a pool in a seeded random order (so a pool does not run heavy steps first).
The order is a pure function of (seed, epoch, dp, batch size, row costs); the loader's ``state_dict`` stores it
(the whole epoch's, in (step, rank, slot) order, since train.py saves rank 0's state for every rank) and a resume
uses the stored order, after checking it was made for the same dp size and batch size.
"""
from __future__ import annotations

import torch

from easy_context.data import ShardedLoader

POOL_STEPS = 16  # steps whose rows are regrouped together: larger = closer costs per step, less mixing


def row_costs(ds, column: str = "position_ids", length: int | None = None, batch: int = 256) -> list[float]:
    """sum over the row's documents of doc_len^2 (documents = runs between restarts of ``position_ids`` at 0), for
    every row of ``ds`` (its first ``length`` tokens when given)."""
    out: list[float] = []
    for part in ds.select_columns([column]).with_format("torch").iter(batch_size=batch):
        pos = part[column]
        pos = torch.stack(list(pos)) if isinstance(pos, list) else pos
        out += doc_square_sums(pos[:, :length] if length else pos).tolist()
    return out


def doc_square_sums(pos: torch.Tensor) -> torch.Tensor:
    """(B,) float64: sum of squared document lengths per row of positions (B, L)."""
    pos = pos.long()
    b, n = pos.shape
    starts = (pos == 0)
    starts[:, 0] = True
    doc = torch.cumsum(starts.long(), dim=1) - 1                      # document index of every token
    lens = torch.zeros(b, n, dtype=torch.float64).scatter_add_(1, doc, torch.ones(b, n, dtype=torch.float64))
    return (lens ** 2).sum(1)


def balanced_order(costs: list[float], dp: int, batch: int, seed: int, epoch: int,
                   pool_steps: int = POOL_STEPS) -> list[int]:
    """The epoch's row indices in (step, dp rank, slot) order: step t's rows for rank j are
    ``order[(t * dp + j) * batch:(t * dp + j + 1) * batch]``."""
    n = len(costs)
    per_step = dp * batch
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    steps_total = -(-n // per_step)
    order: list[int] = []
    for p0 in range(0, steps_total, pool_steps):
        pool = perm[p0 * per_step:(p0 + pool_steps) * per_step]
        ranked = sorted(range(len(pool)), key=lambda i: (-costs[pool[i]], i))
        steps = []
        for s in range(0, len(ranked), per_step):
            rows = [pool[i] for i in ranked[s:s + per_step]]
            if len(rows) < per_step:  # the epoch's last step: padded with other rows (DistributedSampler pads too)
                have = set(rows)
                rows += ([r for r in perm if r not in have] + perm * per_step)[:per_step - len(rows)]
                rows.sort(key=lambda r: -costs[r])
            load, slots = [0.0] * dp, [[] for _ in range(dp)]
            for r in rows:  # already sorted by cost, largest first
                j = min((j for j in range(dp) if len(slots[j]) < batch), key=lambda j: (load[j], j))
                slots[j].append(r)
                load[j] += costs[r]
            steps.append([r for j in range(dp) for r in slots[j]])
        for i in torch.randperm(len(steps), generator=g).tolist():
            order += steps[i]
    return order


class BalancedLoader(ShardedLoader):
    """ShardedLoader whose epoch order groups rows by sum L^2 (see the module doc); same batches on the ranks of one
    sp group, disjoint rows across dp ranks within a step."""

    def __init__(self, dataset, costs: list[float], *args, **kw):
        super().__init__(dataset, *args, **kw)
        self.costs = costs
        self._order: list[int] | None = None
        self._order_epoch = -1

    def epoch_order(self) -> list[int]:
        if self._order is None or self._order_epoch != self.epoch:
            self._order = balanced_order(self.costs, self.dp, self.batch_size, self.sampler.seed, self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def _epoch_indices(self) -> list[int]:
        order, b, dp = self.epoch_order(), self.batch_size, self.dp
        return [order[(t * dp + self.dp_rank) * b + i] for t in range(len(order) // (b * dp)) for i in range(b)]

    def __len__(self) -> int:
        return len(self.epoch_order()) // (self.batch_size * self.dp)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "dp_balance": {"dp": self.dp, "batch_size": self.batch_size,
                                                       "order": list(self.epoch_order())}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        saved = state.get("dp_balance")
        if saved is None:
            return  # a checkpoint from an unbalanced run: the balanced order of that epoch from here on
        if (saved["dp"], saved["batch_size"]) != (self.dp, self.batch_size):
            raise ValueError(f"the checkpoint's data order was made for {saved['dp']} data-parallel ranks x batch "
                             f"{saved['batch_size']}, this run has {self.dp} x {self.batch_size}: resume with the same "
                             "data-parallel size and --batch-size (or --dp-balance off)")
        self._order, self._order_epoch = [int(i) for i in saved["order"]], self.epoch


def step_balance(costs: list[float], order: list[int], dp: int, batch: int) -> list[float]:
    """max/mean of the dp ranks' sum L^2 for every step of ``order`` ((step, rank, slot) layout)."""
    out = []
    per_step = dp * batch
    for s in range(0, len(order) - per_step + 1, per_step):
        loads = [sum(costs[i] for i in order[s + j * batch:s + (j + 1) * batch]) for j in range(dp)]
        mean = sum(loads) / dp
        out.append(max(loads) / mean if mean else 1.0)
    return out


__all__ = ["BalancedLoader", "balanced_order", "row_costs", "doc_square_sums", "step_balance", "POOL_STEPS"]
