"""Fused pieces of a decoder layer around the matmuls (all exact up to rounding; eager on CPU).

    from easy_context.ops import apply_fused_ops
    apply_fused_ops(model)          # RMSNorm + RoPE as fused kernels (torch.compile on CUDA)

* ``rms_norm`` — RMSNorm Function keeping input + fp32 inverse RMS; one fused kernel each way on CUDA.
* ``rope``     — RoPE of q and k; one fused kernel each way, output in the layout attention kernels want.
* ``lean_norm`` — swaps a model's HF RMSNorms for the lean one (``apply_lean_norms``; the memory option).
* ``jit``      — ``compiled(fn)``, the torch.compile wrapper both use (``EASY_CONTEXT_COMPILE=0`` disables it).
"""
from __future__ import annotations

from .jit import compile_enabled, compiled
from .lean_norm import apply_lean_norms, remove_lean_norms
from .rms_norm import RMSNormFunction, rms_norm_backward, rms_norm_forward
from .rope import KNOWN as ROPE_ATTENTIONS
from .rope import FusedRopeMixin, RotaryFunction, fuse_rope, fused_rope, unfuse_rope


def apply_fused_ops(model, norms: bool = True, rope: bool = True) -> dict:
    """Swap the model's RMSNorms / attention RoPE for the fused ones; returns how many of each."""
    n = {"norms": 0, "rope": 0}
    if norms:
        n["norms"] = apply_lean_norms(model)
    if rope:
        for m in model.modules():
            if type(m).__name__ in ROPE_ATTENTIONS or isinstance(m, FusedRopeMixin):
                fuse_rope(m)
                n["rope"] += 1
    return n


def remove_fused_ops(model) -> None:
    remove_lean_norms(model)
    for m in model.modules():
        unfuse_rope(m)


__all__ = ["apply_fused_ops", "remove_fused_ops", "apply_lean_norms", "remove_lean_norms", "compiled", "compile_enabled", "RMSNormFunction",
           "rms_norm_forward", "rms_norm_backward", "RotaryFunction", "fused_rope", "fuse_rope", "unfuse_rope"]
