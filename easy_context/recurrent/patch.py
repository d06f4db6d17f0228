"""Hook called by apply_seq_parallel_monkey_patch for a model instance: refuse unsupported recurrent layers and
route the supported ones through the sequence-parallel chain; ``data_parallel`` puts everything back.

Per model instance (nothing global): a forward pre-hook on the model's base model records the position ids of
the current call (recurrent layers are not given them by the decoder layers); each recurrent layer gets an
instance ``forward`` that builds (once per position tensor) the plan of pieces and runs the chain."""
from __future__ import annotations

import weakref


from .adapter import get_adapter
from .chain import run_layer
from .detect import check_supported
from .pieces import build_plan
from ..registry import get_mode

_ATTR = "_easy_context_recurrent"


class _Context:
    """One patched model's state: mode, groups, the current call's position ids and its cached plan."""

    def __init__(self, mode, groups, require_table: bool = False):
        self.mode, self._groups, self.require_table = mode, groups, require_table
        self.position_ids = None
        self.dispatch = None  # the packed rows' table the current call carries (dispatch.DISPATCH_KWARG)
        self._plan = None  # (weakref to position ids, version, batch, length, Plan)
        self.hook = None
        self.layers: list = []
        self.infer = None  # SeqParallelLM's decode handle (inference.py), None in training
        self.tiles = 1  # configure_memory(recurrent_tiles=): the layer's sequence in tiles on one process

    def __deepcopy__(self, memo):
        # copy.deepcopy(patched model) (TRL's reference model, an EMA copy): the copy's context routes the copy's
        # layers; process groups and the user's decode handle are shared, the call state starts empty
        import copy
        new = memo[id(self)] = _Context(self.mode, self._groups, self.require_table)
        new.tiles, new.layers, new.hook = self.tiles, copy.deepcopy(self.layers, memo), copy.deepcopy(self.hook, memo)
        return new

    def groups(self) -> dict:
        if "ring_degree" in self._groups:  # no process group at patch time: built now, collectively
            from ..parallel_layout import ParallelLayout
            self._groups = ParallelLayout.build(self.mode, ring_degree=self._groups["ring_degree"]).attn_groups()
        return self._groups

    def plan(self, batch, length):
        pos = self.position_ids
        version = None if pos is None or pos.is_inference() else pos._version
        hit = self._plan
        if hit is not None and hit[0]() is pos and hit[1:4] == (version, batch, length) and pos is not None \
                and hit[4] is self.dispatch:
            return hit[5]
        plan = build_plan(self.mode, self.groups(), pos, batch, length, self.dispatch, self.require_table)
        self._plan = (weakref.ref(pos) if pos is not None else (lambda: None), version, batch, length,
                      self.dispatch, plan)
        return plan


class _RecordPositions:
    """The base model's forward pre-hook: the current call's position ids (and dispatch table) into ``ctx``. An
    object, not a closure, so that a deep copy of the model records into the copy's context."""

    def __init__(self, ctx):
        self.ctx = ctx

    def __call__(self, module, args, kwargs):
        from ..dispatch.table import table_of
        pos = kwargs.get("position_ids")  # a VLM's text model gets (4, B, L): documents on row 0 (vlm/positions.py)
        self.ctx.position_ids = pos[0] if pos is not None and pos.dim() == 3 else pos
        self.ctx.dispatch = table_of(kwargs, self.ctx.mode)


