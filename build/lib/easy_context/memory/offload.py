"""Checkpoint offload: per-layer checkpointed inputs live in pinned CPU memory, not on the GPU.

With per-layer checkpointing a Llama-7B keeps 8 KB/token/layer of layer inputs (256 KB/token for 32
layers) on the GPU until backward. ``CheckpointOffload`` is a checkpoint function plugged into transformers'
own gradient checkpointing (``GradientCheckpointingLayer._gradient_checkpointing_func``; no forward is
copied) that

* runs the layer without autograd and copies its input to page-locked host chunks (``HostPool``, reused
  across steps and lengths) on a side CUDA stream: the copy overlaps the next layer's compute, and
  ``record_stream`` keeps the GPU block alive until it is done;
* in backward, copies the input back, recomputes the layer and starts the copy for the previous checkpoint once
  this layer's attention backward is done (the gradient of its first attention projection arrives): the H2D copy
  overlaps the projections' backward, and the previous input is not on the GPU at the attention backward's peak
  (8 KB/token at 7B); a layer without a recognisable projection prefetches when its backward ends;
* with ``every_k > 1`` keeps (offloads) only every k-th layer input: when the last layer of a group of k
  runs backward, the group's inner inputs are recomputed from the kept one and held on the GPU until each
  layer's backward (nested checkpointing; one extra layer forward per layer, host memory / k). Use it when
  host RAM is short, or with ``offload=False`` to cut GPU memory without a host.

Backward is reentrant-style (like ``use_reentrant=True`` and DeepSpeed's activation checkpointing): the
layer is recomputed with autograd on and ``torch.autograd.backward`` accumulates the parameter gradients,
which is what ZeRO-3's per-module gather hooks expect. RNG state and autocast are replayed, so dropout
masks match. On CPU tensors "offload" is the same chunked copy without streams: exact results.
(Memory cost of a layer's backward = its own recompute working set, see tiled_mlp.py and norm.py.)
The host chunks and the copies of one kept input are in host_stash.py; here: the checkpoint function, its
autograd Function and the nested groups.
"""
from __future__ import annotations

import contextlib

import torch

from .host_stash import HostPool, _Stash


def _autocast_state(device_type: str):
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (AttributeError, TypeError, RuntimeError):  # older torch
        return False, None


class _RngState:
    """CPU + device RNG state at forward time, so the recompute draws the same random numbers."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.dev = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def fork(self):
        devices = [self.device] if self.dev is not None else []
        ctx = torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda")
        return _Restore(ctx, self)


class _Restore:
    def __init__(self, ctx, st):
        self.ctx, self.st = ctx, st

    def __enter__(self):
        self.ctx.__enter__()
        torch.set_rng_state(self.st.cpu)
        if self.st.dev is not None:
            torch.cuda.set_rng_state(self.st.dev, self.st.device)

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


class _Group:
    """k consecutive layers sharing one kept input (the first layer's)."""

    def __init__(self, stash: _Stash):
        self.stash, self.fns, self.cache = stash, [], {}

    def _fetch(self) -> torch.Tensor:
        return self.stash.get()

    def input_for(self, j: int) -> torch.Tensor:
        if j == 0 and 0 not in self.cache:
            return self._fetch()
        if j not in self.cache:
            # the last layer of the group runs backward first: rebuild all inner inputs once, no autograd
            x = self._fetch()
            self.cache[0] = x
            with torch.no_grad():
                for i in range(len(self.fns) - 1):
                    x = self.fns[i].replay(x)
                    self.cache[i + 1] = x
        return self.cache.pop(j)


class _LayerCall:
    """What one checkpointed layer call needs to be replayed: the function, RNG and autocast state, and the
    module whose output gradient marks the end of the layer's attention backward (``_first_projection``)."""

    def __init__(self, fn, device, marker=None, index=0):
        self.fn, self.marker, self.index = fn, marker, index
        self.rng = _RngState(device)
        self.device_type = device.type
        self.autocast = _autocast_state(device.type)

    def replay(self, x):
        enabled, dtype = self.autocast
        with self.rng.fork(), torch.autocast(self.device_type, enabled=enabled, dtype=dtype):
            return _first(self.fn(x))


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, group, j, hidden, _dummy):
        ctx.call, ctx.group, ctx.j = call, group, j
        with _traced(group.stash.mgr, f"forward {call.index}"):
            out = call.fn(hidden)
        # transformers < 5 layers return a tuple (hidden, ...): the extras (None/attn weights) pass through
        call.extra = tuple(out[1:]) if isinstance(out, (tuple, list)) else None
        return _first(out)

    @staticmethod
    def backward(ctx, grad_out):
        with _traced(ctx.group.stash.mgr, f"backward {ctx.call.index}"):
            return _OffloadedCheckpoint._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        group, j = ctx.group, ctx.j
        x = group.input_for(j)
        mgr = group.stash.mgr
        handle = None
        if j == 0 and ctx.call.marker is not None:  # the group's last backward: bring the previous input back
            def on_output(module, args, out):
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g: mgr.prefetch_before(group))
            handle = ctx.call.marker.register_forward_hook(on_output)
        try:
            with torch.enable_grad():
                h = x.detach().requires_grad_(True)
                out = ctx.call.replay(h)
        finally:
            if handle is not None:
                handle.remove()
        _drop_values(out)
        torch.autograd.backward(out, grad_out)
        if j == 0:
            mgr.prefetch_before(group)  # no-op if the hook already did
        return None, None, None, h.grad, None


