"""``compiled(fn)``: a pure tensor function fused by ``torch.compile`` on CUDA tensors, eager elsewhere.

Used for the memory-bound pieces around the matmuls (RMSNorm, RoPE): eager PyTorch runs each of them as
5-10 kernels with fp32 temporaries of the whole sequence; one fused kernel reads the inputs once and writes
the outputs once, which is both faster and leaves no temporaries in the backward working set.

Compilation is lazy (first CUDA call) with dynamic shapes (one compile serves every sequence length). If
it fails (no Triton, unsupported GPU) a warning is printed once and the eager function is used: same math,
same results up to rounding. ``EASY_CONTEXT_COMPILE=0`` turns it off. On CPU the eager function runs, so
float32 CPU tests see exactly the reference ops.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch


def compile_enabled() -> bool:
    return os.environ.get("EASY_CONTEXT_COMPILE", "1") not in ("0", "false", "False", "")


def compiled(fn):
    state: dict = {}

    @functools.wraps(fn)
    def call(*args):
        if not (args[0].is_cuda and compile_enabled()):
            return fn(*args)
        fast = state.get("fast")
        if fast is None:
            fast = state["fast"] = torch.compile(fn, dynamic=True, fullgraph=True)
        if fast is fn:
            return fn(*args)
        try:
            return fast(*args)
        except Exception as e:  # compile failures surface at the first call
            warnings.warn(f"easy_context: torch.compile of {fn.__name__} failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); using eager PyTorch for it", stacklevel=2)
            state["fast"] = fn
            return fn(*args)

    call.eager = fn
    return call


def row_chunks(n: int, row_elems: int, max_elems: int = 1 << 26):
    """Row ranges whose fp32 temporaries stay under ``max_elems`` elements (256 MB): eager fallbacks run
    chunk by chunk so their temporaries do not grow with the sequence."""
    step = max(1, max_elems // max(1, row_elems))
    return [(s, min(n, s + step)) for s in range(0, n, step)]
