"""Patching: route a model's (or a family's) attention through a sequence-parallel mode, and the version guard.

Everything goes through transformers' own extension points, never through copied model code:
* an instance: our function is registered in ``AttentionInterface`` as ``easy_context_<mode>`` and the
  model switched to it with ``set_attn_implementation``; a mask function registered for that name in
  ``AttentionMaskInterface`` returns ``None`` (attention here is causal over the *global* sequence; the
  local slice's own mask would be wrong) after refusing padded attention masks.
* a family string (``"llama"``, ...): the family module gets its own ``AttentionInterface`` instance
  whose lookup answers our function for every implementation name (the per-model override the
  AttentionInterface docstring describes), and its mask builders are wrapped the same way. Models of the
  family built before or after the call follow it; ``"data_parallel"`` puts the originals back.

Process groups are bound when patching (``group=`` / ``ring_group=``/``ulysses_group=``, ``ring_degree=`` for
usp_attn, or a ``ParallelLayout``) and travel in the registered closure; nothing is global. Inputs cut by
``prepare_seq_parallel_inputs`` carry the layout they were cut for; attention run with another layout (e.g.
USP inputs sharded for ring 2 x ulysses 2, attention patched as a pure ring) raises instead of computing a
wrong result. Packed rows' dispatch tables reach the attention in the model call's kwargs (dispatch/plan.py).
"""
from __future__ import annotations

import functools
import importlib
import inspect

import torch
import transformers

from ..families import FAMILIES as _FAMILY_TABLE
from ..families import family_of_model_type
from ..mode import Mode
from ..registry import SEQ_ALGOS, get_mode, modes_taking
from .attention import make_attention_fn

FAMILIES = tuple(_FAMILY_TABLE)  # family strings (one record each in families.py)
_ATTN_CLASS = {name: f.attention for name, f in _FAMILY_TABLE.items()}
# The parameters transformers 5 passes to an attention function (modeling_llama.LlamaAttention.forward).
_EXPECTED = ("module", "query", "key", "value", "attention_mask")


