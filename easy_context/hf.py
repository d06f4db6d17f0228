"""Hugging Face integration: route a model's attention through a sequence-parallel mode.

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
wrong result.
"""
from __future__ import annotations

import functools
import importlib
import inspect

import torch
import transformers

from .families import FAMILIES as _FAMILY_TABLE
from .families import family_of_model_type
from .registry import SEQ_ALGOS, get_algo

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


class _Groups:
    """The attention's process groups: bound now, or (``ring_degree=`` before the process group exists)
    built by ``ParallelLayout`` at the first call, which every rank makes in step (new_group is collective)."""

    def __init__(self, seq_algo, groups: dict | None, ring_degree: int | None = None):
        self.seq_algo, self._groups, self.ring_degree = seq_algo, groups, ring_degree

    def get(self) -> dict:
        if self._groups is None:
            from .parallel_layout import ParallelLayout
            self._groups = ParallelLayout.build(self.seq_algo, ring_degree=self.ring_degree).attn_groups()
        return self._groups


def _own_signature(seq_algo, groups: dict) -> tuple:
    """The layout attention will assume, from the sizes of its groups (None = the world)."""
    from .api import layout_signature
    import torch.distributed as dist
    live = dist.is_available() and dist.is_initialized()
    size = (lambda g: dist.get_world_size(g) if live else 1)
    if seq_algo == "usp_attn":
        from .usp.attention import resolve_groups  # usp's own reading of None groups
        _, r, u, _ = resolve_groups(groups.get("ring_group"), groups.get("ulysses_group")) if live else (0, 1, 1, 0)
        return layout_signature(seq_algo, r * u, ring_degree=r), f"{seq_algo} with ring {r} x ulysses {u}"
    w = size(groups.get("group")) if get_algo(seq_algo).group_kwargs else 1
    return layout_signature(seq_algo, w), f"{seq_algo} on {w} sp ranks"


def _check_layout(seq_algo, bound: _Groups, state: dict, position_ids) -> None:
    tag = getattr(position_ids, "_easy_context_layout", None)
    if tag is None:
        return
    if "own" not in state:
        state["own"] = _own_signature(seq_algo, bound.get())
    own, own_desc = state["own"]
    if tag[0] != own:
        raise ValueError(
            f"the inputs were sharded for {tag[1]} but attention runs {own_desc}: the model would compute "
            "a wrong result. Pass the same mode and ring_degree= to apply_seq_parallel_monkey_patch and "
            "prepare_seq_parallel_inputs (or one ParallelLayout to both: layout=..., layout.prepare_inputs)")


def _one_document(state, batch: int, length: int):
    """Rows that are one document each (no packing), for the sliding-window layers; cached per shape."""
    from . import packing
    hit = state.get("one_doc")
    if hit is None or hit.doc_ids.shape != (batch, length):
        hit = state["one_doc"] = packing.Documents(torch.zeros(batch, length, dtype=torch.long))
    return hit


def _documents(seq_algo, groups, state, position_ids):
    """Packed documents from the position ids (restarts at 0), one all-gather per forward: every layer of
    the forward gets the same position tensor, so the result is cached on it (weakly, with its version)."""
    if position_ids is None:
        return None
    import weakref
    from . import packing
    # inference-mode tensors cannot change in place and carry no version counter
    version = None if position_ids.is_inference() else position_ids._version
    hit = state.get("docs")
    if hit is not None and hit[0]() is position_ids and hit[1] == version:
        return hit[2]
    global_pos = packing.gather_positions(seq_algo, position_ids, groups)
    try:
        docs = packing.documents(global_pos)
    except packing.PackedPositionsError as e:
        if seq_algo in ("zigzag_ring_attn", "usp_attn") and packing.packed_rows(global_pos):
            raise packing.PackedPositionsError(
                f"{e}. (Packed rows are sharded in the balanced k-pair zigzag layout, decided from the position "
                "ids: cut every tensor with prepare_seq_parallel_inputs, or shard_sequence(..., positions="
                "global_position_ids); a plain zigzag shard of a long packed row looks like jumping positions.)"
            ) from None
        raise
    state["docs"] = (weakref.ref(position_ids), version, docs)
    return docs


