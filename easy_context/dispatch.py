"""Cost-balanced dispatch of packed rows: which chunks of a packed row each sequence-parallel rank holds.

A packed row (position_ids restarting at 0) costs sum(doc_len^2)/2 attention, concentrated in the long documents,
so a fixed cut (zigzag, k mirrored pairs) leaves one rank slow. Here the row is cut into C = W * m equal chunks
(the chunk length a multiple of a kernel tile, 128 when the length allows) and a deterministic solver deals them
to the W ranks, m each, balancing each rank's *q-side* cost: for every q token the keys it attends to (its index in
its document + 1, capped by a sliding window when one is given). The greedy deal (largest first to the least
loaded rank with room, then pairwise swaps off the slowest rank) is the classic LPT heuristic; dealing attention
work by a solver is the idea of MagiAttention's dispatcher (SandAI 2025), written here from scratch.

The table (``Dispatch``) is a pure function of the global position ids (and W, window). The attention only sees
*local* position ids, from which the table cannot be rebuilt (chunks of equal documents look alike), so it has one
explicit route, like ``cu_seqlens`` in flash-attn's varlen API: ``prepare_seq_parallel_inputs(..., dispatch="auto")``
(and ``ParallelLayout.prepare_inputs``, which train.py and the Trainer integration use) return it in
``prepared.model_kwargs`` = ``{DISPATCH_KWARG: table}``; the caller passes those to the model, transformers hands
its kwargs down to the attention (hf/attention.py), and the position all-gather there proves that every rank holds
the same table (``digest``) and that it was planned for these positions (``fingerprint``). Nothing rides on
tensors and nothing is looked up by value, so copies, ``.to(device)``, gradient accumulation and models that
rebuild their position ids cannot lose or swap it. A table that does not cover every token once cannot be built
(``Dispatch`` validates itself).

Rows without restarts are not dispatched (plain zigzag, exactly as before). Without ``dispatch=`` packed rows take
the data-independent k-pair layout (sharding.py), which the attention rebuilds from the local positions alone: the
plain ``model(local_ids, position_ids=local_pos)`` contract. ``EASY_CONTEXT_PACKED_LAYOUT=pairs`` turns the
dispatch off where it would be the default (a ``ParallelLayout``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

DISPATCH_KWARG = "sp_dispatch"  # the model kwarg the table travels in, down to the attention
AUTO = "auto"  # dispatch="auto": plan a table for packed rows (else the fixed layout)
LAYOUT_ENV = "EASY_CONTEXT_PACKED_LAYOUT"
TILE = 128               # chunk lengths are multiples of this kernel tile when the row length allows it
MAX_PER_RANK = 16        # chunks per rank tried by the cost model (more = better balance, more kernel calls)
# The equal-chunk solver's (solver="chunks") cost of one extra dense kernel piece, in score elements: the first guess
# of ~0.5 ms per piece with FA4 on an H200 (sharding.py's k-pair sweep) at ~0.09 ms per million score elements.
PIECE_COST = 5.0e6
TOKEN_COST = 0.0         # the linear per-token part (MLP, projections): equal on every rank, so it never moves the deal
# The time model the default solver picks by (rank ms, fwd+bwd, 32 heads x 128, FA4 on an H200): `python
# bench/bench_packed.py --fit bench/results/h200_packed_dispatch_2026-12-04_run2.json` (bench/packed_fit.py: least
# squares on relative errors of the 104 per-rank times of the 13 layouts timed at 128K and 512K, W=8: zigzag, k
# pairs, dispatch m=2/4/8 and the picks): 0.0945 ms per million score elements (causal halved) + 0.40 ms per dense
# FA4 launch (FA4 runs a rank's diagonal pieces in one varlen call, kernels/documents._group, fitted at ~0) + 0.17 ms
# per piece (its rows' merge) + 0.95 ms per 16K local tokens per full-size ring pass (the fixed ring makes one per
# step, the dispatch one) + 0.14 ms per further dispatch step. Mean |error| 4.3% (5.0% with one cost per piece and
# no launch kinds); the per-token work, equal on every rank, fitted at 0 and kept at 0.22 ms per 16K (TOKEN_TIME).
# Measured picks (2026-12-05, docs/packed_dispatch.md): 128K 21 chunks, slowest rank 1.73x faster than the default,
# max/mean 1.108; 512K 25 chunks, 1.38x, 1.013; a second run that day (with the sync fix): 128K 1.74x, 1.055; 512K
# 1.32x, 1.047. A re-fit on that run (mean |err| 1.8% in sample: 0.04 ms per piece,
# 0.34 ms per dense launch) picked a 25-chunk 128K deal that measured worse (1.55x, 1.116), so these stay.
MS_PER_ELEM = 0.0945e-6
PIECE_TIME = 1.83e6      # score elements per kernel piece (0.173 ms)
DENSE_TIME = 4.26e6      # per dense launch (0.402 ms)
VARLEN_TIME = 0.0        # per varlen launch (fitted 0: its pieces' cost is in PIECE_TIME)
STEP_TIME_PER_TOKEN = 615.0  # score elements per local token per full-size ring pass (0.952 ms per 16K)
TOKEN_TIME = 140.0       # score elements per local token (0.22 ms per 16K): equal on every rank
STEP_TIME = 1.44e6       # per dispatch step beyond the first (0.136 ms)
# When the fastest predicted deal's max/mean is over BALANCE_TARGET, the segment solvers take a better balanced one
# predicted within BALANCE_SLACK of it (pick()): 1.02 leaves room for the model's error under the 1.05 of issue #28
BALANCE_SLACK = 0.02
BALANCE_TARGET = 1.02
DEEP_SOURCES = 8  # the deeper boundary search tries the 8 slowest ranks at most: at W = 32 all of them took twice
                  # as long to plan (1M rows: 8 s vs 4.6 s on 2 CPU cores) for no better deal


def rank_ms(work, pieces, steps, tokens: int, dense, varlen, ring: bool = False) -> list[float]:
    """Per-rank fwd+bwd ms of the fitted model (bench/packed_fit.py re-fits it) from per-rank work (score elements),
    kernel pieces, ring steps and launches by kind (``dense``, ``varlen``), ``tokens`` local tokens a rank.
    ``ring``: the fixed ring, every step a full-size pass; the dispatch makes one (accumulator init + cast), then
    each further step costs STEP_TIME."""
    out = []
    for w, p, st, nd, nv in zip(work, pieces, steps, dense, varlen):
        extra = STEP_TIME_PER_TOKEN * tokens * st if ring else STEP_TIME_PER_TOKEN * tokens + STEP_TIME * (st - 1)
        launch = DENSE_TIME * nd + VARLEN_TIME * nv
        out.append((w + PIECE_TIME * p + launch + TOKEN_TIME * tokens + extra) * MS_PER_ELEM)
    return out


class DispatchError(ValueError):
    pass


def packed_layout() -> str:
    """``EASY_CONTEXT_PACKED_LAYOUT``: "dispatch" (default, this module) or "pairs" (sharding.py's k-pair zigzag)."""
    raw = os.environ.get(LAYOUT_ENV) or "dispatch"
    if raw not in ("dispatch", "pairs"):
        raise ValueError(f"{LAYOUT_ENV}={raw!r} must be 'dispatch' (cost-balanced chunks, the default) or 'pairs' "
                         "(the fixed k-pair zigzag of packed rows)")
    return raw


@dataclass(frozen=True)
class Dispatch:
    """``owners[r]``: global chunk ids held by rank r, in local (increasing) order; chunk g is the rows
    ``[cuts[g], cuts[g + 1])`` (``cuts=()``: C equal chunks). Every rank holds the same number of tokens."""
    length: int
    owners: tuple[tuple[int, ...], ...]
    fingerprint: str = ""  # of the global positions it was planned for ("" = any): checked by the attention
    cuts: tuple[int, ...] = ()
    _rows: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        w = len(self.owners)
        flat = sorted(i for own in self.owners for i in own)
        n = len(flat)
        if w < 1 or any(not o for o in self.owners):
            raise DispatchError(f"dispatch must give each of its {w} ranks at least one chunk; got {self.owners}")
        if flat != list(range(n)):
            raise DispatchError(f"dispatch must hold every chunk 0..{n - 1} exactly once; got {self.owners}")
        cuts = tuple(int(c) for c in self.cuts)
        if not cuts:
            if self.length % n:
                raise DispatchError(f"dispatch of {n} chunks cannot cut a row of {self.length} tokens evenly")
            cuts = tuple(range(0, self.length + 1, self.length // n))
        if len(cuts) != n + 1 or cuts[0] != 0 or cuts[-1] != self.length or \
                any(a >= b for a, b in zip(cuts[:-1], cuts[1:])):
            raise DispatchError(f"dispatch cuts must rise strictly from 0 to {self.length} in {n + 1} steps; got "
                                f"{cuts[:8]}{'...' if len(cuts) > 8 else ''}")
        object.__setattr__(self, "cuts", cuts)
        sizes = [sum(cuts[g + 1] - cuts[g] for g in own) for own in self.owners]
        if len(set(sizes)) != 1:
            raise DispatchError(f"dispatch must give every one of its {w} ranks the same number of tokens; got "
                                f"{sizes}")
        if any(list(o) != sorted(o) for o in self.owners) or 0 not in self.owners[0]:
            raise DispatchError("dispatch: each rank's chunks are in increasing order and rank 0 holds chunk 0")

    @property
    def world(self) -> int:
        return len(self.owners)

    @property
    def chunks(self) -> int:
        return len(self.cuts) - 1

    @property
    def per_rank(self) -> int:
        """Most chunks a rank holds (the equal-chunk solver's m)."""
        return max(len(o) for o in self.owners)

    def span(self, g: int) -> tuple[int, int]:
        return self.cuts[g], self.cuts[g + 1]

    def rows(self, rank: int) -> torch.Tensor:
        """Global token indices of ``rank``'s local rows, in local order (cached; never modified)."""
        hit = self._rows.get(rank)
        if hit is None:
            hit = self._rows[rank] = torch.cat([torch.arange(*self.span(g)) for g in self.owners[rank]])
        return hit

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        if x.shape[dim] != self.length:
            raise DispatchError(f"dispatch is for rows of {self.length} tokens; got {x.shape[dim]} along dim {dim}")
        return x.index_select(dim, self.rows(rank).to(x.device))

    def unshard(self, shards, dim: int = 1) -> torch.Tensor:
        shards = list(shards)
        if len(shards) != self.world:
            raise DispatchError(f"dispatch over {self.world} ranks got {len(shards)} shards")
        cat = torch.cat(shards, dim=dim)
        order = torch.cat([self.rows(r) for r in range(self.world)])
        inv = torch.empty_like(order)
        inv[order] = torch.arange(len(order))
        return cat.index_select(dim, inv.to(cat.device))

    def digest(self) -> int:
        """A 62-bit fingerprint of the table (compared across ranks in the position all-gather)."""
        h = self.length * 1000003 + self.world + int(self.fingerprint[:12] or "0", 16)
        for own in self.owners:
            for g in own:
                h = (h * 1000003 + g + 1) % (1 << 62)
        for c in self.cuts:
            h = (h * 1000003 + c) % (1 << 62)
        return h or 1


# ----------------------------------------------------------------------------------------------
# cost
# ----------------------------------------------------------------------------------------------
def token_costs(positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(L,) float64: per global token, the keys it attends to (index in its document + 1, window-capped), summed over
    batch rows. Documents are runs between restarts at 0 (a first document not starting at 0 counts from the row
    start, as the attention does)."""
    start = _doc_start(positions)
    keys = (torch.arange(start.shape[1]) - start + 1).double()
    if window is not None:
        keys = keys.clamp(max=window)
    return keys.sum(0)


def _doc_start(positions: torch.Tensor) -> torch.Tensor:
    """(B, L) index of each token's document start."""
    pos = positions.detach().to("cpu", torch.long).reshape(-1, positions.shape[-1])
    idx = torch.arange(pos.shape[1]).expand_as(pos)
    start = torch.where(pos == 0, idx, torch.zeros_like(idx))
    start[:, 0] = 0
    return torch.cummax(start, dim=1).values


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
        return tuple(w + PIECE_COST * p for w, p in zip(self.work, self.pieces))

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
    work = [sum(costs[g] for g in own) + TOKEN_COST * c * len(own) for own in owners]
    return Prediction(per_rank, tuple(work), tuple(pieces), owners)


def _stats(positions, window):
    """(token costs (L,), earliest document start over batch rows per token (L,)): what every candidate reuses."""
    return token_costs(positions, window), _doc_start(positions).min(0).values


def _arrays(positions, window, stats):
    """(prefix token cost (L+1,), restarts before each index (L+1,), document start (L,)) for Estimate."""
    tok, start = stats if stats is not None else _stats(positions, window)
    pos = positions.detach().to("cpu", torch.long).reshape(-1, positions.shape[-1])
    restart = (pos == 0).any(0).long()
    restart[0] = 0
    restarts = torch.cat([torch.zeros(1, dtype=torch.long), restart.cumsum(0)]).numpy()
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), tok.cumsum(0)]).numpy()
    return prefix, restarts, start.numpy()


def estimate(positions: torch.Tensor, cuts, owners, window: int | None = None, stats=None):
    """dispatch_segments.Estimate (work, pieces, steps per rank) of the deal ``(cuts, owners)`` of ``positions``."""
    from .dispatch_segments import Estimate, segments
    prefix, restarts, start = _arrays(positions, window, stats)
    return Estimate(segments(cuts, owners), prefix, restarts, start, len(owners), window)


SOLVERS = ("auto", "first", "fastest", "chunks", "segments", "work")


def plan_dispatch(positions: torch.Tensor, world: int, window: int | None = None,
                  per_rank: int | None = None, solver: str = "auto") -> Dispatch | None:
    """The dispatch of a batch whose global ``positions`` (B, L) are packed (None for rows without restarts, which
    keep plain zigzag, or one rank). ``per_rank``: force the chunks per rank of the equal-chunk deal; default: the
    candidate with the lowest predicted slowest-rank cost. ``solver``: "chunks" = equal chunks, m per rank (work +
    PIECE_COST per piece); "segments" = those deals with their boundaries moved (dispatch_segments.py) to balance
    the predicted rank time (work + pieces + ring steps, MS_PER_ELEM ...); "auto" (the default) = the fastest
    predicted of these and the equal deals as they are, or a better balanced one within BALANCE_SLACK of it (``pick``),
    with a deeper boundary search for rows that leaves unbalanced (``deal_options``); "first" = "auto" without the
    deeper search (the default of the 2026-12-05 third session); "fastest" = without the balance rule either (the
    default before); "work" = the first default (equal deals as they are or with boundaries moved by work alone),
    kept to compare with."""
    if solver not in SOLVERS:
        raise ValueError(f"plan_dispatch(solver={solver!r}): must be one of {SOLVERS}")
    from .sharding import packed_rows
    if world <= 1 or not packed_rows(positions):
        return None
    length = positions.shape[-1]
    if length % world:
        raise DispatchError(f"a packed row of {length} tokens cannot be dispatched over {world} ranks: make the length "
                            f"a multiple of {2 * world}")
    return _plan(_key(positions), length, world, window, per_rank, positions, solver)


def _key(positions: torch.Tensor) -> bytes:
    pos = positions.detach().to("cpu", torch.long).reshape(-1, positions.shape[-1])
    return bytes(pos.numpy().tobytes())


def fingerprint(positions: torch.Tensor) -> str:
    """A short hash of global positions (B, L): the attention checks that the table it was handed was planned for
    the positions it gathers (a table of another batch of the same length would cut the sequence wrongly)."""
    return _hash(_key(positions))


def check_fingerprint(dispatch: "Dispatch", positions: torch.Tensor, what: str) -> None:
    if dispatch.fingerprint and dispatch.fingerprint != fingerprint(positions):
        raise DispatchError(f"{what}: the dispatch table the model call carries was planned for other position ids "
                            "(another micro-batch?): pass the model_kwargs prepare_seq_parallel_inputs returned "
                            "with these very inputs")


def _plan(key, length, world, window, per_rank, positions, solver="auto") -> Dispatch:
    hit = _CACHE.get((key, world, window, per_rank, solver))
    if hit is not None:
        return hit
    stats = _stats(positions, window)
    tried = equal_deals(positions, length, world, window, per_rank, stats)
    best = min(tried, key=lambda p: (max(p.cost), p.per_rank))
    cuts = ()
    if solver != "chunks":
        cuts, owners = _pick_segments(positions, length, world, window, tried, stats, solver, per_rank)
    else:
        owners = best.owners
    out = Dispatch(length, owners, _hash(key), cuts)
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[(key, world, window, per_rank, solver)] = out
    return out


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


def _pick_segments(positions, length, world, window, tried, stats, solver, per_rank=None):
    """(cuts, owners) of the deal ``pick`` keeps of ``deal_options``."""
    from .dispatch_segments import to_table
    tokens = length // world
    options = deal_options(positions, length, world, window, tried, stats, solver, per_rank)
    best = pick(options, tokens, BALANCE_SLACK if solver in ("auto", "first", "segments") else 0.0)
    return to_table(best[3], world)


def deal_options(positions, length, world, window, tried, stats, solver="auto", per_rank=None):
    """``segment_options``; for "auto" and "segments" (not "first"), when the deal ``pick`` keeps of them
    is predicted over BALANCE_TARGET, also the deeper search's (``sources``: moves off the next slowest rank when
    the slowest has none, up to DEEP_SOURCES ranks). Why only then: on the 128K rows of bench_packed (seeds 0-7,
    W = 8) priced under the model re-fitted on each H200 run, always searching deeper gives 3.7% faster slowest
    ranks on average but fewer balanced picks (21 of 40 (row, fit) cases <= 1.05 max/mean, from 27): its deals have
    fewer, larger pieces, whose balance depends more on the per-piece constants, the least stable ones from run to
    run. Searching deeper only for rows left unbalanced gives 2.7% and 30 of 40 (bench/packed_robust.py --deep,
    2026-12-05); the rows the first search balances keep their deal and their planning time (0.06-0.2 s at 128K
    on 2 CPU cores; 0.3-0.8 s with the deeper search). With a ``window``, also the window-blind deals
    (``_window_blind_options``)."""
    options = segment_options(positions, length, world, window, tried, stats, solver)
    tokens = length // world
    if solver in ("auto", "segments") and world > 2 and balance(pick(options, tokens), tokens) > BALANCE_TARGET:
        options += segment_options(positions, length, world, window, tried, stats, solver,
                                   sources=min(world, DEEP_SOURCES))
    if window is not None and solver != "work":
        options += _window_blind_options(positions, length, world, window, stats, solver, per_rank)
    return options


def _window_blind_options(positions, length, world, window, stats, solver, per_rank):
    """The deals planned without the window (full causal costs), priced with it (kinds + 10). Why: the boundary
    search is local, and from another start it ends elsewhere. On 36 bench_packed-like rows (16K-512K, W = 8) a
    window-blind deal was the pick 3 times, 6-13% faster than the best window-aware one (predicted, 2026-12-05).
    Doubles the planning time of windowed models only."""
    from .dispatch_segments import Estimate
    prefix, restarts, start = _arrays(positions, window, stats)
    blind_stats = _stats(positions, None)
    blind_tried = equal_deals(positions, length, world, None, per_rank, blind_stats)
    out = []
    for o in deal_options(positions, length, world, None, blind_tried, blind_stats, solver):
        t = Estimate(o[3], prefix, restarts, start, world, window).time(STEP_TIME)
        out.append(_option(t, o[1], o[2] + 10, o[3]))
    return out


def per_token_time(tokens: int) -> float:
    """The part of every rank's predicted time that grows with its ``tokens`` only (one full-size pass, the linear
    work), in score elements: equal on every rank, so options leave it out and max/mean counts it in."""
    return (STEP_TIME_PER_TOKEN + TOKEN_TIME) * tokens


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


def segment_options(positions, length, world, window, tried, stats, solver="auto", sources: int = 1):
    """The deals the segment solvers choose from, as (predicted slowest-rank time, m, kind, segments, predicted rank
    times; times in score elements without the per-token part, equal on every rank): every per-m best equal-chunk
    deal (kind 0, solver="auto" / "fastest"), and each with its boundaries moved by dispatch_segments.refine:
    balancing work alone (kind 1), then from there time (2), and time from the start (3: fewer moves, pieces kept
    together). ``sources`` > 1: the refines' deeper search (kinds 4-6 for 1-3, no kind 0)."""
    from .dispatch_segments import Estimate, refine, segments
    prefix, restarts, start = _arrays(positions, window, stats)
    tile = tile_of(length, world)
    deep = 3 if sources > 1 else 0

    def times(segs):
        return Estimate(segs, prefix, restarts, start, world, window).time(STEP_TIME)

    per_m = {}
    for p in tried:  # the best equal-chunk deal of each m, by the time model
        cuts = tuple(range(0, length + 1, length // (world * p.per_rank)))
        t = max(times(segments(cuts, p.owners)))
        if p.per_rank not in per_m or t < per_m[p.per_rank][0]:
            per_m[p.per_rank] = (t, cuts, p.owners)
    options = []
    for m, (t, cuts, owners) in sorted(per_m.items()):
        segs = segments(cuts, owners)
        if solver in ("auto", "first", "fastest", "work") and not deep:
            options.append(_option(times(segs), m, 0, segs))
        by_work = refine(segs, prefix, world, tile, sources=sources)
        options.append(_option(times(by_work), m, 1 + deep, by_work))
        if solver == "work":  # the first segment solver: boundaries moved by work alone (kept for bench_packed)
            continue
        for i, first in enumerate((by_work, segs)):
            out = refine(first, prefix, world, tile, times=times, piece=PIECE_TIME, sources=sources)
            options.append(_option(times(out), m, 2 + i + deep, out))
    return options


def _option(rank_times, m, kind, segs):
    return max(rank_times), m, kind, segs, tuple(rank_times)


def _hash(key: bytes) -> str:
    import hashlib
    return hashlib.blake2b(key, digest_size=8).hexdigest()


_CACHE: dict = {}  # a batch's ids, positions and targets are sharded with the same positions: plan once


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


def table_of(kwargs: dict, mode) -> "Dispatch | None":
    """The table a model call carries (``kwargs[DISPATCH_KWARG]``), checked; None when it carries none."""
    table = kwargs.get(DISPATCH_KWARG)
    if table is None:
        return None
    if not isinstance(table, Dispatch):
        raise DispatchError(f"{DISPATCH_KWARG}= must be the easy_context Dispatch that prepare_seq_parallel_inputs "
                            f"returned in prepared.model_kwargs; got {type(table).__name__}")
    if not mode.dispatches:
        raise DispatchError(f"{mode.name} does not dispatch packed rows, but the model call carries a dispatch table "
                            f"({DISPATCH_KWARG}=): the inputs were prepared for another mode")
    return table


def check_world(dispatch: Dispatch, world: int, length: int, what: str) -> None:
    if dispatch.world != world or dispatch.length != length:
        raise DispatchError(f"{what}: the inputs were dispatched over {dispatch.world} ranks for rows of "
                            f"{dispatch.length} tokens, but attention runs on {world} ranks with {length} tokens; "
                            "prepare the inputs with the same mode and degrees as the patch")


__all__ = ["Dispatch", "DispatchError", "DISPATCH_KWARG", "AUTO", "LAYOUT_ENV", "table_of", "plan_dispatch", "predict", "estimate", "solve",
           "resolve", "SOLVERS",
           "token_costs", "packed_layout", "check_world", "candidates"]
