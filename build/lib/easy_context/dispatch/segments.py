"""Unequal chunks for the dispatch (issue #28): refine an equal-chunk deal by moving the boundaries between ranks.

An equal-chunk deal (dispatch.solve.solve) cannot balance a row whose cost sits in one long document: a chunk of its
tail costs more than a rank's share allows. Here the deal is seen as segments (maximal runs of one rank's chunks) and
the boundaries between them move, in tile steps, in cycles that keep every rank's token count: the most loaded rank a
gives the d tokens at one of its segment edges to the neighbour x and takes d tokens back at another edge, from x
(a 2-cycle) or from y where x hands d tokens to y at an x|y boundary (a 3-cycle). The deeper search (``sources``)
moves work off the next slowest rank when the slowest has no such move. Expensive tokens (late in a long
document) leave, cheap ones arrive; a move is kept when it lowers the largest load of the ranks it touches below
a's. Segments only shrink, grow or vanish, so the deal never gets more pieces; the result is the same ``Dispatch``
with ``cuts``. Deterministic (ties go to the first option in boundary order, then the smallest d).
"""
from __future__ import annotations

import bisect

import numpy as np

from .cost import MODEL


def segments(cuts, owners) -> list[list[int]]:
    """[start, stop, rank] runs of the deal (adjacent chunks of one rank merged), in row order."""
    owner_of = {g: r for r, own in enumerate(owners) for g in own}
    out: list[list[int]] = []
    for g in range(len(cuts) - 1):
        r = owner_of[g]
        if out and out[-1][2] == r:
            out[-1][1] = cuts[g + 1]
        else:
            out.append([cuts[g], cuts[g + 1], r])
    return out


