"""One in-process communicator for single-device simulations of W ranks (threads), injected as the ``group``
argument of the modes' forward/backward (easy_context/comm.py honours ``in_process`` groups): no module globals
are patched. One GPU cannot host W NCCL ranks, so this is how the bf16 kernel-level checks run on the H200, and
how W=8 is checked cheaply on CPU. Forward/backward are called directly (autograd would run every thread's
backward on the one device thread and deadlock the ring)."""
from __future__ import annotations

import queue

import torch

from tests.harness import run_threads


class _Req:
    def __init__(self, fifo, buf):
        self.fifo, self.buf = fifo, buf

    def wait(self):
        self.buf.copy_(self.fifo.get(timeout=60))


class ThreadGroup:
    """Rank ``rank`` of an in-process group: one FIFO per (src, dst) pair, matched in posting order like P2P."""

    in_process = True

    def __init__(self, hub: dict, rank: int, world_size: int):
        self.hub, self.rank, self.world_size = hub, rank, world_size

    def _put(self, dst, t):
        self.hub["sent_shapes"].append(tuple(t.shape))  # what went over the "wire" (append is thread-safe)
        self.hub[(self.rank, dst)].put(t.contiguous().clone())

    def p2p_exchange(self, sends, recvs):
        for t, dst in sends:
            self._put(dst, t)
        return [_Req(self.hub[(src, self.rank)], buf) for buf, src in recvs]

    def ring_comm(self):
        return _ThreadRing(self)


class _ThreadRing:
    """Stands in for comm.RingComm: queue with send_recv, issue with commit, then wait."""

    def __init__(self, group: ThreadGroup):
        self.g, self.rank, self.world_size = group, group.rank, group.world_size
        self._sends, self._reqs = [], []

    def send_recv(self, to_send, recv_buf=None, reverse=False):
        w = self.world_size
        dst, src = ((self.rank - 1) % w, (self.rank + 1) % w) if reverse else ((self.rank + 1) % w, (self.rank - 1) % w)
        buf = torch.empty_like(to_send) if recv_buf is None else recv_buf
        self._sends.append((to_send, dst))
        self._reqs.append(_Req(self.g.hub[(src, self.rank)], buf))
        return buf

    def commit(self):
        for t, dst in self._sends:
            self.g._put(dst, t)
        self._sends = []

    def wait(self):
        for r in self._reqs:
            r.wait()
        self._reqs = []


def run_simulated(world: int, fn_per_rank):
    """Run ``fn_per_rank(rank, group)`` on ``world`` threads sharing one in-process group;
    returns (results in rank order, shapes of every tensor sent)."""
    import threading
    hub = {(s, d): queue.Queue() for s in range(world) for d in range(world)}
    hub["sent_shapes"] = []
    results = run_threads(world, lambda r: fn_per_rank(r, ThreadGroup(hub, r, world)), threading.local())
    return results, hub["sent_shapes"]
