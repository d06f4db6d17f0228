"""Hand the model's position ids to decoder layers whose model forward drops them (granitemoehybrid).

Packed documents reach the sequence-parallel attention through ``position_ids`` in the attention call's kwargs
(the DESIGN contract: positions restarting at 0 mark documents). ``GraniteMoeHybridModel.forward`` uses them
only for RoPE and calls its decoder layers without them, so the attention would see one document per row: wrong
under packing in every mode. For such a family (``LAYER_CLASSES`` names its decoder layer class) a
pre-hook on the base model keeps the call's position ids and a pre-hook on each decoder layer passes them on
in its kwargs, which the layer forwards to the attention (and the mixer). Per model instance; ``data_parallel``
removes the hooks.

Every other model gets the same pair of hooks on its attention layers (``hf.route.attention_layers``) that take
``**kwargs``: a decoder layer that drops the position ids (Llama 4's) would otherwise hand its attention none, and
packed rows would silently be one document. A call that already carries them is left as it is.
"""
from __future__ import annotations

import inspect

_ATTR = "_easy_context_layer_positions"
# family -> its decoder layer class, called by the model without position_ids
LAYER_CLASSES = {"granitemoehybrid": "GraniteMoeHybridDecoderLayer"}
KEYS = ("position_ids", "sp_dispatch")  # the positions and the packed rows' table (dispatch.DISPATCH_KWARG)


def apply(mode, model, family: str | None, attention_modules=()) -> None:
    """``attention_modules``: the model's attention layers (hf/route.attention_layers, found by the caller)."""
    for handle in getattr(model, _ATTR, ()):
        handle.remove()
    if hasattr(model, _ATTR):
        delattr(model, _ATTR)
    layer_class = LAYER_CLASSES.get(family)
    if not mode.is_parallel:
        return
    targets = [m for m in model.modules() if type(m).__name__ == layer_class]
    targets += [m for m in attention_modules if _takes_kwargs(m)]
    seen: dict = {}

    def record(module, args, kwargs):
        for key in KEYS:
            seen[key] = kwargs.get(key)

    def inject(module, args, kwargs):
        for key in KEYS:
            if kwargs.get(key) is None and seen.get(key) is not None:
                kwargs[key] = seen[key]
        return args, kwargs

    base = getattr(model, "base_model", model)
    handles = [base.register_forward_pre_hook(record, with_kwargs=True)]
    handles += [m.register_forward_pre_hook(inject, with_kwargs=True) for m in targets]
    setattr(model, _ATTR, handles)


def _takes_kwargs(module) -> bool:
    """The forward passes unnamed kwargs on (to the attention interface) and names none of ``KEYS`` itself."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            and not any(k in params for k in KEYS))


__all__ = ["apply"]
