"""The EasyContext calls: sharding of inputs and of any tensor along the sequence.

``seq_algo`` is a mode name (the public string form) or a ``Mode``; the mode's own cut does the work."""
from __future__ import annotations

import torch

from .registry import get_mode


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1 or not (0 <= rank < world_size):
        raise ValueError(f"rank must be in [0, world_size) and world_size >= 1; got rank={rank}, world_size={world_size}")


def seq_multiple(seq_algo, world_size: int, **kw) -> int:
    """The multiple the (global) sequence length must be for ``seq_algo`` on ``world_size`` sp ranks."""
    return get_mode(seq_algo).seq_multiple(world_size, **kw)


def layout_signature(seq_algo, world_size: int, **kw) -> tuple:
    """How ``seq_algo`` cuts a sequence over ``world_size`` sp ranks, canonically: two (mode, degrees) with
    the same signature shard identically (zigzag over W == usp ring W x ulysses 1; usp ring 1 == contiguous)."""
    return get_mode(seq_algo).signature(world_size, **kw)


def describe_layout(seq_algo, world_size: int, **kw) -> str:
    extra = "".join(f", {k}={v}" for k, v in kw.items() if v is not None)
    return f"{get_mode(seq_algo).name} on {world_size} sp ranks{extra}"


# prepare_seq_parallel_inputs marks the tensors it returns with the layout they were cut for; the patched
# attention compares it with its own and refuses a mismatch (a silent wrong result otherwise).
LAYOUT_ATTR = "_easy_context_layout"
from .dispatch import DISPATCH_ATTR  # noqa: E402  (the packed rows' chunk table, dispatch.py)


def shard_sequence(seq_algo, tensor: torch.Tensor, rank: int, world_size: int, dim: int = 1, **kw):
    """This rank's shard of ``tensor`` along ``dim`` in ``seq_algo``'s layout.

    ``positions=`` (the batch's global position ids): packed rows (a restart at 0) are dispatched in cost-balanced
    chunks under ``zigzag_ring_attn`` / ``usp_attn`` / ``dist_flash_attn`` (dispatch.py; the table is attached to
    the returned tensor, where the attention reads it; ``dispatch=`` passes one); without it, or for rows without
    restarts, the layout is the mode's fixed one (plain zigzag / contiguous). Shard every tensor of a packed batch
    with the same ``positions=`` (``prepare_seq_parallel_inputs`` does)."""
    _check_world(rank, world_size)
    return get_mode(seq_algo).shard(tensor, rank, world_size, dim=dim, **kw)


def unshard_sequence(seq_algo, shards, dim: int = 1, **kw) -> torch.Tensor:
    """Inverse of ``shard_sequence``: all ranks' shards in rank order -> the full tensor. Pass the same
    ``positions=`` as to ``shard_sequence`` (the global positions; for the k-pair layout also the rank-order concatenation of the local
    ones: the packed test reads the same on both)."""
    shards = list(shards)
    if not shards:
        raise ValueError("unshard_sequence needs at least one shard")
    return get_mode(seq_algo).unshard(shards, dim=dim, **kw)


def _packed_hint(seq_algo, world_size, position_ids, kw) -> str:
    """For packed rows under a zigzag ring: the lengths that get the fully balanced k-pair layout."""
    from .sharding import PAIRS_ENV, pairs_min_chunk, packed_rows
    sig = layout_signature(seq_algo, world_size, **kw)
    if sig[0] != "zigzag" or not packed_rows(position_ids):
        return ""
    m = 4 * sig[1] * sig[2]
    return (f"; these rows are packed: a multiple of {m} of at least {m * pairs_min_chunk() // sig[2]} tokens gets "
            f"the balanced layout with 2 or more mirrored pairs per ring rank (chunks >= {pairs_min_chunk()} "
            f"tokens, {PAIRS_ENV})")


def prepare_seq_parallel_inputs(seq_algo, input_ids, position_ids, target_ids, rank: int,
                                world_size: int, device, **kw) -> dict:
    """Shard ``(batch, seq)`` inputs for this sp rank; positions stay the true global positions.

    Returns ``{"local_input_ids", "local_position_ids", "local_target_ids"}`` on ``device``
    (targets may be ``None``). ``usp_attn`` takes ``ring_degree=``. Packed rows (positions restarting at 0) are
    cut in the balanced k-pair layout under zigzag_ring_attn / usp_attn; unshard their outputs with
    ``unshard_sequence(..., positions=position_ids)``.
    """
    mode = get_mode(seq_algo)
    _check_world(rank, world_size)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq); got shape {tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    for name, t in (("position_ids", position_ids), ("target_ids", target_ids)):
        if t is not None and t.shape[-1] != input_ids.shape[1]:
            raise ValueError(f"{name} has length {t.shape[-1]} but input_ids has {input_ids.shape[1]}")
    mult = mode.seq_multiple(world_size, **kw)
    if input_ids.shape[1] % mult != 0:
        n = input_ids.shape[1]
        raise ValueError(f"{mode.name} on {world_size} ranks needs the sequence length to be a multiple of "
                         f"{mult}; got {n} (use {n - n % mult or mult} or {n - n % mult + mult})"
                         + _packed_hint(mode, world_size, position_ids, kw))

    tag = (mode.signature(world_size, **kw), describe_layout(mode, world_size, **kw))
    # packed rows (restarts at 0): one cost-balanced dispatch table for the batch (dispatch.py), planned once and
    # attached to every returned tensor: the attention reads it off the local position ids
    table = mode.dispatch_of(world_size, positions=position_ids, **kw)
    if table is not None:
        if kw.get("dispatch") is not None:  # planned elsewhere (training/plan_ahead.py): for these positions?
            from .dispatch import DispatchError, fingerprint
            if table.fingerprint and table.fingerprint != fingerprint(position_ids):
                raise DispatchError("prepare_seq_parallel_inputs(dispatch=...): the table was planned for other "
                                    "position ids (another batch?): plan it from this batch's global position_ids "
                                    "(get_mode(mode).dispatch_of(world, positions=...)) or leave dispatch= out")
        kw = dict(kw, dispatch=table)

    def cut(t):
        if t is None:
            return None
        local = shard_sequence(mode, t, rank, world_size, dim=-1, positions=position_ids, **kw).to(device)
        if local is t:  # never tag the caller's own tensor (data_parallel / one rank return it as is)
            local = local.view_as(local)
        elif table is not None and local._base is not None:  # a base of its own: views of it find the table there
            local = local.clone()
        setattr(local, LAYOUT_ATTR, tag)
        if table is not None:
            setattr(local, DISPATCH_ATTR, table)
        return local

    local_pos = cut(position_ids)
    if table is not None:  # found again by value where a model rebuilds its position ids (dispatch.table_of)
        from .dispatch import remember
        remember(local_pos, table, mode.name)
    return {"local_input_ids": cut(input_ids), "local_position_ids": local_pos,
            "local_target_ids": cut(target_ids)}
