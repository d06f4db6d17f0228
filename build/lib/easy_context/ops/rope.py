"""Rotary position embedding (RoPE) of q and k as one autograd Function with a fused kernel.

HF's ``apply_rotary_pos_emb`` is ``x * cos + rotate_half(x) * sin``: four to six kernels per tensor in each
direction (slices, neg, cat, two muls, add), each a full pass over q or k. Here forward and backward are
one ``compiled`` kernel each on CUDA, nothing is saved but cos/sin (shared by all layers), and the output
keeps the (batch, seq, heads, head_dim) memory layout the attention kernels want. Backward uses the
adjoint of rotate_half: d/dx of rotate_half(x)·g is -rotate_half(g).

Attached per attention module: its class is swapped for a subclass whose forward sets a context flag, and
the family's modeling module gets a dispatcher in place of its ``apply_rotary_pos_emb`` that uses the fused
Function while the flag is set and the original otherwise (other models of the family are untouched).
Before first use the fused Function is checked against the family's original on a small input, so a
transformers version with a different RoPE is refused instead of silently changed.
"""
from __future__ import annotations

import contextvars
import sys

import torch

from ..families import ROPE_ATTENTIONS as KNOWN  # one record per family
from .jit import compiled

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("easy_context_fused_rope", default=False)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def _rope_grad(dy, cos, sin):
    return dy * cos - _rotate_half(dy * sin)


_rope_fused = compiled(_rope)
_rope_grad_fused = compiled(_rope_grad)


class RotaryFunction(torch.autograd.Function):
    """apply(x, cos, sin) with x (B, L, H, D) and cos/sin broadcastable to it (B, L, 1, D)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_fused(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_grad_fused(dy, cos, sin), None, None


def fused_rope(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Same contract as HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)``."""
    if unsqueeze_dim == 1:  # q, k are (B, H, L, D) views of (B, L, H, D) projections: work in that layout
        cos_l, sin_l = cos.unsqueeze(2), sin.unsqueeze(2)
        return tuple(RotaryFunction.apply(x.transpose(1, 2), cos_l, sin_l).transpose(1, 2) for x in (q, k))
    cos_u, sin_u = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return RotaryFunction.apply(q, cos_u, sin_u), RotaryFunction.apply(k, cos_u, sin_u)


def _dispatcher(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _ACTIVE.get() and not args and set(kwargs) <= {"unsqueeze_dim"} \
                and not (cos.requires_grad or sin.requires_grad):
            return fused_rope(q, k, cos, sin, **kwargs)
        return original(q, k, cos, sin, *args, **kwargs)
    apply_rotary_pos_emb._easy_context_original = original
    return apply_rotary_pos_emb


def _self_check(original):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = (torch.randn(2, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    try:
        want = original(q, k, cos, sin)
    except Exception:  # a different signature or semantics
        return False
    got = fused_rope(q, k, cos, sin)
    return all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(want, got))


class FusedRopeMixin:
    def forward(self, *args, **kwargs):
        token = _ACTIVE.set(True)
        try:
            return super().forward(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)


_CLASSES: dict[type, type] = {}


def fuse_rope(attn: torch.nn.Module) -> torch.nn.Module:
    """Make this attention module apply RoPE with the fused Function (idempotent)."""
    cls = type(attn)
    if isinstance(attn, FusedRopeMixin):
        return attn
    if cls.__name__ not in KNOWN:
        raise ValueError(f"fused RoPE supports {KNOWN}; got {cls.__name__}")
    mod = sys.modules[cls.__module__]
    current = getattr(mod, "apply_rotary_pos_emb", None)
    if current is None:
        raise ValueError(f"fused RoPE: {cls.__module__} has no apply_rotary_pos_emb")
    if not hasattr(current, "_easy_context_original"):
        if not _self_check(current):
            raise ValueError(f"fused RoPE: {cls.__module__}.apply_rotary_pos_emb is not x*cos + "
                             "rotate_half(x)*sin in this transformers version; run without fused RoPE "
                             "(apply_fused_ops(model, rope=False), train.py --no-fused-ops)")
        mod.apply_rotary_pos_emb = _dispatcher(current)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FusedRope{cls.__name__}", (FusedRopeMixin, cls), {"__module__": __name__})
    attn.__class__ = _CLASSES[cls]
    return attn


def unfuse_rope(attn: torch.nn.Module) -> torch.nn.Module:
    if isinstance(attn, FusedRopeMixin):
        attn.__class__ = next(c for c in type(attn).__mro__[1:] if not issubclass(c, FusedRopeMixin))
    return attn


__all__ = ["RotaryFunction", "fused_rope", "fuse_rope", "unfuse_rope", "FusedRopeMixin"]
