"""Cost-balanced dispatch of packed rows: which chunks of a packed row each sequence-parallel rank holds.

A packed row (position_ids restarting at 0) costs sum(doc_len^2)/2 attention, concentrated in the long documents,
so a fixed cut (zigzag, k mirrored pairs) leaves one rank slow. Here the row is cut into C = W * m equal chunks
(the chunk length a multiple of a kernel tile, 128 when the length allows) and a deterministic solver deals them
to the W ranks, m each, balancing each rank's *q-side* cost: for every q token the keys it attends to (its index in
its document + 1, capped by a sliding window when one is given). The greedy deal (largest first to the least
loaded rank with room, then pairwise swaps off the slowest rank) is the classic LPT heuristic; dealing attention
work by a solver is the idea of MagiAttention's dispatcher (SandAI 2025), written here from scratch.

The table (``Dispatch``) is a pure function of the global position ids (and W, window), so ``shard_sequence`` /
``unshard_sequence`` with ``positions=global`` recompute the same one. The attention only sees *local* position
ids, from which the table cannot be rebuilt (chunks of equal documents look alike), so it is carried explicitly:
``prepare_seq_parallel_inputs`` (and the layouts' ``shard``) set it as the attribute ``DISPATCH_ATTR`` of the local
tensors they return; Hugging Face passes ``position_ids`` unchanged down to the attention, which reads it there
(hf.py) and checks, in the all-gather of positions it already does, that every rank carries the same table
(``digest``). A table that does not cover every token once cannot be built (``Dispatch`` validates itself).

Rows without restarts are not dispatched (plain zigzag, exactly as before). ``EASY_CONTEXT_PACKED_LAYOUT=pairs``
restores the previous data-independent k-pair layout for packed rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

DISPATCH_ATTR = "_easy_context_dispatch"
LAYOUT_ENV = "EASY_CONTEXT_PACKED_LAYOUT"
TILE = 128               # chunk lengths are multiples of this kernel tile when the row length allows it
MAX_PER_RANK = 16        # chunks per rank tried by the cost model (more = better balance, more kernel calls)
# Cost of one extra dense kernel piece (launch + LSE merge, fwd+bwd) in score elements: ~0.5 ms measured per piece
# with FA4 on an H200 (sharding.py's k-pair sweep) at ~0.09 ms per million causal score elements (32 heads x 128).
PIECE_COST = 5.0e6
TOKEN_COST = 0.0         # the linear per-token part (MLP, projections): equal on every rank, so it never moves the deal


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
    """``owners[r]``: global chunk ids held by rank r, in local (increasing) order; C chunks of ``length / C``."""
    length: int
    owners: tuple[tuple[int, ...], ...]
    fingerprint: str = ""  # of the global positions it was planned for ("" = any): checked by the attention
    _rows: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        w = len(self.owners)
        c = w and len(self.owners[0])
        flat = sorted(i for own in self.owners for i in own)
        if w < 1 or c < 1 or any(len(o) != c for o in self.owners):
            raise DispatchError(f"dispatch must give every one of its {w} ranks the same number of chunks; got "
                                f"{[len(o) for o in self.owners]}")
        if flat != list(range(w * c)):
            raise DispatchError(f"dispatch must hold every chunk 0..{w * c - 1} exactly once; got {self.owners}")
        if self.length % (w * c):
            raise DispatchError(f"dispatch of {w * c} chunks cannot cut a row of {self.length} tokens evenly")
        if any(list(o) != sorted(o) for o in self.owners) or 0 not in self.owners[0]:
            raise DispatchError("dispatch: each rank's chunks are in increasing order and rank 0 holds chunk 0")

    @property
    def world(self) -> int:
        return len(self.owners)

    @property
    def chunks(self) -> int:
        return self.world * len(self.owners[0])

    @property
    def chunk_len(self) -> int:
        return self.length // self.chunks

    def rows(self, rank: int) -> torch.Tensor:
        """Global token indices of ``rank``'s local rows, in local order (cached; never modified)."""
        hit = self._rows.get(rank)
        if hit is None:
            c = self.chunk_len
            hit = self._rows[rank] = torch.cat([torch.arange(g * c, (g + 1) * c) for g in self.owners[rank]])
        return hit

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        if x.shape[dim] != self.length:
            raise DispatchError(f"dispatch is for rows of {self.length} tokens; got {x.shape[dim]} along dim {dim}")
        out = x.index_select(dim, self.rows(rank).to(x.device))
        setattr(out, DISPATCH_ATTR, self)
        return out

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


