"""Cost-balanced dispatch of packed rows: which chunks of a packed row each sequence-parallel rank holds.

A packed row (position_ids restarting at 0) costs sum(doc_len^2)/2 attention, concentrated in the long documents,
so a fixed cut (zigzag, k mirrored pairs) leaves one rank slow. Here the row is cut into chunks dealt to the W ranks
so that each rank's predicted time is balanced (the package's files: dispatch/__init__.py).

The table (``Dispatch``) is a pure function of the global position ids (and W, window); its one explicit route to
the attention is ``prepared.model_kwargs`` (dispatch/table.py). Rows without restarts are not dispatched (plain
zigzag, exactly as before). Without ``dispatch=`` packed rows take the data-independent k-pair layout (sharding.py),
which the attention rebuilds from the local positions alone: the plain ``model(local_ids, position_ids=local_pos)``
contract. ``EASY_CONTEXT_PACKED_LAYOUT=pairs`` turns the dispatch off where it would be the default (a
``ParallelLayout``).
"""
from __future__ import annotations

import torch

from .cost import (MODEL, NAMES, TimeModel, _arrays, _doc_start, _stats, per_token_time,  # noqa: F401
                            token_costs)
from .solve import (BALANCE_SLACK, BALANCE_TARGET, DEEP_SOURCES, MAX_PER_RANK, TILE, Prediction,  # noqa: F401
                             _pick_segments, balance, candidates, deal_options, equal_deals, estimate, pick, predict,
                             segment_options, solve, tile_of)
from .table import (AUTO, DISPATCH_KWARG, LAYOUT_ENV, Dispatch, DispatchError, _hash, _key,  # noqa: F401
                             check_fingerprint, check_world, fingerprint, packed_layout, table_of)
from ..sharding import packed_rows


def plan_dispatch(positions: torch.Tensor, world: int, window: int | None = None,
                  per_rank: int | None = None) -> Dispatch | None:
    """The dispatch of a batch whose global ``positions`` (B, L) are packed (None for rows without restarts, which
    keep plain zigzag, or one rank): the equal-chunk deals (``per_rank`` forces their chunks per rank; default: every
    candidate) as they are and with their boundaries moved (dispatch/segments.py), the fastest predicted of these or a
    better balanced one within BALANCE_SLACK of it (``pick``), with a deeper boundary search for rows that leaves
    unbalanced (``deal_options``). The solvers this one replaced are bench/dispatch_solvers.py's."""
    if world <= 1 or not packed_rows(positions):
        return None
    length = positions.shape[-1]
    if length % world:
        raise DispatchError(f"a packed row of {length} tokens cannot be dispatched over {world} ranks: make the length "
                            f"a multiple of {2 * world}")
    return _plan(_key(positions), length, world, window, per_rank, positions)


_CACHE: dict = {}  # a batch's ids, positions and targets are sharded with the same positions: plan once


def _plan(key, length, world, window, per_rank, positions) -> Dispatch:
    hit = _CACHE.get((key, world, window, per_rank))
    if hit is not None:
        return hit
    stats = _stats(positions, window)
    tried = equal_deals(positions, length, world, window, per_rank, stats)
    cuts, owners = _pick_segments(positions, length, world, window, tried, stats, per_rank)
    out = Dispatch(length, owners, _hash(key), cuts)
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[(key, world, window, per_rank)] = out
    return out


def resolve(world: int, positions=None, pairs=None, dispatch=None, window=None) -> Dispatch | None:
    """The dispatch a layout uses: the table given; ``dispatch="auto"``: one planned from the global ``positions`` for
    packed rows (not when ``pairs=`` forces the k-pair layout, nor under ``EASY_CONTEXT_PACKED_LAYOUT=pairs``);
    ``None``: none (the mode's fixed cut)."""
    if dispatch is None:
        return None
    if isinstance(dispatch, Dispatch):
        return dispatch
    if not (isinstance(dispatch, str) and dispatch == AUTO):
        raise DispatchError(f"dispatch= must be None, {AUTO!r} or an easy_context.dispatch.Dispatch; got "
                            f"{type(dispatch).__name__}")
    if pairs is not None or positions is None or world <= 1 or packed_layout() != "dispatch":
        return None
    return plan_dispatch(positions, world, window)


def __getattr__(name):
    """The fitted time model's constants (``MS_PER_ELEM``, ``PIECE_TIME``, ...): ``dispatch.cost.MODEL``'s current
    values (plan_constants.json's, or a fit bench/packed_calibrate.py swapped in)."""
    if name in NAMES:
        return getattr(MODEL, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Dispatch", "DispatchError", "DISPATCH_KWARG", "AUTO", "LAYOUT_ENV", "table_of", "plan_dispatch", "predict",
           "estimate", "solve", "resolve", "token_costs", "packed_layout", "check_world", "candidates"]
