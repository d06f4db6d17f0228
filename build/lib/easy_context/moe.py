"""MoE router load-balancing loss under sequence parallelism, equal to one process.

The Switch / Mixtral auxiliary loss is  E * sum_e f_e * P_e  with f_e the fraction of top-k assignments to expert e
and P_e its mean router probability, both over every token of the batch (and every MoE layer). It is a product
of two means, not a sum over tokens, so a rank cannot compute its share from its own tokens alone: one small
all-reduce (2E + 1 numbers) gives the global f, P and token count; each rank then returns
E * sum_e f_e * P_e(local sum) / N, whose sum over ranks is the loss and whose gradients (through P only; f comes
from a top-k and has none) are exactly the single-process ones.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def num_experts(config) -> int:
    n = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not n:
        raise ValueError(f"{type(config).__name__} has no num_local_experts / num_experts: not an MoE model")
    return int(n)


def router_aux_loss(router_logits, config) -> tuple[torch.Tensor, float]:
    """(this rank's differentiable share, the global loss value) of the load-balancing loss of one forward.

    ``router_logits``: the model's ``router_logits`` output (one ``(tokens, E)`` tensor per MoE layer)."""
    e, k = num_experts(config), int(config.num_experts_per_tok)
    counts = torch.zeros(e, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(counts)
    rows = 0
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(p, k, dim=-1).indices
        counts = counts + torch.nn.functional.one_hot(top.reshape(-1), e).sum(0).float()
        probs = probs + p.sum(0)
        rows += p.shape[0]
    stats = torch.cat([counts, probs.detach(), torch.tensor([float(rows)], device=counts.device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        from .phase import phase
        with phase("MoE aux-loss all-reduce"):
            dist.all_reduce(stats)  # every rank's tokens: sp shards and dp rows alike
    g_counts, g_probs, n = stats[:e], stats[e:2 * e], stats[-1].clamp(min=1)
    share = e * torch.sum(g_counts / n * probs / n)
    return share, float(e * torch.sum(g_counts / n * g_probs / n))


__all__ = ["router_aux_loss", "num_experts"]