def make_attention_fn(seq_algo: str, ring_degree: int | None = None, **groups):
    """An AttentionInterface function running ``seq_algo`` with the bound process groups
    (``ring_degree=``: usp_attn's groups built from the world on first use)."""
    algo = get_algo(seq_algo)
    fn = algo.attention_fn()
    bad = set(groups) - set(algo.group_kwargs)
    if bad:
        raise ValueError(f"{seq_algo} takes process groups {algo.group_kwargs}, got {sorted(bad)}")
    bound = _Groups(seq_algo, None if ring_degree is not None else groups, ring_degree)
    state: dict = {}

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  sliding_window=None, **kwargs):
        # query (B, Hq, S, D), key/value (B, Hkv, S, D): kv heads are not repeated (GQA stays on the wire).
        groups = bound.get()
        _check_layout(seq_algo, bound, state, kwargs.get("position_ids"))
        if kwargs.get("softcap") is not None:  # Gemma 2's attn_logit_softcapping: no ring kernel applies it
            raise ValueError(f"{seq_algo}: attention logit soft-capping (config.attn_logit_softcapping="
                             f"{kwargs['softcap']}) is not supported by the sequence-parallel kernels; setting it "
                             "to None gives a different model, so this family cannot be trained exactly here")
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(f"{seq_algo}: a KV cache is not supported inside sequence-parallel attention; "
                             "call the model with use_cache=False")
        docs = _documents(seq_algo, groups, state, kwargs.get("position_ids"))
        length = query.shape[2] * _sp_size(algo, groups)
        if sliding_window is not None and sliding_window < length:  # a local layer: same blocks, windowed
            docs = _one_document(state, query.shape[0], length) if docs is None else docs
            docs = docs.with_window(sliding_window)
        extra = {"docs": docs} if docs is not None else {}
        out = fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout,
                 softmax_scale=scaling, causal=True, **groups, **extra)
        return out, None

    attention.seq_algo = seq_algo
    return attention


def _sp_size(algo, groups) -> int:
    """Ranks one sequence is spread over: the product of the bound groups (None alone = the world)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return 1
    given = [groups.get(name) for name in algo.group_kwargs]
    if all(g is None for g in given):
        return dist.get_world_size()
    size = 1
    for g in given:
        if g is not None:
            size *= dist.get_world_size(g)
    return size


def _no_mask(mask_fn):
    """Wrap a mask builder: refuse padding, return None (our kernels apply the global causal mask)."""
    @functools.wraps(mask_fn)
    def build(*args, **kwargs):
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        _check_mask(mask)
        return None
    build._easy_context_original = mask_fn
    return build


def _groups_from(seq_algo, layout, group, ring_group, ulysses_group, ring_degree) -> dict:
    """The attention function's kwargs: bound groups, or ``ring_degree`` for groups built on first use."""
    algo = get_algo(seq_algo)
    given = {"group": group, "ring_group": ring_group, "ulysses_group": ulysses_group}
    explicit = [k for k, g in given.items() if g is not None]
    if ring_degree is not None:
        if seq_algo != "usp_attn":
            raise ValueError(f"ring_degree applies to usp_attn only (got {seq_algo!r} with ring_degree={ring_degree})")
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
        return layout.attn_groups(seq_algo)
    if ring_degree is not None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            from .parallel_layout import ParallelLayout
            return ParallelLayout.build(seq_algo, ring_degree=ring_degree).attn_groups()
        return {"ring_degree": ring_degree}  # no process group yet: built at the first attention call
    return {k: given[k] for k in algo.group_kwargs}