def _traced(mgr, name):
    tl = mgr.timeline
    return tl.span("compute", name) if tl is not None else contextlib.nullcontext()


def _first_projection(layer):
    """The first Linear of the layer's attention (q_proj, or a fused qkv): its output gradient is computed right after
    the attention backward. None when the layer has no such module (then prefetch waits for the layer's end)."""
    attn = getattr(layer, "self_attn", None) if layer is not None else None
    if attn is None:
        return None
    return next((m for m in attn.modules() if isinstance(m, torch.nn.Linear)), None)


def _drop_values(out: torch.Tensor) -> None:
    """Free the recomputed layer output's memory before its backward (one hidden state per token): only
    its graph is needed. Only when the last op is a residual add, whose backward reads no values."""
    fn = out.grad_fn
    if fn is not None and type(fn).__name__ == "AddBackward0" and out._base is None:
        out.untyped_storage().resize_(0)


class CheckpointOffload:
    """Per-model checkpoint function factory; see the module docstring.

    offload: copy kept inputs to host memory (else keep them on the GPU: plain/nested checkpointing).
    every_k: keep one input per k layers (nested recompute of the others).
    """

    def __init__(self, offload: bool = True, every_k: int = 1, pool: HostPool | None = None):
        if int(every_k) < 1:
            raise ValueError(f"every_k must be >= 1, got {every_k}")
        self.offload, self.every_k = bool(offload), int(every_k)
        self.pool = pool if pool is not None else HostPool()
        self._streams: dict = {}
        self._order: list[_Group] = []  # groups of the current forward, in order (for prefetch)
        self.timeline = None  # a bench.offload_timeline.Timeline to record copies, compute and stalls (CUDA only)
        self._open: _Group | None = None

    # -- host memory / streams ---------------------------------------------------------------------
    def stream(self, device):
        key = torch.device(device).index
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
            self.pool.streams.append(self._streams[key])
        return self._streams[key]

    def reserve(self, nbytes: int):
        """Pin host chunks for ``nbytes`` of kept inputs ahead of time (pinning is slow)."""
        self.pool.reserve(nbytes)

    def release_pool(self):
        """Unpin and free the idle host chunks (e.g. before a step that needs the host memory)."""
        self.pool.release()

    # -- the checkpoint function -------------------------------------------------------------------
    def layer_function(self, layer_idx: int, layer=None):
        """A ``_gradient_checkpointing_func`` for decoder layer ``layer_idx`` (0-based, forward order)."""
        mgr = self
        marker = _first_projection(layer)

        def checkpoint_fn(function, *args, **kwargs):
            if not args or not isinstance(args[0], torch.Tensor):
                raise ValueError("checkpoint offload needs the hidden states as the first positional argument")
            hidden, rest = args[0], args[1:]
            if any(isinstance(a, torch.Tensor) and a.requires_grad for a in rest) or any(
                    isinstance(v, torch.Tensor) and v.requires_grad for v in kwargs.values()):
                raise ValueError("checkpoint offload: only the first positional argument may require grad")

            def fn(h):
                return function(h, *rest, **kwargs)

            j = layer_idx % mgr.every_k
            if layer_idx == 0:
                mgr._order = []
            if j == 0 or mgr._open is None:
                mgr._open = _Group(_Stash(mgr, hidden, mgr.offload))
                mgr._order.append(mgr._open)
                j = 0
            group = mgr._open
            call = _LayerCall(fn, hidden.device, marker, layer_idx)
            group.fns.append(call)
            dummy = torch.empty(0, requires_grad=True)  # output needs grad even if hidden does not
            out = _OffloadedCheckpoint.apply(call, group, len(group.fns) - 1, hidden, dummy)
            return out if call.extra is None else (out, *call.extra)

        return checkpoint_fn

    def prefetch_before(self, group: _Group):
        """Start bringing back the kept input of the group before ``group`` in forward order."""
        try:
            i = next(i for i, g in enumerate(self._order) if g is group)
        except StopIteration:
            return
        if i > 0:
            self._order[i - 1].stash.prefetch()
        self._order = self._order[:i]  # consumed; drop references


def enable_checkpoint_offload(model, offload: bool = True, every_k: int = 1,
                              pool: HostPool | None = None) -> CheckpointOffload:
    """Turn on per-layer checkpointing of ``model`` with offloaded / every-k kept inputs.

    The host pool is kept on the model (``model._easy_context_host_pool``) and reused when the options are
    changed again, so pinned memory is not re-pinned per configuration or length.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if pool is None:
        pool = model.__dict__.get("_easy_context_host_pool") or HostPool()
    model._easy_context_host_pool = pool
    mgr = CheckpointOffload(offload=offload, every_k=every_k, pool=pool)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no GradientCheckpointingLayer (transformers >= 4.52 "
                         "decoder layers); checkpoint offload hooks into them")
    for i, layer in enumerate(layers):
        layer._gradient_checkpointing_func = mgr.layer_function(i, layer)
        layer.gradient_checkpointing = True
    model._easy_context_offload = mgr
    return mgr


__all__ = ["CheckpointOffload", "HostPool", "enable_checkpoint_offload"]
