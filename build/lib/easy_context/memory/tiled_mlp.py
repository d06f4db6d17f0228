"""Tiled MLP: the sequence goes through each decoder MLP in tiles, forward and backward.

A Llama-7B MLP keeps ~88 KB/token of intermediates (gate, up, act, product at 11008 wide) for its backward;
that is the largest piece of one layer's working set. Here forward runs tile by tile without autograd and
keeps only the MLP input; backward recomputes one tile at a time, so only one tile's intermediates are alive.
The idea is DeepSpeed ALST's TiledMLP (arXiv 2506.13996); written here as our own autograd.Function.

The tiling is attached by swapping the MLP instance's class for a dynamic subclass (``Tiled<Cls>``) whose
forward tiles and calls the original forward per tile: parameter names (state_dict / checkpoints),
``isinstance`` and module hooks stay exactly as they were, and no model code is copied.

Gradients of the MLP parameters are summed over tiles in fp32 and returned once through the normal
autograd path (one AccumulateGrad per parameter per step: DDP-friendly, no bf16 accumulation across tiles).
Under DeepSpeed ZeRO-3 (parameters carry ``ds_id`` and are only whole inside submodule calls) we follow
ALST instead: each tile's recompute + backward accumulates into ``.grad`` with ``ds_grad_is_ready`` false
until the last tile, so ZeRO reduces the gradient once.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _bounds(n: int, tiles: int):
    step = math.ceil(n / tiles)
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _run_tiles(fn, x, bounds):
    """``fn`` over the tiles of x without autograd, written into one output (no list of tiles + cat copy)."""
    out = None
    with torch.no_grad():
        for s, e in bounds:
            y = fn(x.narrow(-2, s, e - s).contiguous())  # batch > 1: a tile is strided (MoE blocks .view it)
            if out is None:
                out = y.new_empty((*x.shape[:-2], x.shape[-2], y.shape[-1]))
            out.narrow(-2, s, e - s).copy_(y)
            del y
    return out


class TiledMLPFunction(torch.autograd.Function):
    """apply(fn, num_tiles, zero3_params, x, *params): ``fn`` is a token-wise map over dim -2 of x.

    ``params`` (plain path) are the MLP parameters whose summed gradients we return; ``zero3_params`` (a
    tuple, not autograd inputs) are ZeRO-3 parameters that get their gradients by accumulation instead.
    """

    @staticmethod
    def forward(ctx, fn, num_tiles, zero3_params, x, *params):
        bounds = _bounds(x.shape[-2], num_tiles)
        out = _run_tiles(fn, x, bounds)
        ctx.fn, ctx.bounds, ctx.zero3_params, ctx.params = fn, bounds, zero3_params, params
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        dx = torch.empty_like(x) if need_x else None
        plist = [p for i, p in enumerate(ctx.params) if ctx.needs_input_grad[4 + i]]
        acc = [None] * len(plist)
        last = len(ctx.bounds) - 1
        for i, (s, e) in enumerate(ctx.bounds):
            xt = x.narrow(-2, s, e - s).contiguous().detach().requires_grad_(need_x)
            gt = grad_out.narrow(-2, s, e - s)
            with torch.enable_grad():
                out = ctx.fn(xt)
            if ctx.zero3_params:
                # ALST's scheme: ZeRO reduces the accumulated .grad only after the last tile
                for p in ctx.zero3_params:
                    p.ds_grad_is_ready = i == last
                torch.autograd.backward(out, gt)
                if need_x:
                    dx.narrow(-2, s, e - s).copy_(xt.grad)
                continue
            inputs = ([xt] if need_x else []) + plist
            if not inputs:
                continue
            grads = torch.autograd.grad(out, inputs, gt, allow_unused=True)
            if need_x:
                dx.narrow(-2, s, e - s).copy_(grads[0])
                grads = grads[1:]
            for k, g in enumerate(grads):
                if g is not None:
                    acc[k] = g.float() if acc[k] is None else acc[k].add_(g)
        it = iter(acc)
        pgrads = []
        for i, p in enumerate(ctx.params):
            a = next(it) if ctx.needs_input_grad[4 + i] else None
            pgrads.append(None if a is None else a.to(p.dtype))
        return (None, None, None, dx, *pgrads)


class TiledMixin:
    """Mixed in front of an MLP class: forward in ``num_tiles`` tiles along the sequence (dim -2)."""

    num_tiles: int | str = "auto"

    def tiles_for(self, x) -> int:
        n = x.shape[-2]
        if self.num_tiles == "auto":
            # ALST's choice: tiles of about hidden_size tokens (intermediates ~ a hidden-sized square)
            return max(1, math.ceil(n / x.shape[-1]))
        return max(1, min(int(self.num_tiles), n))

    def forward(self, x):
        base_forward = super().forward
        tiles = self.tiles_for(x)
        if tiles <= 1:
            return base_forward(x)
        if not torch.is_grad_enabled():  # a checkpointed layer's forward / rebuild: tiles keep its peak low too
            return _run_tiles(base_forward, x, _bounds(x.shape[-2], tiles))
        params = tuple(p for p in self.parameters() if p.requires_grad)
        if any(hasattr(p, "ds_id") for p in params):
            # ZeRO-3: parameters are partitioned outside submodule calls, so they are not Function inputs
            return TiledMLPFunction.apply(base_forward, tiles, params, x)
        return TiledMLPFunction.apply(base_forward, tiles, (), x, *params)


_CLASSES: dict[type, type] = {}


def _tiled_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Tiled{cls.__name__}", (TiledMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def tile_mlp(mlp: nn.Module, num_tiles: int | str = "auto") -> nn.Module:
    """Make ``mlp`` (any token-wise module ``(..., S, d) -> (..., S, d)``) run in tiles. Idempotent."""
    if num_tiles != "auto" and (not isinstance(num_tiles, int) or num_tiles < 1):
        raise ValueError(f"num_tiles must be a positive int or 'auto', got {num_tiles!r}")
    if not isinstance(mlp, TiledMixin):
        mlp.__class__ = _tiled_class(type(mlp))
    mlp.num_tiles = num_tiles
    return mlp


def untile_mlp(mlp: nn.Module) -> nn.Module:
    if isinstance(mlp, TiledMixin):
        mlp.__class__ = next(c for c in type(mlp).__mro__[1:] if not issubclass(c, TiledMixin))
        mlp.__dict__.pop("num_tiles", None)
    return mlp


def _decoder_layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply_tiled_mlp(model: nn.Module, num_tiles: int | str = "auto") -> int:
    """Tile the ``mlp`` of every decoder layer of a transformers model; returns how many were tiled."""
    n = 0
    for layer in _decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None:
            tile_mlp(mlp, num_tiles)
            n += 1
    if n == 0:
        raise ValueError(f"no decoder layer with an .mlp found in {type(model).__name__}")
    return n


__all__ = ["TiledMLPFunction", "tile_mlp", "untile_mlp", "apply_tiled_mlp"]
