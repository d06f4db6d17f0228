"""The LSE merge: fold a block's partial attention ``(out, lse)`` into float32 accumulators (every ring step, every
document piece). Re-exported by the facade (``kernels.merge_attn_out``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.jit import compiled


def _merge(out, lse_bl, block_out, blk):
    # a row the block masks entirely (lse -inf: a sliding window's band edge) leaves out unchanged, also when
    # out is still empty (both -inf would make the weight nan)
    w = torch.where(torch.isneginf(blk), torch.zeros_like(blk), torch.sigmoid(blk - lse_bl))
    new_out = out - w * (out - block_out.to(out.dtype))
    new_lse = torch.maximum(lse_bl, blk) + F.softplus(-(lse_bl - blk).abs())
    return new_out, torch.where(torch.isneginf(lse_bl), blk, new_lse)


_merge_fused = compiled(_merge)  # one kernel on CUDA instead of ~8 passes with fp32 temporaries


def merge_attn_out(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> None:
    """Fold a block's ``(block_out, block_lse)`` into the float32 accumulators ``(out, lse)`` in place.

    out: fp32 (B, L, H, D); lse: fp32 (B, H, L). Written as
      lse' = lse - logsigmoid(lse - block_lse),  out' = out - sigmoid(block_lse - lse) * (out - block_out)
    which never exponentiates a large positive number (the form ring-flash-attention adopted in its
    PR #34 discussion of LSE overflow); ``lse = -inf`` (no keys seen yet) takes the block as is.
    The math is one fused kernel on CUDA (``ops.jit.compiled``); the results are copied into the accumulators.
    """
    lse_bl = lse.transpose(1, 2).unsqueeze(-1)           # (B, L, H, 1) view onto lse
    blk = block_lse.transpose(1, 2).unsqueeze(-1).to(lse.dtype)
    new_out, new_lse = _merge_fused(out, lse_bl, block_out, blk)
    out.copy_(new_out)
    lse_bl.copy_(new_lse)


__all__ = ["merge_attn_out", "fold_sinks", "sinks_grad", "head_slice", "head_scatter"]


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None):
    """Attention sinks (gpt-oss ``s_aux``): one learned logit per head that joins every row's softmax denominator and
    attends to nothing. Folded once into a row's final ``(out, lse)`` (after the ring's merge, whatever the mode):
    ``lse' = logaddexp(lse, s_h)``, ``out' = out * exp(lse - lse')``. ``out`` (B, L, H, D), ``lse`` fp32 (B, H, L),
    ``sinks`` (H,) or None (nothing to fold). The sink-inclusive ``(out', lse')`` are what the backward takes: the
    kernels' backward recomputes P = exp(S - lse') and D = rowsum(dout * out'), which is then exactly the gradient of
    the softmax over [scores, sink] for q, k and v (the sink's own gradient: ``sinks_grad``)."""
    if sinks is None:
        return out, lse
    s = sinks.detach().to(lse.dtype).view(1, -1, 1)
    new_lse = torch.logaddexp(lse, s)
    scale = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)  # (B, L, H, 1)
    return (out.to(scale.dtype) * scale).to(out.dtype), new_lse


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (H,) from this rank's rows, given the sink-inclusive ``out``/``lse`` of ``fold_sinks``: the
    sink's probability times the row's D, summed over rows with a minus sign (d out'/d s = -p_sink * out')."""
    acc = torch.float64 if lse.dtype == torch.float64 else torch.float32
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (B, H, L)
    p_sink = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse.to(acc))
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


def head_slice(sinks: torch.Tensor | None, world: int, rank: int):
    """The sinks of the q heads a Ulysses rank holds after the all-to-all (head block ``rank`` of ``world``)."""
    if sinks is None or world == 1:
        return sinks
    h = sinks.shape[0] // world
    return sinks[rank * h:(rank + 1) * h]


def head_scatter(grad: torch.Tensor, full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """A Ulysses rank's sinks gradient (its head block) placed in a zero gradient of every head."""
    if world == 1:
        return grad
    out = torch.zeros_like(full)
    h = full.shape[0] // world
    out[rank * h:(rank + 1) * h] = grad
    return out
