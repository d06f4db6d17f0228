"""Attention over a dispatched packed row (dispatch/plan.py): every rank's q chunks against exactly the kv they need.

Layout: rank r holds the chunks ``dispatch.owners[r]`` (increasing global order, n = L / W rows in all); q/out/dq
``(B, n, Hq, D)``, k/v/dk/dv ``(B, n, Hkv, D)``, lse fp32 ``(B, Hq, n)``. A rank computes every score of its
own queries (no helpers), so the dispatch's cost balance is the work balance.

Steps s = 0..W-1 (the ring's shift pattern, but point to point): at step s rank r computes its q rows against the
kv of ``src = (r - s) % W``, and only against the chunks of src that one of its queries attends to
(``DispatchPlan.need``: documents are contiguous, so of a kv chunk only the document of its last token can reach
later q rows; r needs that document's rows of the chunk when r holds a later row of it, within the window). Those
rows travel directly src -> r; a step with nothing needed sends nothing and computes nothing. Step 0 (own kv) is the
diagonal: it covers every q row.

Forward: step s+1's kv is posted (``p2p_exchange``) before step s is computed (overlap), one exchange in flight.
Backward: the same kv exchange; the dk/dv a rank computes for src's chunks go straight back to src one step later
(also overlapped), in k's dtype -- the kernel's own output dtype, so nothing is lost: each partial is added once,
into src's fp32 accumulators (the fixed ring must carry fp32 sums from hop to hop instead). Message order per peer pair is the step
order on both sides, so every send meets its receive.
"""
from __future__ import annotations

import torch

from .. import kernels
from ..comm import group_rank_world, p2p_exchange
from .table import check_world


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class DispatchPlan:
    """Who needs which rows of whom (pure; shared by the attention, the benchmark and the tests)."""

    def __init__(self, docs, dispatch):
        self.docs, self.dispatch = docs, dispatch
        w, n = dispatch.world, dispatch.length
        d = docs.doc_ids                                                    # (B, L)
        idx = torch.arange(n)
        cuts = torch.tensor(dispatch.cuts)
        starts, stops = cuts[:-1], cuts[1:]
        owner = torch.empty(n, dtype=torch.long)
        for r, own in enumerate(dispatch.owners):
            for g in own:
                owner[slice(*dispatch.span(g))] = r
        local_start = {}
        for own in dispatch.owners:
            at = 0
            for g in own:
                local_start[g] = at
                at += dispatch.cuts[g + 1] - dispatch.cuts[g]
        last = stops - 1
        d = d.contiguous()
        at_last = d[:, last].contiguous()                                   # (B, C): document of each chunk's last row
        first = torch.stack([torch.searchsorted(row, x) for row, x in zip(d, at_last)])      # its first row
        end = torch.stack([torch.searchsorted(row, x, right=True) for row, x in zip(d, at_last)])  # one past its last
        # kv chunk h of src is needed by dst only through the document of its last token, and only if that document
        # goes on into rows of dst after h: then dst needs h's rows of that document, from the later of the document's
        # start and (with a window) the window of dst's first row after h -- nothing else of h
        need = {}  # (dst, src) -> src-local (start, stop) row ranges dst needs, increasing
        after = last + 1  # <= n: next_mine has an entry for n
        for dst in range(w):
            mine = torch.cat([torch.where(owner == dst, idx, n), torch.tensor([n])])
            next_mine = torch.cummin(mine.flip(0), 0).values.flip(0)       # dst's first row >= i (n: none)
            i_min = next_mine[after].expand_as(first)                       # (B, C): dst's first row after h
            ok = (i_min < end) & (owner[last] != dst)
            lo = torch.maximum(first, starts.expand_as(first))
            if docs.window is not None:
                lo = torch.maximum(lo, i_min - docs.window + 1)
                ok &= lo <= last
            lo = torch.where(ok, lo, n).min(0).values                       # union over batch rows
            for h in ok.any(0).nonzero().flatten().tolist():
                src = int(owner[last[h]])
                a, b = dispatch.span(h)
                need.setdefault((dst, src), []).append((local_start[h] + int(lo[h]) - a, local_start[h] + b - a))
        self.need = {(dst, src): tuple(need.get((dst, src), ())) for dst in range(w) for src in range(w) if src != dst}
        self._blocks, self._rows, self._rows_on = {}, {}, {}

    def local_rows(self, dst: int, src: int) -> torch.Tensor | None:
        """Rows of src's local tensors that dst needs (None: nothing; step 0 is handled by the caller)."""
        key = (dst, src)
        if key not in self._rows:
            spans = self.need.get(key)
            self._rows[key] = torch.cat([torch.arange(a, b) for a, b in spans]) if spans else None
        return self._rows[key]

    def rows_on(self, dst: int, src: int, device) -> torch.Tensor | None:
        """``local_rows`` on ``device``, copied once per plan (every layer's forward and backward index with them).
        Non-blocking: a blocking copy from pageable host memory would synchronise the stream at every ring step."""
        key = (dst, src, device)
        if key not in self._rows_on:
            rows = self.local_rows(dst, src)
            self._rows_on[key] = None if rows is None else rows.to(device, non_blocking=True)
        return self._rows_on[key]

    def block(self, rank: int, src: int):
        """packing.BlockDocs of rank's q rows vs what it uses of src's kv (all of it for src == rank)."""
        key = (rank, src)
        if key not in self._blocks:
            rows = self.dispatch.rows
            k_idx = rows(src) if src == rank else rows(src)[self.local_rows(rank, src)]
            self._blocks[key] = self.docs.block(rows(rank), k_idx)
        return self._blocks[key]

    def steps(self, rank: int) -> int:
        """Ring steps ``rank`` computes (its own kv, and every src it needs rows of)."""
        return 1 + sum(1 for (dst, _src), spans in self.need.items() if dst == rank and spans)

    def received_tokens(self, rank: int) -> int:
        """kv tokens ``rank`` receives in one forward (the backward receives them again, and sends back dk/dv)."""
        return sum(b - a for (dst, _src), spans in self.need.items() if dst == rank for a, b in spans)


