"""DeepSpeed ZeRO-3 around the chain: only the rank running a piece executes the layer, so nothing inside a piece
may be collective. ZeRO-3 gathers a module's partitioned parameters in forward hooks (an all-gather of the
data-parallel group) and prefetches others by its recorded module order: run on one rank alone, either would
wait forever for its peers. So, while the chain runs: the layer's parameters are gathered once, by every rank
together (GatheredParameters, at the chain's start: every rank reaches it at the same layer), and the hooks of the
layer's submodules are set aside (ZeRO-3's are the only ones a training model has there). The gradients leave the
chain as its outputs, so ZeRO-3 reduces them as usual, collectively, outside. Without ZeRO-3: no-op."""
from __future__ import annotations

import contextlib


def _zero3_params(layer) -> list:
    """Partitioned parameters not gathered now (the layer's own ones are, by ZeRO-3's hook on the layer: those
    it also releases itself)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return [p for p in layer.parameters() if getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE]


@contextlib.contextmanager
def gathered(layer):
    zero3 = any(hasattr(p, "ds_id") for p in layer.parameters())
    params = _zero3_params(layer) if zero3 else []
    if not zero3:
        yield
        return
    import deepspeed
    hooks = []
    for m in layer.modules():
        if m is layer:
            continue
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            saved = getattr(m, attr)
            hooks.append((m, attr, saved))
            setattr(m, attr, type(saved)())
    try:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
            yield
    finally:
        for m, attr, saved in hooks:
            setattr(m, attr, saved)
