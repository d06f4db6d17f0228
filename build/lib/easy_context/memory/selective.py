"""Selective ("rematerialisation-aware") checkpointing: checkpoint every decoder layer but keep its
attention output, so the backward recomputes only norms / projections / RoPE / MLP and never the
(distributed) attention — no second round of attention communication.

The idea is LightSeq's (Li et al. 2023, "rematerialization-aware gradient checkpointing"), which cut the
model at attention outputs by rewriting the decoder forward. Here nothing of transformers is copied: the
layer's own checkpoint hook (``GradientCheckpointingLayer._gradient_checkpointing_func``, set by
``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``) is wrapped so that each layer call
gets a small cache that lives exactly as long as that call's autograd graph:

* original forward: every attention call stores its result in the cache;
* recomputation (backward): the same calls, in the same order, get the stored result back.

Two ways an attention takes part, chosen per call:

* lean (modes whose attention opts in with ``cached_attention``, e.g. dist_flash_attn): the attention's
  ``autograd.Function`` runs ``out, lse = cached_attention(compute)``. Only (out, lse) are kept; during the
  recomputation the Function gets them back without computing or communicating, and saves the recomputed
  q, k, v with them for its own backward — exactly what non-checkpointed training would save.
* generic (any other attention function: plain SDPA of data_parallel, zigzag, Ulysses, ...): the call is
  run once on detached q, k, v outside the checkpoint's saved-tensor hooks, so its own autograd graph
  (and whatever it saves) is kept; the recomputation returns its output and the backward runs that
  graph's backward once. Costs the attention's saved tensors (q, k, v, out, lse) per layer.

The generic path finds the attention call through the ``ALL_ATTENTION_FUNCTIONS`` lookup of the layer's
modeling module, which is wrapped only while the checkpointed layer runs (so any later
``apply_seq_parallel_monkey_patch`` is honoured). That swap is process-wide for the duration of a layer
call: do not run two models of the same family in different threads with this enabled.

Works with non-reentrant (default) and reentrant checkpointing, in any sequence-parallel mode.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from ..attention_cache import _ACTIVE, SUPPORTS_CACHE, _LayerCache, cached_attention  # noqa: F401 - re-exported


# ----------------------------------------------------------------------------------------------
# generic path: keep the attention call's own graph
# ----------------------------------------------------------------------------------------------
class _Graph:
    __slots__ = ("inputs", "out", "weights")

    def __init__(self, inputs, out, weights):
        self.inputs, self.out, self.weights = inputs, out, weights


def _keep(x):
    return x


def _record(fn, module, qkv, args, kwargs) -> _Graph:
    token = _ACTIVE.set(None)  # a lean attention nested inside runs normally here
    try:
        # Innermost saved-tensor hooks win: the attention's own saved tensors stay in memory instead of
        # being dropped (and later recomputed) by the checkpoint's hooks.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in qkv)
            out, weights = fn(module, *leaves, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)
    return _Graph(leaves, out, weights)


class _Replay(torch.autograd.Function):
    """Returns the kept output; its backward runs the kept attention graph's backward once."""

    @staticmethod
    def forward(ctx, graph, q, k, v):
        ctx.graph = graph
        return graph.out.detach()

    @staticmethod
    def backward(ctx, dout):
        g = ctx.graph
        need = [i for i, t in enumerate(g.inputs) if t.requires_grad and ctx.needs_input_grad[i + 1]]
        grads = [None, None, None]
        if need and g.out.requires_grad:
            got = torch.autograd.grad(g.out, [g.inputs[i] for i in need], dout, allow_unused=True)
            for i, gi in zip(need, got):
                grads[i] = gi
        return (None, *grads)


def _generic_attention(fn, module, query, key, value, *args, **kwargs):
    cache = _ACTIVE.get()
    if cache is None or not cache.keep_forward:  # nested stashing is for lean attentions only (out + LSE)
        return fn(module, query, key, value, *args, **kwargs)
    if cache.replaying:
        graph = cache.take()
    else:
        graph = _record(fn, module, (query, key, value), args, kwargs)
        cache.put(graph)
    weights = graph.weights.detach() if isinstance(graph.weights, torch.Tensor) else graph.weights
    return _Replay.apply(graph, query, key, value), weights


def _is_lean(fn) -> bool:
    if getattr(fn, SUPPORTS_CACHE, False):
        return True
    mode = getattr(fn, "mode", None)  # easy_context.hf make_attention_fn closures carry their Mode
    return mode is not None and mode.supports_attention_cache


def _selective(fn):
    if _is_lean(fn):
        return fn

    def attention(module, query, key, value, *args, **kwargs):
        return _generic_attention(fn, module, query, key, value, *args, **kwargs)
    return attention


class _InterfaceProxy:
    """Stands in for a modeling module's ``ALL_ATTENTION_FUNCTIONS`` while a checkpointed layer runs."""

    def __init__(self, inner):
        self._inner = inner

    def get_interface(self, name, default):
        return _selective(self._inner.get_interface(name, default))

    def __getitem__(self, name):
        return _selective(self._inner[name])

    def __contains__(self, name):
        return name in self._inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextlib.contextmanager
