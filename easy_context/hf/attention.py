"""The attention function registered with transformers' ``AttentionInterface``: one mode's sequence-parallel
attention with its process groups bound, the packed documents read from ``position_ids`` (one all-gather per
forward), and the check that the inputs were cut for the layout the attention runs.

HF passes ``query (B, Hq, S_local, D)``, ``key/value (B, Hkv, S_local, D)`` (kv heads not repeated); the modes take
``(B, S_local, H, D)``.
"""
from __future__ import annotations

import torch

from ..mode import Mode
from .contract import AttentionContractError, check_call, layer_mask, where

_UNSET = object()  # the call did not name sliding_window (as opposed to passing None: a global layer)


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


def make_attention_fn(mode: Mode, ring_degree: int | None = None, require_table: bool = False, call=None,
                      **groups):
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
                  sliding_window=_UNSET, **kwargs):
        # query (B, Hq, S, D), key/value (B, Hkv, S, D): kv heads are not repeated (GQA stays on the wire).
        from ..dispatch.table import DISPATCH_KWARG, table_of
        check_call(mode.name, module, attention_mask, kwargs, allowed=(DISPATCH_KWARG,))
        window, chunk = layer_mask(mode.name, module, None if sliding_window is _UNSET else sliding_window,
                                   passed=sliding_window is not _UNSET)
        groups = bound.get()
        pos, table = kwargs.get("position_ids"), table_of(kwargs, mode)
        if call:  # what the model call carried (layer_positions), for layers that do not hand it on
            pos = pos if pos is not None else _same_rows(call.get("position_ids"), query)
            table = table if table is not None else table_of({DISPATCH_KWARG: call.get(DISPATCH_KWARG)}, mode)
        _check_layout(mode, bound, state, pos)
        # inputs that prepare_seq_parallel_inputs cut without a table (its plain form: the mode's fixed cut, rebuilt
        # from the positions) need none, also under a layout that dispatches the ones its own prepare_inputs cuts
        fixed = getattr(pos, "_easy_context_layout", (None, None, True))[2:] == (False,)
        docs = _documents(mode, groups, state, pos, table, require_table and not fixed)
        length = query.shape[2] * _sp_size(mode, groups)
        if (window is not None and window < length) or (chunk is not None and chunk < length):
            docs = _one_document(state, query.shape[0], length) if docs is None else docs
            docs = docs.with_chunks(chunk) if chunk is not None and chunk < length else docs
            docs = docs.with_window(window)  # a local layer: same blocks, windowed
        query = temperature_tuned(mode.name, module, query, pos, length)
        sinks = _sinks(mode.name, module, kwargs.get("s_aux"), query.shape[1])
        extra = {"docs": docs} if docs is not None else {}
        if sinks is not None:
            extra["sinks"] = sinks
        if not (query.dtype == key.dtype == value.dtype):  # autocast: RoPE's fp32 cos/sin promote q and k only;
            dt = (torch.get_autocast_dtype(query.device.type)  # SDPA would cast all three to the autocast dtype
                  if torch.is_autocast_enabled(query.device.type) else value.dtype)
            query, key, value = query.to(dt), key.to(dt), value.to(dt)
        query, key, value, dv = _equal_head_dims(query, key, value)
        out = fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout,
                 softmax_scale=scaling, causal=True, **groups, **extra)
        return (out if dv is None else out[..., :dv]), None

    attention.mode, attention.seq_algo = mode, mode.name  # seq_algo: the name, as before
    return attention


def _same_rows(pos, query):
    """The model call's (B, S) position ids where they describe this call's rows (a layer's own call may differ)."""
    if pos is None or pos.dim() != 2 or pos.shape[-1] != query.shape[2] or pos.shape[0] not in (1, query.shape[0]):
        return None
    return pos


def _sinks(mode_name, module, s_aux, heads: int):
    """gpt-oss' per-head sink logits (``s_aux``), checked against this call's q heads."""
    if s_aux is None:
        return None
    if s_aux.dim() != 1 or s_aux.shape[0] != heads:
        raise AttentionContractError(
            f"{mode_name}: {where(module)} passes attention sinks of shape {tuple(s_aux.shape)} for {heads} q heads; "
            "sinks must be one logit per q head (head-chunked attention, memory/head_chunks, does not slice them: "
            "turn head chunks off for this model)")
    return s_aux


def _equal_head_dims(query, key, value):
    """MLA (DeepSeek-V2/V3, Kimi): the value head dim differs from q/k's. The kernels take one head dim, so the
    narrower side is zero-padded — exact: zero value columns give zero output columns (sliced off), zero q/k columns
    add nothing to the scores (the softmax scale is passed explicitly). Costs the padding's memory and FLOPs.
    Returns (q, k, v, the value dim to slice the output to, or None)."""
    dq, dv = query.shape[-1], value.shape[-1]
    if dq == dv:
        return query, key, value, None
    import torch.nn.functional as F
    if dv < dq:
        return query, key, F.pad(value, (0, dq - dv)), dv
    return F.pad(query, (0, dv - dq)), F.pad(key, (0, dv - dq)), value, dv


def temperature_tuned(mode_name, module, query, position_ids, length: int):
    """Llama 4's NoPE layers scale q by a function of the token's index, computed by the model from ``arange`` of
    the rows it holds: under sequence parallelism that is the local index. Rescaled here to the token's position
    (its index in its document: packed rows are each document as if alone, like the other layers)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    floor, scale = module.floor_scale, module.attn_scale
    if length < floor:  # every index below floor_scale - 1: the factor is 1 everywhere
        return query
    if position_ids is None:
        raise AttentionContractError(
            f"{mode_name}: {where(module)} scales q by the token's index (attn_temperature_tuning) at {length} >= "
            f"floor_scale={floor} tokens, and the call carries no position_ids to tell this rank's indices: pass "
            "position_ids (prepare_seq_parallel_inputs' local_position_ids)")

    def factor(idx):
        return torch.log1p(torch.floor((idx.float() + 1.0) / floor)) * scale + 1.0
    local = torch.arange(query.shape[2], device=query.device)
    ratio = factor(position_ids.to(query.device)) / factor(local)  # (B, S): the true factor over the applied one
    return (query * ratio[:, None, :, None]).to(query.dtype)


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