class _RoutedForward:
    """A patched recurrent layer's instance ``forward``: the layer through the chain. An object holding its layer
    and context (a closure would survive copy.deepcopy still bound to the original layer: the copy would train
    the original's parameters)."""

    def __init__(self, ctx, layer, adapter):
        self.ctx, self.layer, self.adapter = ctx, layer, adapter

    def __deepcopy__(self, memo):
        import copy
        return _RoutedForward(copy.deepcopy(self.ctx, memo), copy.deepcopy(self.layer, memo), self.adapter)

    def __call__(self, hidden_states, *args, cache=None, attention_mask=None, **kwargs):
        ctx, layer = self.ctx, self.layer
        has_cache = cache is not None or any(kwargs.get(k) is not None for k in ("past_key_values", "cache_params"))
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        if (has_cache or padded) and not ctx.mode.is_parallel:  # one process, generation: the layer as it is
            return type(layer).forward(layer, hidden_states, *args, cache=cache, attention_mask=attention_mask, **kwargs)
        if has_cache:
            raise ValueError(f"{ctx.mode.name}: a cache is not supported in the sequence-parallel recurrent layers; "
                             "call the model with use_cache=False")
        if padded:
            raise ValueError(f"{ctx.mode.name}: padding (attention_mask with zeros) is not supported in the "
                             "sequence-parallel recurrent layers; pack documents and mark them with position_ids")
        if ctx.infer is not None:  # SeqParallelLM: forward / prefill / decode (inference.py)
            return ctx.infer.run(ctx, layer, hidden_states)
        plan = ctx.plan(hidden_states.shape[0], hidden_states.shape[1])
        return run_layer(plan, self.adapter, layer, hidden_states, ctx.tiles)


def _unpatch(model) -> None:
    ctx = getattr(model, _ATTR, None)
    if ctx is None:
        return
    if ctx.hook is not None:
        ctx.hook.remove()
    for layer in ctx.layers:
        layer.__dict__.pop("forward", None)
    delattr(model, _ATTR)


def apply(mode, model, groups: dict, require_table: bool = False) -> None:
    """Patch ``model``'s recurrent layers for ``mode`` (a Mode; a name from a user is resolved here, once). ``data_parallel``: the supported layers still honour
    document restarts in position_ids (one process, one piece; identical to the plain layer on unpacked rows and
    with a cache); unsupported ones stay plain (nothing is cut)."""
    _unpatch(model)
    mode = get_mode(mode)
    if not mode.is_parallel:
        from .detect import recurrent_layers
        layers = [(n, m) for n, m in recurrent_layers(model) if get_adapter(m) is not None]
    else:
        layers = check_supported(mode, model)
    if not layers:
        return
    ctx = _Context(mode, dict(groups), require_table)
    base = getattr(model, "base_model", model)
    ctx.hook = base.register_forward_pre_hook(_RecordPositions(ctx), with_kwargs=True)
    for _, layer in layers:
        layer.forward = _RoutedForward(ctx, layer, get_adapter(layer))
        ctx.layers.append(layer)
    setattr(model, _ATTR, ctx)


def set_tiles(model, tiles: int) -> None:
    """configure_memory's recurrent_tiles: the patched recurrent layers of ``model`` run in that many tiles."""
    ctx = getattr(model, _ATTR, None)
    if ctx is None and tiles > 1:
        raise ValueError("recurrent_tiles needs recurrent layers routed by the patch: a hybrid model (gated DeltaNet, "
                         "short conv, Mamba-2 layers) after apply_seq_parallel_monkey_patch(mode, model), any mode")
    if ctx is not None:
        ctx.tiles = tiles


def tiles_reach(model) -> bool:
    """Would recurrent tiles reach ``model``'s recurrent layers: patched, and no sequence-parallel group of several
    ranks (there every rank runs its own pieces at once, the tiles unused: chain.run_layer)?"""
    import torch.distributed as dist
    ctx = getattr(model, _ATTR, None)
    return ctx is not None and not (ctx.mode.is_parallel and dist.is_initialized() and dist.get_world_size() > 1)


def refuse_family(mode, family) -> None:
    """A family-string patch cannot reach the recurrent layers (they are wrapped per instance): refuse it."""
    if family.recurrent and mode.is_parallel:
        raise ValueError(f"{family.name} has recurrent layers ({', '.join(family.recurrent)}) that are patched per "
                         f"model: pass the model instance, apply_seq_parallel_monkey_patch({mode.name!r}, model)")


__all__ = ["apply", "refuse_family", "set_tiles", "tiles_reach"]
