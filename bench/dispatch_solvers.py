"""The packed-row dispatch's solvers that lost to the default, and the fitted model's per-rank ms: kept to compare
against (bench_packed.py's "old" / "prev" / "first" / "fastest" rows, packed_robust.py, tests/test_dispatch.py); the
library plans with the default only (easy_context/dispatch/plan.py, ``plan_dispatch``). Their history is in
docs/packed_dispatch.md.

Solvers (``plan_dispatch(..., solver=)``): "auto" = the library's default; "chunks" = equal chunks, m per rank (work
+ PIECE_COST per piece: the first solver); "work" = equal deals as they are or with boundaries moved by work alone
(the first segment solver); "fastest" = every segment deal, the fastest predicted, no balance rule and no deeper
search; "first" = "fastest" with the balance rule (the default of 2026-12-05); "segments" = the default without the
equal deals as they are.
"""
from __future__ import annotations

import torch

from easy_context.dispatch.plan import (BALANCE_SLACK, BALANCE_TARGET, DEEP_SOURCES, MODEL, Dispatch,
                                   _hash, _key, _stats, balance, deal_options, equal_deals, pick, plan_dispatch as _auto,
                                   segment_options)
from easy_context.dispatch.segments import to_table
from easy_context.dispatch.solve import window_blind_options
from easy_context.sharding import packed_rows

SOLVERS = ("auto", "first", "fastest", "chunks", "segments", "work")
_KINDS = {"first": (0, 1, 2, 3), "fastest": (0, 1, 2, 3), "work": (0, 1), "segments": (1, 2, 3)}


def plan_dispatch(positions: torch.Tensor, world: int, window: int | None = None, per_rank: int | None = None,
                  solver: str = "auto") -> Dispatch | None:
    """easy_context.dispatch.plan_dispatch with the deal of ``solver`` (SOLVERS; "auto" is the library's)."""
    if solver not in SOLVERS:
        raise ValueError(f"plan_dispatch(solver={solver!r}): must be one of {SOLVERS}")
    length = positions.shape[-1]
    if solver == "auto" or world <= 1 or not packed_rows(positions) or length % world:
        return _auto(positions, world, window, per_rank)  # its table, None, or its error
    stats = _stats(positions, window)
    tried = equal_deals(positions, length, world, window, per_rank, stats)
    if solver == "chunks":
        cuts, owners = (), min(tried, key=lambda p: (max(p.cost), p.per_rank)).owners
    else:
        options = solver_options(positions, length, world, window, tried, stats, solver, per_rank)
        best = pick(options, length // world, BALANCE_SLACK if solver in ("first", "segments") else 0.0)
        cuts, owners = to_table(best[3], world)
    return Dispatch(length, owners, _hash(_key(positions)), cuts)


def solver_options(positions, length, world, window, tried, stats, solver="auto", per_rank=None):
    """The deals ``solver`` picks from: dispatch.solve.segment_options narrowed to its kinds, the deeper search's for
    "segments" (as the default: only for rows the first search leaves unbalanced), the window-blind deals with a
    ``window`` (not for "work")."""
    if solver == "auto":
        return deal_options(positions, length, world, window, tried, stats, per_rank)
    options = [o for o in segment_options(positions, length, world, window, tried, stats) if o[2] in _KINDS[solver]]
    tokens = length // world
    if solver == "segments" and world > 2 and balance(pick(options, tokens), tokens) > BALANCE_TARGET:
        options += segment_options(positions, length, world, window, tried, stats, sources=min(world, DEEP_SOURCES))
    if window is not None and solver != "work":
        options += window_blind_options(positions, length, world, window, stats, per_rank,
                                        lambda *a: solver_options(*a, solver=solver))
    return options


def rank_ms(work, pieces, steps, tokens: int, dense, varlen, ring: bool = False) -> list[float]:
    """Per-rank fwd+bwd ms of the fitted model (bench/packed_fit.py re-fits it) from per-rank work (score elements),
    kernel pieces, ring steps and launches by kind (``dense``, ``varlen``), ``tokens`` local tokens a rank.
    ``ring``: the fixed ring, every step a full-size pass; the dispatch makes one (accumulator init + cast), then
    each further step costs STEP_TIME."""
    m = MODEL
    out = []
    for w, p, st, nd, nv in zip(work, pieces, steps, dense, varlen):
        extra = m.STEP_TIME_PER_TOKEN * tokens * st if ring else m.STEP_TIME_PER_TOKEN * tokens + m.STEP_TIME * (st - 1)
        launch = m.DENSE_TIME * nd + m.VARLEN_TIME * nv
        out.append((w + m.PIECE_TIME * p + launch + m.TOKEN_TIME * tokens + extra) * m.MS_PER_ELEM)
    return out
