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


__all__ = ["merge_attn_out"]