def _intercept(pymods):
    swapped = []
    try:
        for mod in pymods:
            cur = getattr(mod, "ALL_ATTENTION_FUNCTIONS", None)
            if cur is not None and not isinstance(cur, _InterfaceProxy):
                mod.ALL_ATTENTION_FUNCTIONS = _InterfaceProxy(cur)
                swapped.append((mod, cur))
        yield
    finally:
        for mod, cur in reversed(swapped):
            mod.ALL_ATTENTION_FUNCTIONS = cur


# ----------------------------------------------------------------------------------------------
# the checkpoint function plugged into transformers
# ----------------------------------------------------------------------------------------------
def _selective_checkpoint(base, pymods, keep_forward: bool = True):
    """Wrap a layer's checkpoint function ``base(function, *args)`` (torch checkpoint, offload, ...).
    ``keep_forward=False``: keep only what a nested rebuild computes, for the layer's backward (attention_cache)."""

    def checkpoint_layer(function, *args, **kwargs):
        cache = _LayerCache(keep_forward)  # referenced by the checkpoint's recompute closure: freed with the graph

        def run(*a, **kw):
            cache.begin()
            token = _ACTIVE.set(cache)
            try:
                with _intercept(pymods):
                    return function(*a, **kw)
            finally:
                _ACTIVE.reset(token)
        return base(run, *args, **kwargs)

    checkpoint_layer._easy_context_selective_base = base
    return checkpoint_layer


def _layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"selective checkpointing needs a transformers model whose decoder layers are "
                         f"GradientCheckpointingLayer; {type(model).__name__} has none")
    return layers


def _modeling_modules(layer) -> list:
    mods = {type(m).__module__ for m in layer.modules()}
    return [sys.modules[n] for n in sorted(mods)
            if n in sys.modules and hasattr(sys.modules[n], "ALL_ATTENTION_FUNCTIONS")]


def _hf_enable(model, kwargs):
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers 5 (the renamed API)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _hf_disable(model):
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def is_selective(model) -> bool:
    return any(m.gradient_checkpointing and hasattr(m._gradient_checkpointing_func, "_easy_context_selective_base")
               for m in _layers(model))


def enable_selective_checkpointing(model, checkpoint_kwargs: dict | None = None, layers=None,
                                   nested_others: bool = False):
    """Checkpoint every decoder layer of ``model`` but keep each layer's attention output (and LSE).

    ``layers``: indices of the decoder layers that keep their attention output (None = all). The others stay
    plain checkpointed layers (their backward recomputes attention): the way to spend exactly the GPU memory
    there is — e.g. at 512K one 7B layer's output is 4 GiB, so only some layers can keep theirs.

    If the model already checkpoints its layers (any kwargs, ``every_n_layers``, offload), those layers
    become selective with the same checkpoint function; otherwise per-layer non-reentrant checkpointing
    is switched on first (``checkpoint_kwargs`` go to ``torch.utils.checkpoint.checkpoint``). Idempotent.
    ``nested_others``: the layers not chosen keep the attention output their nested offload group's rebuild computes
    until their own backward (one attention recompute fewer per inner layer of a group; lean attentions only).
    Returns the model.
    """
    all_layers = _layers(model)
    chosen = set(range(len(all_layers))) if layers is None else {int(i) for i in layers}
    bad = sorted(i for i in chosen if not 0 <= i < len(all_layers))
    if bad:
        raise ValueError(f"selective checkpointing: layers {bad} out of range; the model has {len(all_layers)} "
                         f"decoder layers (indices 0..{len(all_layers) - 1})")
    if not any(m.gradient_checkpointing for m in all_layers):
        model._easy_context_selective_prev = False
        _hf_enable(model, {"use_reentrant": False, **(checkpoint_kwargs or {})})
    elif not hasattr(model, "_easy_context_selective_prev"):
        model._easy_context_selective_prev = True
    for i, m in enumerate(all_layers):
        if m.gradient_checkpointing:
            base = m._gradient_checkpointing_func
            base = getattr(base, "_easy_context_selective_base", base)
            if i in chosen or nested_others:
                base = _selective_checkpoint(base, _modeling_modules(m), keep_forward=i in chosen)
            m._gradient_checkpointing_func = base
    return model


def disable_selective_checkpointing(model):
    """Undo ``enable_selective_checkpointing``: back to plain per-layer checkpointing if the model had it
    before, else checkpointing off. Returns the model."""
    for m in _layers(model):
        base = getattr(m._gradient_checkpointing_func, "_easy_context_selective_base", None) \
            if hasattr(m, "_gradient_checkpointing_func") else None
        if base is not None:
            m._gradient_checkpointing_func = base
    if not model.__dict__.pop("_easy_context_selective_prev", True):
        _hf_disable(model)
    return model


__all__ = ["enable_selective_checkpointing", "disable_selective_checkpointing", "is_selective",
           "cached_attention", "SUPPORTS_CACHE"]