def apply_seq_parallel_monkey_patch(seq_algo: str, model, ring_degree: int | None = None, layout=None, *,
                                    group=None, ring_group=None, ulysses_group=None):
    """Route attention of ``model`` (a family string or a PreTrainedModel) through ``seq_algo``.

    Groups default to the world group. ``usp_attn``: pass the same ``ring_degree=`` as to
    ``prepare_seq_parallel_inputs`` (or a ``ParallelLayout``, or ``ring_group``/``ulysses_group``); inputs
    sharded for another layout raise at the first attention call. Returns the model (instance case) or None.
    """
    get_algo(seq_algo)  # validates the name
    groups = _groups_from(seq_algo, layout, group, ring_group, ulysses_group, ring_degree)
    if isinstance(model, str):
        family = model.lower()
        if family not in FAMILIES:
            raise ValueError(f"unknown model family {model!r}; valid families: {', '.join(FAMILIES)} "
                             "(or pass a transformers PreTrainedModel instance)")
        _patch_family(seq_algo, family, groups)
        return None
    if isinstance(model, transformers.PreTrainedModel):
        return _patch_instance(seq_algo, model, groups)
    raise ValueError(f"model must be a family string ({', '.join(FAMILIES)}) or a transformers "
                     f"PreTrainedModel; got {type(model).__name__}")


def _patch_family(seq_algo, family, groups):
    from .recurrent.patch import refuse_family
    refuse_family(seq_algo, _FAMILY_TABLE[family])  # hybrids are patched per instance (issue #30)
    check_transformers_compat(family)
    mod = _family_module(family)
    from transformers.modeling_utils import AttentionInterface

    base = getattr(mod, "_easy_context_original_interface", None)
    if base is None:
        mod._easy_context_original_interface = base = mod.ALL_ATTENTION_FUNCTIONS
        mod._easy_context_original_masks = {n: getattr(mod, n) for n in
                                            ("create_causal_mask", "create_sliding_window_causal_mask")
                                            if hasattr(mod, n)}
    if seq_algo == "data_parallel":
        mod.ALL_ATTENTION_FUNCTIONS = base
        for n, f in mod._easy_context_original_masks.items():
            setattr(mod, n, f)
        return
    fn = make_attention_fn(seq_algo, **groups)

    class _FamilyInterface(AttentionInterface):
        def get_interface(self, attn_implementation, default):
            return fn

    mod.ALL_ATTENTION_FUNCTIONS = _FamilyInterface()
    for n, f in mod._easy_context_original_masks.items():
        setattr(mod, n, _no_mask(f))


def _patch_instance(seq_algo, model, groups):
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from .recurrent.patch import apply as patch_recurrent_layers
    patch_recurrent_layers(seq_algo, model, groups)  # refuses layers it cannot run exactly (issue #30)
    family = getattr(model.config, "model_type", None)
    family = family_of_model_type(family)
    if family in FAMILIES:
        check_transformers_compat(family)
        from .layer_positions import apply as pass_positions  # packed documents need them (granitemoehybrid)
        pass_positions(seq_algo, model, family)
    if seq_algo == "data_parallel":
        prev = getattr(model, "_easy_context_prev_attn", None)
        if prev is not None:
            model.set_attn_implementation(prev)
        return model
    # one name per model instance: two models may be bound to different groups
    # transformers treats any implementation name containing "flash" as flash-attn (and tries to load
    # it), so "dist_flash_attn" is registered as "easy_context_dist_fa_attn_<id>"
    name = f"easy_context_{seq_algo.replace('flash', 'fa')}_{id(model):x}"
    AttentionInterface.register(name, make_attention_fn(seq_algo, **groups))

    def mask_fn(*args, **kwargs):
        _check_mask(kwargs.get("attention_mask"))
        return None
    AttentionMaskInterface.register(name, mask_fn)
    if not hasattr(model, "_easy_context_prev_attn"):
        model._easy_context_prev_attn = model.config._attn_implementation
    model.set_attn_implementation(name)
    return model


__all__ = ["apply_seq_parallel_monkey_patch", "make_attention_fn", "check_transformers_compat", "FAMILIES",
           "SEQ_ALGOS"]
