"""The attention-output cache of selective checkpointing, below the modes (they import it; memory/selective.py,
which plugs it into the checkpointed layers, builds on it — no mode imports the memory package).

A checkpointed layer call (memory/selective.py) sets the active ``_LayerCache``; an attention Function that
opts in runs ``out, lse = cached_attention(compute)``: stored in the layer's forward, returned (without
computing or communicating) in its recomputation.
"""
from __future__ import annotations

import contextvars

import torch

# The cache of the checkpointed layer call currently running (None outside selective checkpointing).
# A context variable, like torch's own modes: it is per thread and always reset in ``finally``.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("easy_context_selective_layer", default=None)
SUPPORTS_CACHE = "supports_attention_cache"  # attribute an attention function sets to take the lean path


class _LayerCache:
    """Attention results of one checkpointed layer call, in call order.

    ``keep_forward`` (selective layers): stored in the layer's forward, returned in every recomputation. Otherwise
    (nested offload groups, memory/offload.py): the forward keeps nothing; a recomputation without autograd (the
    group's rebuild of its inner layer inputs) stores, and the layer's own backward recomputation takes and drops
    it, so a nested layer's attention runs twice (forward + one recompute) instead of three times."""

    __slots__ = ("entries", "pos", "runs", "keep_forward")

    def __init__(self, keep_forward: bool = True):
        self.entries: list = []
        self.pos = 0
        self.runs = 0
        self.keep_forward = keep_forward

    def begin(self):
        self.runs += 1
        self.pos = 0

    @property
    def replaying(self) -> bool:
        return self.runs > 1

    def take(self):
        if self.pos >= len(self.entries):
            raise RuntimeError("selective checkpointing: the layer's recomputation called attention more "
                               f"often ({self.pos + 1}) than its forward ({len(self.entries)})")
        entry = self.entries[self.pos]
        self.pos += 1
        return entry

    def put(self, entry):
        self.entries.append(entry)
        self.pos = len(self.entries)  # a layer may call attention more than once (head groups): the next is new

    def resolve(self, compute, grad: bool | None = None):
        """The result of one attention call: computed, stored or taken back (``action``)."""
        action = self.action(grad)
        if action == "compute":
            return compute()
        if action in ("take", "take_once"):
            i = self.pos
            got = tuple(t.detach() for t in self.take())
            if action == "take_once":
                self.entries[i] = None  # the layer's last recomputation: free it with its backward's saved copy
            return got
        res = tuple(compute())
        self.put(tuple(t.detach() for t in res))  # aliases: no copy, and in-place edits trip autograd
        return res

    def action(self, grad: bool | None = None) -> str:
        """What an attention call does now: "compute", "store" or "take" (see the class doc). ``grad``: the grad
        mode of the call (default: the current one; a head-chunked block passes the one it was called in)."""
        if self.keep_forward:
            return "take" if self.replaying else "store"
        if not self.replaying:
            return "compute"
        if self.pos < len(self.entries):
            return "take_once"
        return "compute" if (torch.is_grad_enabled() if grad is None else grad) else "store"


def cached_attention(compute):
    """For attention Functions: ``out, lse = cached_attention(lambda: my_forward(...))``.

    Outside selective checkpointing it just calls ``compute``. In a checkpointed layer's forward it stores
    the result; in the layer's recomputation it returns the stored tensors without calling ``compute``.
    The active cache decides (``resolve``): a layer's (``_LayerCache``) or a head group's (memory/head_chunks.py).
    """
    cache = _ACTIVE.get()
    return compute() if cache is None else cache.resolve(compute)


__all__ = ["cached_attention", "SUPPORTS_CACHE"]
