"""RMSNorm as one autograd Function: same forward values as HF's Llama/Mistral/Qwen RMSNorm, lean backward.
``plus_one``: the Gemma / Qwen3-Next / Qwen3.5 form, ``(n * (1 + w)).to(dtype)`` with the product in fp32.

HF's RMSNorm runs in fp32 and autograd keeps the fp32 upcast of the input (16 KB/token at d=4096) plus the
normalised bf16 tensor; its backward then builds several more fp32 tensors of the whole sequence (about
90 KB/token at 7B: the largest item of a recomputed layer's working set, see bench/trace_memory.py). This
Function keeps only the input and the fp32 inverse RMS (4 bytes/token) and recomputes the normalised
values in backward. The math is one fused kernel on CUDA (``compiled``) and row chunks in eager mode, so no
fp32 temporary of the whole sequence exists in either direction.

Forward values are bit-identical to HF's in eager mode (same ops, same order); gradients equal to rounding
(fp32 math, weight gradient reduced in fp32).
"""
from __future__ import annotations

import torch

from .jit import compiled, row_chunks


def _forward(x, weight, eps: float, plus_one: bool = False):
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return ((x32 * rstd) * (1.0 + weight.float())).to(x.dtype), rstd
    return weight * (x32 * rstd).to(x.dtype), rstd


def _backward(dy, x, weight, rstd, plus_one: bool = False):
    x32 = x.float()
    if plus_one:  # everything in fp32 after the upcast, as autograd runs HF's forward
        dw = (dy.float() * (x32 * rstd)).sum(0)
        dn = dy.float() * (1.0 + weight.float())
    else:
        n_in = (x32 * rstd).to(x.dtype)  # the forward's normalised tensor, recomputed exactly
        dw = (dy.float() * n_in.float()).sum(0)
        dn = (dy * weight).to(x.dtype).float()  # as autograd: grad of n_in in its dtype, then fp32
    dx = (rstd * dn - x32 * rstd.pow(3) * (dn * x32).mean(-1, keepdim=True)).to(x.dtype)
    return dx, dw


_forward_fused = compiled(_forward)
_backward_fused = compiled(_backward)


def rms_norm_forward(x, weight, eps: float, plus_one: bool = False):
    """(y, rstd) for rows of x (any leading shape); rstd is fp32 with a trailing 1."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.is_cuda:
        y, rstd = _forward_fused(x2, weight, eps, plus_one)
    else:
        parts = [_forward(x2[s:e], weight, eps, plus_one) for s, e in row_chunks(x2.shape[0], x2.shape[1])]
        y, rstd = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return y.view(*x.shape[:-1], y.shape[-1]), rstd.view(*x.shape[:-1], 1)


def rms_norm_backward(dy, x, weight, rstd, plus_one: bool = False):
    """(dx, dw) with dw in fp32 (cast by the caller)."""
    d = x.shape[-1]
    x2, dy2, r2 = x.reshape(-1, d), dy.reshape(-1, d), rstd.reshape(-1, 1)
    if x2.is_cuda:
        dx, dw = _backward_fused(dy2, x2, weight, r2, plus_one)
    else:
        dx = torch.empty_like(x2)
        dw = torch.zeros(d, dtype=torch.float32, device=x.device)
        for s, e in row_chunks(x2.shape[0], d):
            dx[s:e], dw_c = _backward(dy2[s:e], x2[s:e], weight, r2[s:e], plus_one)
            dw += dw_c
    return dx.view(x.shape), dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, plus_one=False):
        y, rstd = rms_norm_forward(x, weight, eps, plus_one)
        ctx.save_for_backward(x, weight, rstd)
        ctx.plus_one = plus_one
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.contiguous(), x, weight, rstd, ctx.plus_one)
        return (dx if ctx.needs_input_grad[0] else None,
                dw.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None)


__all__ = ["RMSNormFunction", "rms_norm_forward", "rms_norm_backward"]
