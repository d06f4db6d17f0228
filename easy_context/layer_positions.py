"""Hand the model's position ids to decoder layers whose model forward drops them (granitemoehybrid).

Packed documents reach the sequence-parallel attention through ``position_ids`` in the attention call's kwargs
(the DESIGN contract: positions restarting at 0 mark documents). ``GraniteMoeHybridModel.forward`` uses them
only for RoPE and calls its decoder layers without them, so the attention would see one document per row: wrong
under packing in every mode. For such a family (``LAYER_CLASSES`` names its decoder layer class) a
pre-hook on the base model keeps the call's position ids and a pre-hook on each decoder layer passes them on
in its kwargs, which the layer forwards to the attention (and the mixer). Per model instance; ``data_parallel``
removes the hooks.

Every model gets the recording hook: what the model call carried is the attention's fallback where a layer hands it
no positions or no table (``apply``'s return value), else packed rows would silently be one document.
"""
from __future__ import annotations

_ATTR = "_easy_context_layer_positions"
# family -> its decoder layer class, called by the model without position_ids
LAYER_CLASSES = {"granitemoehybrid": "GraniteMoeHybridDecoderLayer"}
KEYS = ("position_ids", "sp_dispatch")  # the positions and the packed rows' table (dispatch.DISPATCH_KWARG)


def apply(mode, model, family: str | None) -> dict:
    """Install the hooks (removing earlier ones); returns the dict the base model's pre-hook fills with the model
    call's ``KEYS`` (empty without sequence parallelism): the patched attention's fallback (hf/attention.py) for
    layers that never hand it the positions (Llama 4's decoder drops them, Persimmon's attention keeps them, StableLM
    calls its attention without the table)."""
    for handle in getattr(model, _ATTR, ()):
        handle.remove()
    if hasattr(model, _ATTR):
        delattr(model, _ATTR)
    seen: dict = {}
    if not mode.is_parallel:
        return seen
    layer_class = LAYER_CLASSES.get(family)

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
    handles += [m.register_forward_pre_hook(inject, with_kwargs=True) for m in model.modules()
                if type(m).__name__ == layer_class]
    setattr(model, _ATTR, handles)
    return seen


__all__ = ["apply"]
