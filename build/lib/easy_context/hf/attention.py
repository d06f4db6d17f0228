"""The attention function registered with transformers' ``AttentionInterface``: one mode's sequence-parallel
attention with its process groups bound, the packed documents read from ``position_ids`` (one all-gather per
forward), and the check that the inputs were cut for the layout the attention runs.

HF passes ``query (B, Hq, S_local, D)``, ``key/value (B, Hkv, S_local, D)`` (kv heads not repeated); the modes take
``(B, S_local, H, D)``.
"""
from __future__ import annotations

import torch

from ..mode import Mode


class _Groups:
    """The attention's process groups: bound now, or (``ring_degree=`` before the process group exists)
    built by ``ParallelLayout`` at the first call, which every rank makes in step (new_group is collective)."""

    def __init__(self, mode: Mode, groups: dict | None, ring_degree: int | None = None):
        self.mode, self._groups, self.ring_degree = mode, groups, ring_degree

    def get(self) -> dict:
        if self._groups is None:
            from ..parallel_layout import ParallelLayout
            self._groups = ParallelLayout.build(self.mode, ring_degree=self.ring_degree).attn_groups()
        return self._groups


def _check_layout(mode: Mode, bound: _Groups, state: dict, position_ids) -> None:
    tag = getattr(position_ids, "_easy_context_layout", None)
    if tag is None:
        return
    if "own" not in state:  # the cut attention will assume, from the sizes of its groups (None = the world)
        state["own"] = mode.own_signature(bound.get())
    own, own_desc = state["own"]
    if tag[0] != own:
        raise ValueError(
            f"the inputs were sharded for {tag[1]} but attention runs {own_desc}: the model would compute "
            "a wrong result. Pass the same mode and ring_degree= to apply_seq_parallel_monkey_patch and "
            "prepare_seq_parallel_inputs (or one ParallelLayout to both: layout=..., layout.prepare_inputs)")


def _one_document(state, batch: int, length: int):
    """Rows that are one document each (no packing), for the sliding-window layers; cached per shape."""
    from .. import packing
    hit = state.get("one_doc")
    if hit is None or hit.doc_ids.shape != (batch, length):
        hit = state["one_doc"] = packing.Documents(torch.zeros(batch, length, dtype=torch.long))
    return hit


def _documents(mode: Mode, groups, state, position_ids, dispatch, require_table: bool):
    """Packed documents from the position ids (restarts at 0), one all-gather per forward: every layer of the
    forward gets the same position tensor and table, so the result is cached on them (weakly, with its version).
    ``dispatch``: the table the model call carries (dispatch.DISPATCH_KWARG), None for the mode's fixed cut."""
    if position_ids is None:
        return None
    import weakref
    from .. import packing
    # inference-mode tensors cannot change in place and carry no version counter
    version = None if position_ids.is_inference() else position_ids._version
    hit = state.get("docs")
    if hit is not None and hit[0]() is position_ids and hit[1] == version and hit[2] is dispatch:
        return hit[3]
    global_pos = packing.gather_positions(mode, position_ids, groups, dispatch, require_table=require_table)
    try:
        docs = packing.documents(global_pos)
        if docs is not None:
            docs.dispatch = dispatch
    except packing.PackedPositionsError as e:
        if dispatch is None and mode.packed_pairs and packing.packed_rows(global_pos):
            raise packing.PackedPositionsError(
                f"{e}. (Packed rows are sharded in the balanced k-pair zigzag layout, decided from the position "
                "ids, or dealt by a dispatch table that the model call must carry: cut every tensor with "
                "prepare_seq_parallel_inputs and pass **prepared.model_kwargs to the model; a plain zigzag shard of "
                "a long packed row looks like jumping positions.)"
            ) from None
        raise
    state["docs"] = (weakref.ref(position_ids), version, dispatch, docs)
    return docs


def make_attention_fn(mode: Mode, ring_degree: int | None = None, require_table: bool = False, **groups):
    """An AttentionInterface function running ``mode`` (a ``Mode``: ``layout.mode``) with the bound process groups
    (``ring_degree=``: usp_attn's groups built from the world on first use). ``require_table``: packed rows must
    come with their dispatch table (a ``ParallelLayout`` that dispatches them)."""
    fn = mode.attention_fn()
    bad = set(groups) - set(mode.group_kwargs)
    if bad:
        raise ValueError(f"{mode.name} takes process groups {mode.group_kwargs}, got {sorted(bad)}")
    bound = _Groups(mode, None if ring_degree is not None else groups, ring_degree)
    state: dict = {}

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  sliding_window=None, **kwargs):
        # query (B, Hq, S, D), key/value (B, Hkv, S, D): kv heads are not repeated (GQA stays on the wire).
        groups = bound.get()
        _check_layout(mode, bound, state, kwargs.get("position_ids"))
        if kwargs.get("softcap") is not None:  # Gemma 2's attn_logit_softcapping: no ring kernel applies it
            raise ValueError(f"{mode.name}: attention logit soft-capping (config.attn_logit_softcapping="
                             f"{kwargs['softcap']}) is not supported by the sequence-parallel kernels; setting it "
                             "to None gives a different model, so this family cannot be trained exactly here")
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(f"{mode.name}: a KV cache is not supported inside sequence-parallel attention; "
                             "call the model with use_cache=False")
        if sliding_window is None:  # Qwen2-MoE (transformers 5.24) keeps its window on the module and windows
            sliding_window = getattr(module, "sliding_window", None)  # through the mask only, never in the call
        from ..dispatch.table import table_of
        docs = _documents(mode, groups, state, kwargs.get("position_ids"), table_of(kwargs, mode), require_table)
        length = query.shape[2] * _sp_size(mode, groups)
        if sliding_window is not None and sliding_window < length:  # a local layer: same blocks, windowed
            docs = _one_document(state, query.shape[0], length) if docs is None else docs
            docs = docs.with_window(sliding_window)
        extra = {"docs": docs} if docs is not None else {}
        if not (query.dtype == key.dtype == value.dtype):  # autocast: RoPE's fp32 cos/sin promote q and k only;
            dt = (torch.get_autocast_dtype(query.device.type)  # SDPA would cast all three to the autocast dtype
                  if torch.is_autocast_enabled(query.device.type) else value.dtype)
            query, key, value = query.to(dt), key.to(dt), value.to(dt)
        out = fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout,
                 softmax_scale=scaling, causal=True, **groups, **extra)
        return out, None

    attention.mode, attention.seq_algo = mode, mode.name  # seq_algo: the name, as before
    return attention


def _sp_size(mode: Mode, groups) -> int:
    """Ranks one sequence is spread over: the product of the bound groups (None alone = the world)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return 1
    given = [groups.get(name) for name in mode.group_kwargs]
    if all(g is None for g in given):
        return dist.get_world_size()
    size = 1
    for g in given:  # None is the world (a layout binds a world-sized group as None: usp with ulysses 1)
        size *= dist.get_world_size() if g is None else dist.get_world_size(g)
    return size


__all__ = ["make_attention_fn"]
