"""Attention over a dispatched packed row (dispatch.py): every rank's q chunks against exactly the kv they need.

Layout: rank r holds the chunks ``dispatch.owners[r]`` (m chunks of c tokens, increasing global order); q/out/dq
``(B, m c, Hq, D)``, k/v/dk/dv ``(B, m c, Hkv, D)``, lse fp32 ``(B, Hq, m c)``. A rank computes every score of its
own queries (no helpers), so the dispatch's cost balance is the work balance.

Steps s = 0..W-1 (the ring's shift pattern, but point to point): at step s rank r computes its q rows against the
kv of ``src = (r - s) % W``, and only against the chunks of src that one of its queries attends to
(``DispatchPlan.need``: kv chunk h is needed by q chunk g iff h < g and the last token of h and the first token of
g lie in one document within the window -- documents are contiguous, so that pair decides). Those chunks travel
directly src -> r; a step with nothing needed sends nothing and computes nothing. Step 0 (own kv) is the diagonal:
it covers every q row, so it initialises the fp32 accumulators.

Forward: step s+1's kv is posted (``p2p_exchange``) before step s is computed (overlap), one exchange in flight.
Backward: the same kv exchange; the dk/dv a rank computes for src's chunks go straight back to src one step later
(also overlapped), in k's dtype -- the kernel's own output dtype, so nothing is lost: each partial is added once,
into src's fp32 accumulators (the fixed ring must carry fp32 sums from hop to hop instead). Message order per peer pair is the step
order on both sides, so every send meets its receive.
"""
from __future__ import annotations

import torch

from . import kernels
from .comm import group_rank_world, p2p_exchange
from .dispatch import check_world


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class DispatchPlan:
    """Who needs which chunks of whom (pure; shared by the attention, the benchmark and the tests)."""

    def __init__(self, docs, dispatch):
        self.docs, self.dispatch = docs, dispatch
        w, c = dispatch.world, dispatch.chunk_len
        d = docs.doc_ids
        win = docs.window
        firsts = torch.arange(dispatch.chunks) * c
        lasts = firsts + c - 1
        same = (d[:, lasts][:, :, None] == d[:, firsts][:, None, :]).any(0)  # [h, g]: last of h, first of g
        gap = firsts[None, :] - lasts[:, None]                             # first of g - last of h
        ok = same & (gap > 0)
        if win is not None:
            ok &= gap < win
        self.needs = ok  # [h, g]: kv chunk h is needed by q chunk g (h != g)
        self.need = {}   # (dst, src) -> src's local slots dst needs, increasing
        for dst in range(w):
            for src in range(w):
                if src == dst:
                    continue
                gs = list(dispatch.owners[dst])
                self.need[dst, src] = tuple(j for j, h in enumerate(dispatch.owners[src]) if bool(ok[h, gs].any()))
        self._blocks, self._rows = {}, {}

    def local_rows(self, dst: int, src: int) -> torch.Tensor | None:
        """Rows of src's local tensors that dst needs (None: nothing; step 0 is handled by the caller)."""
        key = (dst, src)
        if key not in self._rows:
            slots, c = self.need[key], self.dispatch.chunk_len
            self._rows[key] = torch.cat([torch.arange(j * c, (j + 1) * c) for j in slots]) if slots else None
        return self._rows[key]

    def block(self, rank: int, src: int):
        """packing.BlockDocs of rank's q rows vs what it uses of src's kv (all of it for src == rank)."""
        key = (rank, src)
        if key not in self._blocks:
            rows = self.dispatch.rows
            k_idx = rows(src) if src == rank else rows(src)[self.local_rows(rank, src)]
            self._blocks[key] = self.docs.block(rows(rank), k_idx)
        return self._blocks[key]

    def received_tokens(self, rank: int) -> int:
        """kv tokens ``rank`` receives in one forward (the backward receives them again, and sends back dk/dv)."""
        w = self.dispatch.world
        return sum(len(self.need[rank, src]) for src in range(w) if src != rank) * self.dispatch.chunk_len


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
    rows = plan.local_rows(dst, rank)
    if rows is not None:
        rows = rows.to(k.device)
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
    """(out in q's dtype, lse fp32 (B, Hq, m c)) of this rank's rows of a dispatched packed row."""
    rank, world = group_rank_world(group)
    plan = plan_of(docs, world)
    k, v = k.contiguous(), v.contiguous()
    pending = _post_kv(plan, rank, world, 1, k, v, group) if world > 1 else None
    o0, l0 = kernels.attn_forward(q, k, v, True, softmax_scale, backend, docs=plan.block(rank, rank))
    out, lse = o0.to(_acc(q)), l0.to(_acc(q)).contiguous()
    for s in range(1, world):
        bufs = _wait(pending)
        pending = _post_kv(plan, rank, world, s + 1, k, v, group) if s + 1 < world else None
        if bufs is None:
            continue  # nothing of src is needed here: no transfer, no kernel
        res = kernels.attn_forward(q, bufs[0], bufs[1], True, softmax_scale, backend,
                                   docs=plan.block(rank, (rank - s) % world))
        if res is not None:
            kernels.merge_attn_out(out, lse, *res)
    return out.to(q.dtype), lse


def dispatch_backward(dout, q, k, v, out, lse, softmax_scale, group=None, backend=None, docs=None):
    """(dq, dk, dv) of this rank's q and own k/v, from the saved inputs and the final out/lse."""
    rank, world = group_rank_world(group)
    plan = plan_of(docs, world)
    k, v, dout = k.contiguous(), v.contiguous(), dout.contiguous()
    acc = _acc(q)
    pending = _post_kv(plan, rank, world, 1, k, v, group) if world > 1 else None
    dq, dk, dv = (t.to(acc) for t in kernels.attn_backward(dout, q, k, v, out, lse, True, softmax_scale, backend,
                                                         docs=plan.block(rank, rank)))
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
            res = kernels.attn_backward(dout, q, bufs[0], bufs[1], out, lse, True, softmax_scale, backend,
                                        docs=plan.block(rank, src))
            if res is None:  # (a needed chunk always gives a piece; kept for safety: the owner expects grads)
                res = (None, torch.zeros_like(bufs[0]), torch.zeros_like(bufs[1]))
            if res[0] is not None:
                dq += res[0]
            sends = [(res[1].to(k.dtype).contiguous(), src), (res[2].to(v.dtype).contiguous(), src)]
        mine = plan.local_rows(dst, rank)  # dst computed grads of these rows of mine at this step
        recvs, got = [], None
        if mine is not None:
            mine = mine.to(k.device)
            shape = (k.shape[0], len(mine)) + tuple(k.shape[2:])
            got = (mine, (torch.empty(shape, dtype=k.dtype, device=k.device),
                          torch.empty(shape, dtype=v.dtype, device=k.device)))
            recvs = [(got[1][0], dst), (got[1][1], dst)]
        land(back)
        back = (p2p_exchange(sends, recvs, group), got, sends)
    land(back)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


__all__ = ["DispatchPlan", "plan_of", "dispatch_forward", "dispatch_backward"]