def to_table(segs, world: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(cuts, owners) of segments, ranks relabelled so that rank 0 holds the first chunk (as Dispatch requires)."""
    first = segs[0][2]
    relabel = {r: r for r in range(world)}
    relabel[first], relabel[0] = 0, first
    cuts = (0,) + tuple(s[1] for s in segs)
    owners = [[] for _ in range(world)]
    for g, s in enumerate(segs):
        owners[relabel[s[2]]].append(g)
    return cuts, tuple(tuple(o) for o in owners)


def _normalise(segs):
    out = []
    for s in segs:
        if s[1] <= s[0]:
            continue
        if out and out[-1][2] == s[2]:
            out[-1][1] = s[1]
        else:
            out.append(list(s))
    return out


def loads(segs, prefix, world: int) -> np.ndarray:
    """Per-rank work (sum of the token costs of its segments)."""
    load = np.zeros(world)
    for s0, s1, r in segs:
        load[r] += prefix[s1] - prefix[s0]
    return load


def _rank_key(t, quantum):
    """Descending per-rank times, quantised: a move is kept only when it lowers this tuple (lexicographic), which
    rules out cycles and float ties."""
    return tuple(int(v // quantum) for v in sorted(t, reverse=True))


def _apply(segs, d, shifts):
    new = [list(x) for x in segs]
    for b, sign in shifts:  # boundary b (between segs[b] and segs[b+1]) moves by sign * d
        new[b][1] += sign * d
        new[b + 1][0] += sign * d
    return _normalise(new)


def refine(segs, prefix: np.ndarray, world: int, tile: int, iters: int = 400, times=None, piece: float = 0.0,
           top: int = 8, sources: int = 1) -> list[list[int]]:
    """Lower the slowest rank of ``segs`` by token-preserving boundary cycles. ``prefix``: (L + 1,) cumulative token
    cost. ``times``: segs -> per-rank predicted time (default: work alone). The slowest rank's moves are ranked by
    their work change (a move that empties a segment credited ``piece``, the kernel piece it saves); the ``top`` of
    them are priced exactly by ``times`` (pieces and ring steps change with the boundaries, also on other ranks)
    and the best kept if it lowers the sorted rank times. ``sources`` > 1: when the slowest rank has no such move,
    the next slowest ranks (up to ``sources`` in all) are tried in turn: levelling the ranks below the top (the key
    is lexicographic) opens moves for the slowest later. Costs ~2.5x the planning time."""
    segs = _normalise(segs)
    times = times or (lambda s: loads(s, prefix, world))
    cur = np.asarray(times(segs), dtype=float)
    quantum = 1e-7 * max(float(cur.max()), 1e-30)
    for _ in range(iters):
        best = _best_move(segs, prefix, cur, tile, piece, top, sources, times, quantum)
        if best is None:
            break
        segs, cur = best
    return segs


def _best_move(segs, prefix, cur, tile, piece, top, sources, times, quantum):
    """(segments, times) after the best priced move off the slowest rank that has one, or None."""
    best, best_key = None, _rank_key(cur, quantum)
    for a in np.argsort(-cur, kind="stable")[:sources]:
        for three in (False, True):  # 3-cycles only when no 2-cycle helps
            for d, shifts in _moves(segs, prefix, cur, tile, three, piece, int(a))[:top]:
                new = _apply(segs, d, shifts)
                t = np.asarray(times(new), dtype=float)
                if _rank_key(t, quantum) < best_key:
                    best, best_key = (new, t), _rank_key(t, quantum)
            if best is not None:
                return best
    return None


def _options(segs, prefix, tile, who, give: bool):
    """Edge moves of rank ``who``: (boundary, sign, other rank, cost vector over d = tile * (1..K), cap in tiles).
    give: ``who``'s edge tokens go to the neighbour; else the neighbour's edge tokens come to ``who``."""
    out = []
    for b in range(len(segs) - 1):
        left, right = segs[b], segs[b + 1]
        if who not in (left[2], right[2]):
            continue
        who_left = left[2] == who
        other = right[2] if who_left else left[2]
        # the boundary moves left (into the left segment) when the left segment's tokens are the ones that move
        moving_left = who_left == give
        p = left[1]
        if moving_left:
            cap = (left[1] - left[0]) // tile
            d = tile * np.arange(1, cap + 1)
            cost = prefix[p] - prefix[p - d]
        else:
            cap = (right[1] - right[0]) // tile
            d = tile * np.arange(1, cap + 1)
            cost = prefix[p + d] - prefix[p]
        if cap:
            out.append((b, -1 if moving_left else 1, other, cost, cap))
    return out


def _moves(segs, prefix, load, tile, three: bool, piece: float, a: int):
    """Candidate cycles off rank a (the slowest, or the next when it has none), best first by the largest resulting
    load of the ranks they touch (work change only, less ``piece`` when a segment empties): per (give, take) edge
    pair the best d and the largest d (which empties a segment). [(d, ((boundary, sign), ...))]."""
    la = load[a]
    gives = _options(segs, prefix, tile, a, True)
    takes = _options(segs, prefix, tile, a, False)
    out = []

    def consider(obj, cap, shifts):
        obj = obj[:cap]
        i = int(np.argmin(obj))
        out.append((float(obj[i]), (i + 1) * tile, shifts))
        if i + 1 < cap:
            out.append((float(obj[cap - 1]) - piece, cap * tile, shifts))

    if not three:  # 2-cycles: to x at one edge, back from x at another
        for bg, sg, x, g, cg in gives:
            for bt, st, x2, t, ct in takes:
                if x2 != x or bt == bg:
                    continue
                cap = min(cg, ct)
                new_a = la - g[:cap] + t[:cap]
                consider(np.maximum(new_a, load[x] + la - new_a), cap, ((bg, sg), (bt, st)))
    else:  # 3-cycles: to x, x hands on to y, back from y
        for bg, sg, x, g, cg in gives:
            for bh, sh, y, h, ch in _options(segs, prefix, tile, x, True):
                if y == a or bh == bg:
                    continue
                for bt, st, y2, t, ct in takes:
                    if y2 != y or bt in (bg, bh):
                        continue
                    cap = min(cg, ch, ct)
                    new_a = la - g[:cap] + t[:cap]
                    obj = np.maximum(np.maximum(new_a, load[x] + g[:cap] - h[:cap]), load[y] + h[:cap] - t[:cap])
                    consider(obj, cap, ((bg, sg), (bh, sh), (bt, st)))
    out.sort(key=lambda o: o[0])  # stable: ties keep boundary order (deterministic)
    return [(d, shifts) for obj, d, shifts in out if obj < la]


class Estimate:
    """Per rank of a deal: work (score elements of its q rows), kernel pieces (a causal one per document piece on the
    diagonal, a rectangle per (q segment, rank holding earlier rows of its first document)), FA4 launches by kind
    (dense, varlen), ring steps (1 + the ranks it needs kv from); ``time``: dispatch_cost's fitted model (``MODEL``)
    in score elements (``step`` per extra step). Exact for the equal deals of 2-4 chunks a rank of bench_packed's rows;
    with more, smaller chunks it counts a few rectangles more than the kernel runs (adjacent kv rows merge there)."""

    def __init__(self, segs, prefix, restarts, first, world, window=None):
        from ..kernels.documents import RECT_VARLEN_MAX, VARLEN_MIN_DOCS, VARLEN_MIN_RECTS, VARLEN_WINDOW
        self.work, self.pieces, self.steps = [0.0] * world, [0] * world, [1] * world
        # launches by kind (FA4, kernels/documents._group): a rank's own step lists its diagonal pieces (one per
        # document part) first, contiguous across its segments: one varlen launch when there are >= VARLEN_MIN_DOCS,
        # else one dense launch each; every rectangle (earlier rows of a document, own or received) is a dense launch,
        # or, with RECT_VARLEN_MAX > 0, those of one step (one source rank) one varlen launch when there are >=
        # VARLEN_MIN_RECTS (all counted as under the cap: the estimate does not size them)
        self.dense, self.varlen = [0] * world, [0] * world
        rects = [{} for _ in range(world)]  # rank -> {source rank: rectangles}
        diag = [0] * world
        starts = [s[0] for s in segs]
        srcs = [set() for _ in range(world)]
        for s0, s1, r in segs:
            self.work[r] += float(prefix[s1] - prefix[s0])
            diag[r] += 1 + int(restarts[s1] - restarts[s0 + 1])
            lo = int(first[s0])
            if window is not None:
                lo = max(lo, s0 - window + 1)
            if lo >= s0:
                continue
            j = max(bisect.bisect_right(starts, lo) - 1, 0)
            held = {segs[i][2] for i in range(j, bisect.bisect_left(starts, s0, j))}
            self.pieces[r] += len(held)
            for h in held:
                rects[r][h] = rects[r].get(h, 0) + 1
            srcs[r] |= held - {r}
        # under a window a document part longer than it is a Window piece: in FA4's windowed varlen run with the
        # others (VARLEN_WINDOW), or, without one, its own dense launch that also ends the run (documents._group)
        split = window is not None and "fa4" not in VARLEN_WINDOW
        runs = self._diagonal_runs(segs, restarts, world, window) if split else None
        for r in range(world):
            for c in rects[r].values():
                if RECT_VARLEN_MAX > 0 and c >= VARLEN_MIN_RECTS:
                    self.varlen[r] += 1
                else:
                    self.dense[r] += c
            self.pieces[r] += diag[r]
            for n in (runs[r] if runs is not None else [diag[r]]):  # n short parts in a row; 0: one long part
                if n >= VARLEN_MIN_DOCS:
                    self.varlen[r] += 1
                else:
                    self.dense[r] += max(n, 1)
        self.steps = [1 + len(x) for x in srcs]

    @staticmethod
    def _diagonal_runs(segs, restarts, world, window):
        """Per rank, its diagonal document parts in local order as runs: n >= 1 for n consecutive parts of at most
        ``window`` tokens, 0 for a longer part (a Window piece)."""
        starts = np.flatnonzero(np.diff(restarts))  # tokens that begin a document
        out = [[] for _ in range(world)]
        for s0, s1, r in segs:
            inner = starts[np.searchsorted(starts, s0, side="right"):np.searchsorted(starts, s1)]
            bounds = [s0, *inner.tolist(), s1]
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b - a > window:
                    out[r].append(0)
                elif out[r] and out[r][-1] > 0:
                    out[r][-1] += 1
                else:
                    out[r].append(1)
        return out

    def time(self, step: float) -> list[float]:
        m = MODEL
        return [w + m.PIECE_TIME * p + m.DENSE_TIME * d + m.VARLEN_TIME * v + step * (n - 1)
                for w, p, d, v, n in zip(self.work, self.pieces, self.dense, self.varlen, self.steps)]

    @property
    def max_over_mean(self) -> float:
        return max(self.work) / (sum(self.work) / len(self.work))


__all__ = ["segments", "to_table", "refine", "loads", "Estimate"]
