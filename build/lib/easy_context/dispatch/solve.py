"""The solver of the packed-row dispatch: equal-chunk deals, their boundaries moved, and the pick among them.

A packed row is cut into C = W * m equal chunks (the chunk length a multiple of a kernel tile, 128 when the length
allows) and dealt to the W ranks, m each, balancing each rank's *q-side* cost (dispatch.cost.token_costs): the
greedy deal (largest first to the least loaded rank with room, then pairwise swaps off the slowest rank) is the
classic LPT heuristic (``solve``); dealing attention work by a solver is the idea of MagiAttention's dispatcher
(SandAI 2025), written here from scratch. dispatch/segments.py then moves the boundaries between ranks, and ``pick``
keeps the fastest predicted deal (dispatch.cost.MODEL) or, when that one is unbalanced, a better balanced one
predicted within BALANCE_SLACK of it. dispatch/plan.py plans a batch's table with these (``plan_dispatch``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cost import MODEL, _arrays, _stats, per_token_time
from .segments import Estimate, refine, segments, to_table
from .table import DispatchError

TILE = 128               # chunk lengths are multiples of this kernel tile when the row length allows it
MAX_PER_RANK = 16        # chunks per rank tried by the cost model (more = better balance, more kernel calls)
# When the fastest predicted deal's max/mean is over BALANCE_TARGET, the segment solvers take a better balanced one
# predicted within BALANCE_SLACK of it (pick()): 1.02 leaves room for the model's error under the 1.05 of issue #28
BALANCE_SLACK = 0.02
BALANCE_TARGET = 1.02
DEEP_SOURCES = 8  # the deeper boundary search tries the 8 slowest ranks at most: at W = 32 trying all of them
                  # doubled the planning time for no better deal (docs/packed_dispatch.md, 2026-12-06)


def solve(costs: list[float], world: int, start=None) -> tuple[tuple[int, ...], ...]:
    """Deal chunks of ``costs`` to ``world`` ranks, len(costs)/world each, minimising the largest sum (LPT, or the
    deal ``start``, then swaps off the most loaded rank while they lower it). Deterministic (ties by index); rank 0
    holds chunk 0."""
    n = len(costs)
    m = n // world
    if start is not None:
        owners = [list(o) for o in start]
        load = [sum(costs[i] for i in o) for o in owners]
    else:
        load, owners = [0.0] * world, [[] for _ in range(world)]
        for i in sorted(range(n), key=lambda i: (-costs[i], i)):
            r = min((r for r in range(world) if len(owners[r]) < m), key=lambda r: (load[r], r))
            owners[r].append(i)
            load[r] += costs[i]
    cost_t = torch.tensor(costs, dtype=torch.float64)
    for _ in range(4 * n):  # swap refinement: the swap off the most loaded rank that lowers the pair's max the most
        a = max(range(world), key=lambda r: (load[r], -r))
        others = [j for b in range(world) if b != a for j in owners[b]]
        if not others:
            break
        ia, jb = torch.tensor(owners[a]), torch.tensor(others)
        rank_of_j = torch.tensor([b for b in range(world) if b != a for _ in owners[b]], dtype=torch.long)
        d = cost_t[ia][:, None] - cost_t[jb][None, :]                                # (m, (W-1) m)
        new = torch.maximum(load[a] - d, torch.tensor(load, dtype=torch.float64)[rank_of_j][None, :] + d)
        new[d <= 0] = float("inf")
        flat = int(torch.argmin(new))  # first minimum: deterministic
        if not float(new.view(-1)[flat]) < load[a] - 1e-9 * max(1.0, load[a]):
            break
        i, j = owners[a][flat // len(others)], others[flat % len(others)]
        b = int(rank_of_j[flat % len(others)])
        owners[a][owners[a].index(i)], owners[b][owners[b].index(j)] = j, i
        d = costs[i] - costs[j]
        load[a] -= d
        load[b] += d
    owners = [tuple(sorted(o)) for o in owners]
    first = next(r for r, o in enumerate(owners) if 0 in o)
    owners[0], owners[first] = owners[first], owners[0]
    return tuple(owners)


def tile_of(length: int, world: int) -> int:
    """Chunk alignment: TILE when the row splits into 2W chunks of TILE multiples, else the largest power of two
    that does (tiny test rows)."""
    t = TILE
    while t > 1 and length % (2 * world * t):
        t //= 2
    return t


def candidates(length: int, world: int) -> list[int]:
    """Chunks per rank the cost model may pick: powers of two with tile-aligned chunks (1 when nothing else fits)."""
    t = tile_of(length, world)
    out = [m for m in (2, 4, 8, 16, 32, 64) if m <= MAX_PER_RANK and length % (world * m) == 0
           and (length // (world * m)) % t == 0]
    return out or [1]


@dataclass(frozen=True)
class Prediction:
    per_rank: int
    work: tuple[float, ...]     # per rank: score elements of its q rows
    pieces: tuple[int, ...]     # per rank: estimated dense kernel pieces
    owners: tuple

    @property
    def cost(self) -> tuple[float, ...]:
        return tuple(w + MODEL.PIECE_COST * p for w, p in zip(self.work, self.pieces))

    @property
    def max_over_mean(self) -> float:
        return max(self.work) / (sum(self.work) / len(self.work))


def predict(positions: torch.Tensor, world: int, per_rank: int, window: int | None = None,
            owners=None, stats=None) -> Prediction:
    """Solve (from the deal ``owners`` if given, else from scratch) and estimate each rank's work and kernel pieces
    for ``per_rank`` chunks a rank. Pieces: one diagonal launch per rank, plus per q chunk one rectangle per rank
    holding earlier chunks of the document its first token lies in (within the window)."""
    length = positions.shape[-1]
    n = world * per_rank
    c = length // n
    tok, start = stats if stats is not None else _stats(positions, window)
    costs = tok.view(n, c).sum(1).tolist()
    owners = solve(costs, world, owners)
    owner_of = [0] * n
    for r, own in enumerate(owners):
        for g in own:
            owner_of[g] = r
    pieces = [1] * world
    for g in range(n):
        lo = int(start[g * c])
        if window is not None:
            lo = max(lo, g * c - window + 1)
        first = lo // c
        pieces[owner_of[g]] += len({owner_of[h] for h in range(first, g)})
    work = [sum(costs[g] for g in own) + MODEL.TOKEN_COST * c * len(own) for own in owners]
    return Prediction(per_rank, tuple(work), tuple(pieces), owners)


def estimate(positions: torch.Tensor, cuts, owners, window: int | None = None, stats=None):
    """dispatch.segments.Estimate (work, pieces, steps per rank) of the deal ``(cuts, owners)`` of ``positions``."""
    prefix, restarts, start = _arrays(positions, window, stats)
    return Estimate(segments(cuts, owners), prefix, restarts, start, len(owners), window)


def equal_deals(positions, length, world, window, per_rank, stats) -> list[Prediction]:
    """The equal-chunk deals tried: ``per_rank`` chunks a rank, or every candidate m."""
    if per_rank is not None:
        if length % (world * per_rank):
            raise DispatchError(f"a row of {length} tokens does not split into {world} x {per_rank} equal chunks")
        return [predict(positions, world, per_rank, window, stats=stats)]
    # each finer cut is tried fresh and as a refinement of the coarser deal (chunks halved, then swapped only
    # where that lowers the slowest rank): the latter keeps neighbouring halves together (fewer kernel pieces)
    tried, prev = [], None
    for m in candidates(length, world):
        here = [predict(positions, world, m, window, stats=stats)]
        if prev is not None and m == 2 * prev.per_rank:
            halves = tuple(tuple(h for g in own for h in (2 * g, 2 * g + 1)) for own in prev.owners)
            here.append(predict(positions, world, m, window, owners=halves, stats=stats))
        prev = min(here, key=lambda p: max(p.cost))
        tried += here
    return tried


def _pick_segments(positions, length, world, window, tried, stats, per_rank=None):
    """(cuts, owners) of the deal ``pick`` keeps of ``deal_options``."""
    options = deal_options(positions, length, world, window, tried, stats, per_rank)
    return to_table(pick(options, length // world)[3], world)


def deal_options(positions, length, world, window, tried, stats, per_rank=None):
    """``segment_options``; when the deal ``pick`` keeps of them is predicted over BALANCE_TARGET, also the deeper
    search's (``sources``: moves off the next slowest rank when the slowest has none, up to DEEP_SOURCES ranks). Why
    only then: always searching deeper gives faster slowest ranks on average but fewer balanced picks (its deals have
    fewer, larger pieces, whose balance depends more on the least stable per-piece constants); rows the first search
    balances keep their deal and their planning time (bench/packed_robust.py --deep, docs/packed_dispatch.md). With a
    ``window``, also the window-blind deals (``window_blind_options``)."""
    options = segment_options(positions, length, world, window, tried, stats)
    tokens = length // world
    if world > 2 and balance(pick(options, tokens), tokens) > BALANCE_TARGET:
        options += segment_options(positions, length, world, window, tried, stats, sources=min(world, DEEP_SOURCES))
    if window is not None:
        options += window_blind_options(positions, length, world, window, stats, per_rank)
    return options


def window_blind_options(positions, length, world, window, stats, per_rank, options_of=None):
    """The deals planned without the window (full causal costs), priced with it (kinds + 10). Why: the boundary
    search is local, and from another start it ends elsewhere; a window-blind deal is sometimes the fastest
    (docs/packed_dispatch.md). Doubles the planning time of windowed models only. ``options_of``: what lists the
    blind deals (``deal_options``; bench/dispatch_solvers.py passes its other solvers')."""
    prefix, restarts, start = _arrays(positions, window, stats)
    blind_stats = _stats(positions, None)
    blind_tried = equal_deals(positions, length, world, None, per_rank, blind_stats)
    out = []
    for o in (options_of or deal_options)(positions, length, world, None, blind_tried, blind_stats):
        t = Estimate(o[3], prefix, restarts, start, world, window).time(MODEL.STEP_TIME)
        out.append(_option(t, o[1], o[2] + 10, o[3]))
    return out


def balance(option, tokens: int) -> float:
    """Predicted max/mean rank time of an option (the per-token time, equal on every rank, counted)."""
    fixed = per_token_time(tokens)
    t = [x + fixed for x in option[4]]
    return max(t) / (sum(t) / len(t))


def pick(options, tokens: int, slack: float = BALANCE_SLACK, target: float = BALANCE_TARGET):
    """The option (as ``segment_options`` gives them) with the lowest predicted slowest rank, unless its predicted
    max/mean is over ``target``: then, of the options within ``slack`` (relative) of it, the fastest under ``target``,
    else the best balanced (the per-token time, equal on every rank, counted in max/mean). Why: the model's ranking of
    deals this close in time is below its error from one GPU run to the next (~7%), while its balance holds better (a
    wrong constant moves all ranks alike). Priced under the model re-fitted on each H200 run, it costs 0.3% of the
    slowest rank on average at 128K (nothing at 512K, where the fastest deals are balanced) and brings 27 of 40 (row,
    fit) cases under 1.05 max/mean instead of 20 (bench/packed_robust.py, docs/packed_dispatch.md)."""
    fastest = min(options, key=lambda o: o[:3])
    fixed = per_token_time(tokens)
    if slack <= 0 or balance(fastest, tokens) <= target:
        return fastest
    near = [o for o in options if o[0] + fixed <= (fastest[0] + fixed) * (1 + slack)]
    good = [o for o in near if balance(o, tokens) <= target]
    return min(good, key=lambda o: o[:3]) if good else min(near, key=lambda o: (balance(o, tokens), *o[:3]))


def segment_options(positions, length, world, window, tried, stats, sources: int = 1):
    """The deals the segment solver chooses from, as (predicted slowest-rank time, m, kind, segments, predicted rank
    times; times in score elements without the per-token part, equal on every rank): every per-m best equal-chunk
    deal (kind 0), and each with its boundaries moved by dispatch.segments.refine: balancing work alone (kind 1),
    then from there time (2), and time from the start (3: fewer moves, pieces kept together). ``sources`` > 1: the
    refines' deeper search (kinds 4-6 for 1-3, no kind 0)."""
    prefix, restarts, start = _arrays(positions, window, stats)
    tile = tile_of(length, world)
    deep = 3 if sources > 1 else 0

    def times(segs):
        return Estimate(segs, prefix, restarts, start, world, window).time(MODEL.STEP_TIME)

    per_m = {}
    for p in tried:  # the best equal-chunk deal of each m, by the time model
        cuts = tuple(range(0, length + 1, length // (world * p.per_rank)))
        t = max(times(segments(cuts, p.owners)))
        if p.per_rank not in per_m or t < per_m[p.per_rank][0]:
            per_m[p.per_rank] = (t, cuts, p.owners)
    options = []
    for m, (t, cuts, owners) in sorted(per_m.items()):
        segs = segments(cuts, owners)
        if not deep:
            options.append(_option(times(segs), m, 0, segs))
        by_work = refine(segs, prefix, world, tile, sources=sources)
        options.append(_option(times(by_work), m, 1 + deep, by_work))
        for i, first in enumerate((by_work, segs)):
            out = refine(first, prefix, world, tile, times=times, piece=MODEL.PIECE_TIME, sources=sources)
            options.append(_option(times(out), m, 2 + i + deep, out))
    return options


def _option(rank_times, m, kind, segs):
    return max(rank_times), m, kind, segs, tuple(rank_times)


__all__ = ["solve", "tile_of", "candidates", "Prediction", "predict", "estimate", "equal_deals", "deal_options",
           "segment_options", "window_blind_options", "balance", "pick", "TILE", "MAX_PER_RANK", "BALANCE_SLACK", "BALANCE_TARGET",
           "DEEP_SOURCES"]
