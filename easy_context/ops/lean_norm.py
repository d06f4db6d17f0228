"""Lean RMSNorm: the same forward as HF's Llama/Mistral/Qwen RMSNorm, a backward that keeps less.

HF's RMSNorm runs in fp32 and autograd keeps the fp32 upcast of its input (16 KB/token at d=4096) plus the
normalised bf16 tensor (8 KB/token): 24 KB/token per norm, two norms per decoder layer, inside the
recompute working set that bounds memory per token once layer inputs are offloaded. This Function keeps
only the input (in its own dtype, usually already kept by the caller) and the fp32 inverse RMS (4 bytes
per token), and recomputes the normalised values in backward (``easy_context.ops.rms_norm``: one fused
kernel each way on CUDA, row chunks in eager mode, so the backward has no fp32 temporaries of the whole
sequence either). Eager forward values are bit-identical to HF's (same ops in the same order); the fused
kernel and the gradients agree to rounding (fp32 math, fp32 weight-gradient reduction).

Attached by swapping the norm instance's class for a dynamic subclass (parameter names unchanged), only
for the known HF classes whose forward is ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)``, or
(``families.PLUS_ONE_NORMS``: Gemma 3, Qwen3-Next, Qwen3.5) ``(x.float() * rsqrt(...) * (1 + weight.float())).to(x.dtype)``
— the fp32 upcasts of those are the largest item of a Qwen3.5 layer's recompute working set.
"""
from __future__ import annotations

import torch
from torch import nn

from ..families import NORM_CLASSES as KNOWN  # one record per family
from ..families import PLUS_ONE_NORMS
from .rms_norm import RMSNormFunction


class LeanRMSNormMixin:
    _plus_one = False

    def forward(self, hidden_states):
        if not torch.is_grad_enabled():
            return super().forward(hidden_states)
        eps = self.eps if self._plus_one else self.variance_epsilon
        return RMSNormFunction.apply(hidden_states, self.weight, eps, self._plus_one)


_CLASSES: dict[type, type] = {}


def lean_norm(norm: nn.Module) -> nn.Module:
    cls = type(norm)
    if isinstance(norm, LeanRMSNormMixin):
        return norm
    if cls.__name__ not in KNOWN:
        raise ValueError(f"lean RMSNorm supports {KNOWN}; got {cls.__name__}")
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lean{cls.__name__}", (LeanRMSNormMixin, cls),
                             {"__module__": __name__, "_plus_one": cls.__name__ in PLUS_ONE_NORMS})
    norm.__class__ = _CLASSES[cls]
    return norm


def unlean_norm(norm: nn.Module) -> nn.Module:
    if isinstance(norm, LeanRMSNormMixin):
        norm.__class__ = next(c for c in type(norm).__mro__[1:] if not issubclass(c, LeanRMSNormMixin))
    return norm


def apply_lean_norms(model: nn.Module) -> int:
    """Swap every known HF RMSNorm in ``model`` for the lean one; returns how many."""
    n = 0
    for m in model.modules():
        if type(m).__name__ in KNOWN or isinstance(m, LeanRMSNormMixin):
            lean_norm(m)
            n += 1
    return n


def remove_lean_norms(model: nn.Module) -> None:
    for m in model.modules():
        unlean_norm(m)


__all__ = ["RMSNormFunction", "lean_norm", "unlean_norm", "apply_lean_norms", "remove_lean_norms"]
