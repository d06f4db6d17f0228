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
# attention compares it with its own and refuses a mismatch (a silent wrong result otherwise). A check only: what
# the attention computes never depends on it (the dispatch table travels in the model call, dispatch/plan.py).
LAYOUT_ATTR = "_easy_context_layout"


def shard_sequence(seq_algo, tensor: torch.Tensor, rank: int, world_size: int, dim: int = 1, **kw):
    """This rank's shard of ``tensor`` along ``dim`` in ``seq_algo``'s layout.

    ``positions=`` (the batch's global position ids): packed rows (a restart at 0) take the mode's packed cut (the
    k-pair zigzag under zigzag_ring_attn / usp_attn); ``dispatch=`` a table (``prepared.layout.dispatch``) cuts by
    it. Shard every tensor of a packed batch with the same ``positions=`` / ``dispatch=`` (or use
    ``prepared.layout.shard``)."""
    _check_world(rank, world_size)
    return get_mode(seq_algo).shard(tensor, rank, world_size, dim=dim, **kw)


def global_indices(seq_algo: str, length: int, rank: int, world: int, **kw) -> torch.Tensor:
    """Global indices of ``rank``'s local rows in ``seq_algo``'s layout (a sequence of ``length``; ``positions=``
    / ``pairs=`` / ``ring_degree=`` as for ``shard_sequence``)."""
    return shard_sequence(seq_algo, torch.arange(length), rank, world, dim=0, **kw)


def unshard_sequence(seq_algo, shards, dim: int = 1, layout=None, **kw) -> torch.Tensor:
    """Inverse of ``shard_sequence``: all ranks' shards in rank order -> the full tensor.

    ``layout=``: the ``prepared.layout`` of ``prepare_seq_parallel_inputs`` (exact for any batch). Else pass what the
    cut was given (``positions=`` the global position ids, ``dispatch=``); with neither, rows of a length where the
    packed cut differs from the plain one are refused rather than guessed."""
    shards = list(shards)
    if not shards:
        raise ValueError("unshard_sequence needs at least one shard")
    if layout is not None:
        if kw.get("positions") is not None or kw.get("dispatch") is not None:
            raise ValueError("unshard_sequence: pass layout= or positions=/dispatch=, not both")
        if get_mode(seq_algo).name != layout.mode.name:
            raise ValueError(f"unshard_sequence({get_mode(seq_algo).name!r}, layout=...): the layout is "
                             f"{layout.describe()}")
        return layout.unshard(shards, dim=dim)
    mode = get_mode(seq_algo)
    if kw.get("positions") is None and kw.get("dispatch") is None and kw.get("pairs") is None:
        length = sum(s.shape[dim] for s in shards)
        if _packed_cut_differs(mode, length, len(shards), kw):
            raise ValueError(
                f"unshard_sequence({mode.name!r}): for rows of {length} tokens on {len(shards)} ranks the cut of packed "
                "rows (position_ids restarting at 0) differs from the plain one, and the shards do not say which was "
                "used: pass layout=prepared.layout (what prepare_seq_parallel_inputs returned), or positions= the "
                "global position ids the inputs were cut with")
    return mode.unshard(shards, dim=dim, **kw)


def _packed_cut_differs(mode, length: int, world: int, kw: dict) -> bool:
    """Would a packed row of ``length`` tokens be cut otherwise than an unpacked one (the k-pair zigzag, k > 1)?"""
    if world <= 1 or length < 2:
        return False
    half = length // 2
    packed = torch.cat([torch.arange(half), torch.arange(length - half)]).unsqueeze(0)
    plain = torch.arange(length).unsqueeze(0)
    try:
        return any(not torch.equal(mode.shard(plain, r, world, dim=1, positions=packed, **kw),
                                   mode.shard(plain, r, world, dim=1, **kw)) for r in range(world))
    except ValueError:  # a length the cut cannot take: the mode's own unshard says so
        return False


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
                                world_size: int, device, dispatch=None, **kw):
    """Shard ``(batch, seq)`` inputs for this sp rank; positions stay the true global positions.

    Returns ``{"local_input_ids", "local_position_ids", "local_target_ids"}`` on ``device`` (targets may be
    ``None``), a ``SeqParallelInputs`` dict with ``.layout`` (this batch's cut: ``.layout.unshard(shards, dim)``
    is its inverse) and ``.model_kwargs``. ``usp_attn`` takes ``ring_degree=``.

    Packed rows (positions restarting at 0) under zigzag_ring_attn / usp_attn are cut in the balanced k-pair
    layout, which the attention rebuilds from the local positions: ``model(local_ids, position_ids=local_pos)``
    needs no other argument. ``dispatch="auto"`` deals them in cost-balanced chunks instead (dispatch/plan.py; what
    train.py and the Trainer integration do; ``dispatch=`` a table uses that one): then pass
    ``**prepared.model_kwargs`` to the model, the table's one route to the attention.

    A vision-language model's batch (``model=``, ``pixel_values=``, ``image_grid_thw=``, ``pixel_values_videos=``,
    ``video_grid_thw=``, ...; docs/vlm.md): ``local_position_ids`` is (4, B, L_local), text + mRoPE positions of the
    whole rows cut alike, and ``model_kwargs`` carries this rank's vision work.
    """
    from .batch_layout import BatchLayout, SeqParallelInputs
    mode = get_mode(seq_algo)
    _check_world(rank, world_size)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq); got shape {tuple(input_ids.shape)}")
    vlm = None  # a VLM batch (model=, pixel_values=, ..., or 3-D positions): the cut follows its text positions
    from .vlm.inputs import VLM_KEYS
    if any(k in kw for k in VLM_KEYS) or (position_ids is not None and position_ids.dim() == 3):
        from .vlm.inputs import VLMRows
        vlm = VLMRows(input_ids, position_ids, **{k: kw.pop(k) for k in VLM_KEYS if k in kw})
        position_ids = vlm.doc_positions
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
    # packed rows: one table for the whole batch (planned once, every tensor cut by it), or None (the fixed cut)
    table = mode.dispatch_of(world_size, positions=position_ids, dispatch=dispatch, **kw)
    if table is not None and not isinstance(dispatch, str):  # given (easy_context_train/plan_ahead.py): for these positions?
        from .dispatch.table import DispatchError, fingerprint
        if table.fingerprint and table.fingerprint != fingerprint(position_ids):
            raise DispatchError("prepare_seq_parallel_inputs(dispatch=...): the table was planned for other "
                                "position ids (another batch?): plan it from this batch's global position_ids "
                                "(get_mode(mode).dispatch_of(world, positions=..., dispatch='auto')) or pass "
                                "dispatch='auto'")
    layout = BatchLayout(mode, world_size, dict(kw), position_ids.detach().cpu(), table)
    tag = (*tag, table is not None)  # (signature, description, cut by a dispatch table)

    def cut(t):
        if t is None:
            return None
        local = layout.shard(t, rank, dim=-1).to(device)
        if local is t:  # never tag the caller's own tensor (data_parallel / one rank return it as is)
            local = local.view_as(local)
        setattr(local, LAYOUT_ATTR, tag)
        return local

    out = SeqParallelInputs({"local_input_ids": cut(input_ids), "local_position_ids": cut(position_ids),
                             "local_target_ids": cut(target_ids)}, layout)
    return out if vlm is None else vlm.finish(out, rank, device, LAYOUT_ATTR)
