"""Token-weighted loss over a dp x sp batch, equal to the single-process mean over all valid tokens.

Each rank holds a slice of the tokens (its sp shard of its dp group's samples). The single-process loss
is  sum_all(CE) / n_valid_all.  Each rank computes  local_sum(CE) / n_valid_all  with n_valid_all
all-reduced over ``group`` (default: the world = every dp x sp rank); the per-rank losses then *sum* to the
global mean and so do their gradients. A rank with no valid label contributes 0, never NaN
(the original per-rank mean gave NaN and weighted ranks equally whatever their token counts).

DDP / DeepSpeed *average* gradients over their N data-parallel ranks (all dp x sp ranks of the world):
pass ``grads_averaged_over=N`` so the average of the scaled losses is the exact sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_nll_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """(sum of cross-entropy over valid targets (fp32, 0 if none), number of valid targets (int64))."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits "
                         "must be targets' shape plus the vocab dim (shard both with the same layout)")
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    return total, (targets != ignore_index).sum()


def global_count(count: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) a valid-token count over ``group``; identity without a process group."""
    import torch.distributed as dist
    count = count.detach().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, group=group)
    return count


def sp_token_mean_loss(logits: torch.Tensor, targets: torch.Tensor, group=None, *,
                       ignore_index: int = IGNORE_INDEX, grads_averaged_over: int = 1) -> torch.Tensor:
    """This rank's share of the global token-mean loss: local CE sum / global valid count.

    ``group``: the ranks whose tokens form one optimizer batch (None = the world: every dp x sp rank).
    Summed over ``group`` the returned values give the global mean loss (all-reduce it for logging).
    """
    total, count = token_nll_sum(logits, targets, ignore_index)
    n = global_count(count, group).clamp_min(1).to(total.dtype)
    return total * (grads_averaged_over / n)


__all__ = ["sp_token_mean_loss", "token_nll_sum", "global_count", "IGNORE_INDEX"]
