"""The one place that knows attention kernels.

Every sequence-parallel algorithm calls exactly two functions:

    attn_forward(q, k, v, causal, softmax_scale)              -> (out, lse)
    attn_backward(dout, q, k, v, out, lse, causal, softmax_scale) -> (dq, dk, dv)

Layout legend (flash-attn's): q/out/dq ``(B, Lq, Hq, D)``; k/v/dk/dv ``(B, Lk, Hkv, D)`` with
``Hq % Hkv == 0`` (GQA: k/v are never expanded over the wire, and not in memory where the backend
takes fewer kv heads); ``lse`` is float32 ``(B, Hq, Lq)``, natural log, of the *scaled* scores.
``causal=True`` needs ``Lq == Lk`` (the diagonal block of a ring step); unequal lengths are non-causal.

Backends (``backend=`` argument, else env ``EASY_CONTEXT_ATTN_BACKEND``, else automatic; README has the measured
throughputs):
  fa4        FlashAttention-4 (``flash-attn-4``, CuTe DSL, JIT) on sm90/sm100 when importable: the fastest on
             H200, native GQA; any failure falls back to cudnn with one warning (see fa4.py)
  cudnn      aten._scaled_dot_product_cudnn_attention  (the fastest aten kernel on Hopper)
  flash      aten._scaled_dot_product_flash_attention  (FA2 inside PyTorch)
  efficient  aten._scaled_dot_product_efficient_attention (any CUDA dtype incl. fp32)
  flash_attn the flash-attn package, if importable
  cpu        aten._scaled_dot_product_flash_attention_for_cpu (returns the LSE)
  math       plain PyTorch, q processed in chunks; any dtype incl. float64 — the reference

``merge_attn_out`` folds a block's partial ``(out, lse)`` into a running float32 accumulator.

Files: this facade (attn_forward / attn_backward, re-exports); backends.py (the backend table, choice and
adapters); fa4.py (FlashAttention-4 with its fallback); documents.py (document-masked pieces, varlen grouping);
reference.py (the math backend and the test oracle); merge.py (``merge_attn_out``, the LSE merge); checks.py
(``check_qkv``). Imports run one way: the facade imports the others, none imports the facade.
"""
from __future__ import annotations

import math

from . import fa4
from .backends import (_BACKWARD, _DTYPES, _FORWARD, BACKENDS, ENV_VAR, auto_cuda_backend,  # noqa: F401
                       available_backends, choose_backend)
from .checks import check_qkv
from .documents import VARLEN, VARLEN_MIN_DOCS, _doc_backward, _doc_forward, _group  # noqa: F401 (tests)
from .merge import fold_sinks, head_scatter, head_slice, merge_attn_out, sinks_grad
from .reference import attention_reference


def attn_forward(q, k, v, causal: bool = True, softmax_scale: float | None = None,
                 backend: str | None = None, docs=None, into=None):
    """Attention of one block. Returns ``out`` (q's dtype, (B,Lq,Hq,D)) and ``lse`` (fp32, (B,Hq,Lq)).

    ``docs`` (a ``packing.BlockDocs``: the global indices of the block's q and kv rows and the packed
    documents) makes it document-masked: causal within each document by global index (``causal`` is then
    implied), computed as dense pieces; rows the mask leaves empty get out 0 and lse -inf, and a block the
    mask removes entirely returns None (no kernel call). With ``docs``, ``into=(out, lse)`` (fp32 accumulators
    of all q rows) merges the pieces straight into them and returns them: no block-sized buffer, cast or merge."""
    check_qkv(q, k, v, causal=causal and docs is None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    name = choose_backend(q, backend)
    fwd = _FORWARD[name]
    if docs is not None:
        return _doc_forward(name, q, k, v, scale, docs, into, merge=merge_attn_out)
    if into is not None:
        raise ValueError("attn_forward(into=...) needs docs= (the pieces to merge)")
    return fwd(q, k, v, causal, scale)


def attn_backward(dout, q, k, v, out, lse, causal: bool = True, softmax_scale: float | None = None,
                  backend: str | None = None, docs=None, into=None):
    """Gradients of one block given the saved ``out``/``lse`` of the *whole* row (not of this block).

    Passing the final merged out/lse of a ring makes each block's dq/dk/dv exact contributions
    (the softmax normaliser and rowsum(dO∘O) are those of the full row). With ``docs``, ``into=(dq, dk, dv)``
    (fp32 accumulators shaped like q, k, v) adds the pieces' gradients to them and returns them.
    """
    check_qkv(q, k, v, causal=causal and docs is None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    name = choose_backend(q, backend)
    bwd = _BACKWARD[name]
    if docs is not None:
        return _doc_backward(name, dout, q, k, v, out, lse, scale, docs, into)
    if into is not None:
        raise ValueError("attn_backward(into=...) needs docs= (the pieces to accumulate)")
    return bwd(dout, q, k, v, out, lse, causal, scale)


__all__ = ["attn_forward", "attn_backward", "merge_attn_out", "fold_sinks", "sinks_grad", "head_slice", "head_scatter",
           "attention_reference", "check_qkv", "choose_backend", "available_backends", "auto_cuda_backend", "BACKENDS", "ENV_VAR", "VARLEN", "VARLEN_MIN_DOCS", "fa4"]