def plan_of(docs, world: int) -> DispatchPlan:
    """The plan of ``docs`` (carrying its dispatch), cached on the Documents (every layer asks for the same one)."""
    cache = docs.__dict__.setdefault("_dispatch_plans", {})
    if world not in cache:
        check_world(docs.dispatch, world, docs.length, "dispatched attention")
        cache[world] = DispatchPlan(docs, docs.dispatch)
    return cache[world]


def _post_kv(plan, rank, world, s, k, v, group):
    """Step s's kv exchange: mine to (rank + s) where it needs them, (rank - s)'s to me where I need them."""
    dst, src = (rank + s) % world, (rank - s) % world
    sends, recvs, bufs = [], [], None
    rows = plan.rows_on(dst, rank, k.device)
    if rows is not None:
        sends = [(k.index_select(1, rows), dst), (v.index_select(1, rows), dst)]
    rows = plan.local_rows(rank, src)
    if rows is not None:
        shape = (k.shape[0], len(rows)) + tuple(k.shape[2:])
        bufs = (torch.empty(shape, dtype=k.dtype, device=k.device), torch.empty(shape, dtype=v.dtype, device=v.device))
        recvs = [(bufs[0], src), (bufs[1], src)]
    return p2p_exchange(sends, recvs, group), bufs, sends


def _wait(pending):
    for r in pending[0]:
        r.wait()
    return pending[1]


def dispatch_forward(q, k, v, softmax_scale, group=None, backend=None, docs=None):
    """(out in q's dtype, lse fp32 (B, Hq, n)) of this rank's rows of a dispatched packed row. Every step merges its
    pieces straight into the fp32 accumulators (``into=``): a step costs its pieces' rows, not full-size passes."""
    rank, world = group_rank_world(group)
    plan = plan_of(docs, world)
    k, v = k.contiguous(), v.contiguous()
    pending = _post_kv(plan, rank, world, 1, k, v, group) if world > 1 else None
    acc = (torch.zeros(q.shape, dtype=_acc(q), device=q.device),
           torch.full((q.shape[0], q.shape[2], q.shape[1]), -float("inf"), dtype=_acc(q), device=q.device))
    kernels.attn_forward(q, k, v, True, softmax_scale, backend, docs=plan.block(rank, rank), into=acc)
    for s in range(1, world):
        bufs = _wait(pending)
        pending = _post_kv(plan, rank, world, s + 1, k, v, group) if s + 1 < world else None
        if bufs is None:
            continue  # nothing of src is needed here: no transfer, no kernel
        kernels.attn_forward(q, bufs[0], bufs[1], True, softmax_scale, backend,
                             docs=plan.block(rank, (rank - s) % world), into=acc)
    return acc[0].to(q.dtype), acc[1]


def dispatch_backward(dout, q, k, v, out, lse, softmax_scale, group=None, backend=None, docs=None):
    """(dq, dk, dv) of this rank's q and own k/v, from the saved inputs and the final out/lse."""
    rank, world = group_rank_world(group)
    plan = plan_of(docs, world)
    k, v, dout = k.contiguous(), v.contiguous(), dout.contiguous()
    acc = _acc(q)
    pending = _post_kv(plan, rank, world, 1, k, v, group) if world > 1 else None
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    kernels.attn_backward(dout, q, k, v, out, lse, True, softmax_scale, backend, docs=plan.block(rank, rank),
                          into=(dq, dk, dv))
    back = None  # the dk/dv exchange of the previous step: (requests, (rows of mine, bufs), sends)

    def land(back):
        if back is None:
            return
        got = _wait(back)
        if got is not None:
            rows, bufs = got
            dk.index_add_(1, rows, bufs[0].to(dk.dtype))
            dv.index_add_(1, rows, bufs[1].to(dv.dtype))

    for s in range(1, world):
        bufs = _wait(pending)
        pending = _post_kv(plan, rank, world, s + 1, k, v, group) if s + 1 < world else None
        src, dst = (rank - s) % world, (rank + s) % world
        sends = []
        if bufs is not None:
            # src's kv grads of this step, accumulated in fp32 then sent once in k's dtype (a needed row always has a
            # piece; an untouched buffer would still be zeros, which its owner expects)
            gk, gv = (torch.zeros(b.shape, dtype=acc, device=b.device) for b in bufs)
            kernels.attn_backward(dout, q, bufs[0], bufs[1], out, lse, True, softmax_scale, backend,
                                  docs=plan.block(rank, src), into=(dq, gk, gv))
            sends = [(gk.to(k.dtype), src), (gv.to(v.dtype), src)]
        mine = plan.rows_on(dst, rank, k.device)  # dst computed grads of these rows of mine at this step
        recvs, got = [], None
        if mine is not None:
            shape = (k.shape[0], len(mine)) + tuple(k.shape[2:])
            got = (mine, (torch.empty(shape, dtype=k.dtype, device=k.device),
                          torch.empty(shape, dtype=v.dtype, device=k.device)))
            recvs = [(got[1][0], dst), (got[1][1], dst)]
        land(back)
        back = (p2p_exchange(sends, recvs, group), got, sends)
    land(back)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


__all__ = ["DispatchPlan", "plan_of", "dispatch_forward", "dispatch_backward"]