def plan_dispatch(positions: torch.Tensor, world: int, window: int | None = None,
                  per_rank: int | None = None) -> Dispatch | None:
    """The dispatch of a batch whose global ``positions`` (B, L) are packed (None for rows without restarts, which
    keep plain zigzag, or one rank). ``per_rank``: force the chunks per rank; default: the candidate with the lowest
    predicted slowest-rank cost (work + PIECE_COST per kernel piece)."""
    from .sharding import packed_rows
    if world <= 1 or not packed_rows(positions):
        return None
    length = positions.shape[-1]
    if length % world:
        raise DispatchError(f"a packed row of {length} tokens cannot be dispatched over {world} ranks: make the length "
                            f"a multiple of {2 * world}")
    return _plan(_key(positions), length, world, window, per_rank, positions)


def _key(positions: torch.Tensor) -> bytes:
    pos = positions.detach().to("cpu", torch.long).reshape(-1, positions.shape[-1])
    return bytes(pos.numpy().tobytes())


def fingerprint(positions: torch.Tensor) -> str:
    """A short hash of global positions (B, L): the attention checks that the table it was handed was planned for
    the positions it gathers (a table of another batch of the same length would cut the sequence wrongly)."""
    return _hash(_key(positions))


def check_fingerprint(dispatch: "Dispatch", positions: torch.Tensor, what: str) -> None:
    if dispatch.fingerprint and dispatch.fingerprint != fingerprint(positions):
        raise DispatchError(f"{what}: the dispatch table the local position ids carry was planned for other position "
                            "ids (another batch?): pass the local tensors prepare_seq_parallel_inputs returned for "
                            "this batch")


def _plan(key, length, world, window, per_rank, positions) -> Dispatch:
    hit = _CACHE.get((key, world, window, per_rank))
    if hit is not None:
        return hit
    stats = _stats(positions, window)
    if per_rank is not None:
        if length % (world * per_rank):
            raise DispatchError(f"a row of {length} tokens does not split into {world} x {per_rank} equal chunks")
        best = predict(positions, world, per_rank, window, stats=stats)
    else:
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
        best = min(tried, key=lambda p: (max(p.cost), p.per_rank))
    out = Dispatch(length, best.owners, _hash(key))
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[(key, world, window, per_rank)] = out
    return out


def _hash(key: bytes) -> str:
    import hashlib
    return hashlib.blake2b(key, digest_size=8).hexdigest()


_CACHE: dict = {}  # a batch's ids, positions and targets are sharded with the same positions: plan once


def resolve(world: int, positions=None, pairs=None, dispatch=None, window=None) -> Dispatch | None:
    """The dispatch a layout uses: the one given, else planned from the global ``positions`` for packed rows (not
    when ``pairs=`` forces the k-pair layout, nor under ``EASY_CONTEXT_PACKED_LAYOUT=pairs``)."""
    if dispatch is not None:
        if not isinstance(dispatch, Dispatch):
            raise DispatchError(f"dispatch= must be an easy_context.dispatch.Dispatch; got {type(dispatch).__name__}")
        return dispatch
    if pairs is not None or positions is None or world <= 1 or packed_layout() != "dispatch":
        return None
    return plan_dispatch(positions, world, window)


def check_world(dispatch: Dispatch, world: int, length: int, what: str) -> None:
    if dispatch.world != world or dispatch.length != length:
        raise DispatchError(f"{what}: the inputs were dispatched over {dispatch.world} ranks for rows of "
                            f"{dispatch.length} tokens, but attention runs on {world} ranks with {length} tokens; "
                            "prepare the inputs with the same mode and degrees as the patch")


__all__ = ["Dispatch", "DispatchError", "DISPATCH_ATTR", "LAYOUT_ENV", "plan_dispatch", "predict", "solve", "resolve",
           "token_costs", "packed_layout", "check_world", "candidates"]


# Models that rebuild their position ids (Qwen3.5's multimodal RoPE expands them into new tensors) drop the attribute
# the table rides on. The table of the latest local position ids this process cut is kept here, keyed by their
# content: the attention finds it again from the values it receives. The digest all-gather still proves that every
# rank uses the same table.
_RECENT: dict = {}
_RECENT_MAX = 8


def _local_key(local: torch.Tensor):
    t = local.detach().reshape(-1, local.shape[-1])
    return (tuple(t.shape), _hash(t.to("cpu", torch.long).numpy().tobytes()))


def remember(local: torch.Tensor, table, mode: str) -> None:
    """Keep ``table`` for these local position ids cut for ``mode`` (prepare_seq_parallel_inputs calls it)."""
    if table is None:
        return
    _RECENT[(mode, _local_key(local))] = table
    while len(_RECENT) > _RECENT_MAX:
        _RECENT.pop(next(iter(_RECENT)))


def table_of(local: torch.Tensor | None, mode) -> "Dispatch | None":
    """The dispatch table of these local position ids under ``mode`` (a Mode): the attribute, else the one remembered
    for their values; None for a mode whose cut never dispatches."""
    if local is None or not mode.dispatches:
        return None
    table = getattr(local, DISPATCH_ATTR, None)
    if table is None and _RECENT:
        table = _RECENT.get((mode.name, _local_key(local)))
    return table