def _family_module(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def check_transformers_compat(family: str = "llama") -> None:
    """Fail loudly if the installed transformers no longer calls attention the way we hook it."""
    mod = _family_module(family)
    src = inspect.getsource(getattr(mod, _ATTN_CLASS[family]).forward)
    if "ALL_ATTENTION_FUNCTIONS.get_interface" not in src and "ALL_ATTENTION_FUNCTIONS[" not in src:
        raise RuntimeError(
            f"easy_context cannot hook attention in transformers {transformers.__version__}: "
            f"{_ATTN_CLASS[family]}.forward no longer dispatches through ALL_ATTENTION_FUNCTIONS. "
            "Supported: transformers 5.0 - 5.24.")
    sdpa = importlib.import_module("transformers.integrations.sdpa_attention").sdpa_attention_forward
    params = tuple(inspect.signature(sdpa).parameters)[:5]
    if params != _EXPECTED:
        raise RuntimeError(
            f"easy_context: transformers {transformers.__version__} passes attention arguments {params}, "
            f"expected {_EXPECTED}. Supported: transformers 5.0 - 5.24.")


def _check_mask(attention_mask) -> None:
    if attention_mask is None:
        return
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        if not bool(attention_mask.bool().all()):
            raise ValueError(
                "sequence-parallel attention does not support padding (attention_mask has zeros); "
                "pack samples to the full length or pass no attention_mask")
        return
    raise ValueError("sequence-parallel attention takes only a 2D all-ones attention_mask (or None); "
                     f"got {type(attention_mask).__name__} of shape {getattr(attention_mask, 'shape', None)}")


def _no_mask(mask_fn):
    """Wrap a mask builder: refuse padding, return None (our kernels apply the global causal mask)."""
    @functools.wraps(mask_fn)
    def build(*args, **kwargs):
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        _check_mask(mask)
        return None
    build._easy_context_original = mask_fn
    return build


def _groups_from(mode: Mode, layout, group, ring_group, ulysses_group, ring_degree) -> dict:
    """The attention function's kwargs: bound groups, or ``ring_degree`` for groups built on first use."""
    given = {"group": group, "ring_group": ring_group, "ulysses_group": ulysses_group}
    explicit = [k for k, g in given.items() if g is not None]
    if ring_degree is not None:
        if "ring_degree" not in mode.degree_kwargs:
            raise ValueError(f"ring_degree applies to {' / '.join(modes_taking('ring_degree'))} only "
                             f"(got {mode.name!r} with ring_degree={ring_degree})")
        if isinstance(ring_degree, bool) or not isinstance(ring_degree, int) or ring_degree < 1:
            raise ValueError(f"ring_degree must be a positive int; got {ring_degree!r}")
        if layout is not None and layout.ring != ring_degree:
            raise ValueError(f"ring_degree={ring_degree} disagrees with the layout {layout} (ring {layout.ring}); "
                             "pass one of them")
        if explicit:
            raise ValueError(f"pass either ring_degree= or explicit process groups ({', '.join(explicit)}), not both")
    if layout is not None:
        if explicit:
            raise ValueError(f"pass either layout= or explicit process groups ({', '.join(explicit)}), not both")
        return layout.attn_groups(mode)
    if ring_degree is not None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            from ..parallel_layout import ParallelLayout
            return ParallelLayout.build(mode, ring_degree=ring_degree).attn_groups()
        return {"ring_degree": ring_degree}  # no process group yet: built at the first attention call
    return {k: given[k] for k in mode.group_kwargs}


def apply_seq_parallel_monkey_patch(seq_algo, model, ring_degree: int | None = None, layout=None, *,
                                    group=None, ring_group=None, ulysses_group=None):
    """Route attention of ``model`` (a family string or a PreTrainedModel) through a mode.

        apply_seq_parallel_monkey_patch(model, layout)          # a ParallelLayout: mode, degrees and groups
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", model, ring_degree=None, layout=None)  # string form

    Groups default to the world group. ``usp_attn``: pass the same ``ring_degree=`` as to
    ``prepare_seq_parallel_inputs`` (or a ``ParallelLayout``, or ``ring_group``/``ulysses_group``); inputs
    sharded for another layout raise at the first attention call. Returns the model (instance case) or None.
    """
    from ..parallel_layout import ParallelLayout
    if isinstance(model, (ParallelLayout, Mode)):  # the (model, layout) order
        seq_algo, model = model, seq_algo
    if isinstance(seq_algo, ParallelLayout):
        if layout is not None and layout is not seq_algo:
            raise ValueError("pass one ParallelLayout, not two")
        layout = seq_algo
    mode = layout.mode if isinstance(seq_algo, ParallelLayout) else get_mode(seq_algo)  # validates a name
    groups = _groups_from(mode, layout, group, ring_group, ulysses_group, ring_degree)
    # a layout deals packed rows by a table (ParallelLayout.prepare_inputs): a model call without it is refused
    require = bool(layout is not None and layout.packed_dispatch and mode.dispatches)
    if isinstance(model, str):
        family = model.lower()
        if family not in FAMILIES:
            raise ValueError(f"unknown model family {model!r}; valid families: {', '.join(FAMILIES)} "
                             "(or pass a transformers PreTrainedModel instance)")
        _patch_family(mode, family, groups, require)
        return None
    if isinstance(model, transformers.PreTrainedModel):
        from ..vlm.patch import is_vlm, patch_vlm
        if is_vlm(model):  # the language model only; the vision tower stays whole (vlm/patch.py)
            return patch_vlm(mode, model, groups, require, _patch_instance)
        return _patch_instance(mode, model, groups, require)
    raise ValueError(f"model must be a family string ({', '.join(FAMILIES)}) or a transformers "
                     f"PreTrainedModel; got {type(model).__name__}")


def _patch_family(mode: Mode, family, groups, require: bool = False):
    from ..recurrent.patch import refuse_family
    refuse_family(mode, _FAMILY_TABLE[family])  # hybrids are patched per instance (issue #30)
    check_transformers_compat(family)
    mod = _family_module(family)
    from transformers.modeling_utils import AttentionInterface

    base = getattr(mod, "_easy_context_original_interface", None)
    if base is None:
        mod._easy_context_original_interface = base = mod.ALL_ATTENTION_FUNCTIONS
        mod._easy_context_original_masks = {n: getattr(mod, n) for n in
                                            ("create_causal_mask", "create_sliding_window_causal_mask")
                                            if hasattr(mod, n)}
    if not mode.is_parallel:  # plain attention back
        mod.ALL_ATTENTION_FUNCTIONS = base
        for n, f in mod._easy_context_original_masks.items():
            setattr(mod, n, f)
        return
    fn = make_attention_fn(mode, require_table=require, **groups)

    class _FamilyInterface(AttentionInterface):
        def get_interface(self, attn_implementation, default):
            return fn

    mod.ALL_ATTENTION_FUNCTIONS = _FamilyInterface()
    for n, f in mod._easy_context_original_masks.items():
        setattr(mod, n, _no_mask(f))


def _patch_instance(mode: Mode, model, groups, require: bool = False):
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from ..recurrent.patch import apply as patch_recurrent_layers
    if mode.is_parallel:  # every attention layer through the AttentionInterface, every recurrent one adapted
        from .contract import check_layers
        from .route import check_routable
        check_routable(model, mode)
        check_layers(model, mode.name)  # layer types and config features the kernels do not implement
    patch_recurrent_layers(mode, model, groups, require)  # refuses layers it cannot run exactly (issue #30)
    family = getattr(model.config, "model_type", None)
    family = family_of_model_type(family)
    if family in FAMILIES:
        check_transformers_compat(family)
    from ..layer_positions import apply as pass_positions  # packed documents need them (granitemoehybrid, Llama 4)
    call = pass_positions(mode, model, family)
    if not mode.is_parallel:  # plain attention back
        prev = getattr(model, "_easy_context_prev_attn", None)
        if prev is not None:
            model.set_attn_implementation(prev)
        return model
    # one name per model instance: two models may be bound to different groups
    # transformers treats any implementation name containing "flash" as flash-attn (and tries to load
    # it), so a mode named "..._flash_..." is registered as "easy_context_..._fa_..._<id>"
    name = f"easy_context_{mode.name.replace('flash', 'fa')}_{id(model):x}"
    AttentionInterface.register(name, make_attention_fn(mode, require_table=require, call=call, **groups))

    def mask_fn(*args, **kwargs):
        _check_mask(kwargs.get("attention_mask"))
        return None
    AttentionMaskInterface.register(name, mask_fn)
    if not hasattr(model, "_easy_context_prev_attn"):
        model._easy_context_prev_attn = model.config._attn_implementation
    model.set_attn_implementation(name)
    return model


__all__ = ["apply_seq_parallel_monkey_patch", "check_transformers_compat", "FAMILIES", "SEQ_ALGOS"]
