"""Communication used by the sequence-parallel algorithms. Process groups are always arguments.

``RingComm(group)`` resolves its neighbours inside ``group`` (``dist.get_global_rank``), so a ring works
in any subgroup (the ring of USP, the sp group of dp × sp). Ops are queued with ``send_recv`` and issued
together by ``commit`` (one ``batch_isend_irecv``), then ``wait`` — issue before computing to overlap.

A ``group`` may also be an in-process group (an object with ``in_process = True``, ``rank``, ``world_size``,
``ring_comm()`` and ``p2p_exchange(sends, recvs)``): the tests run W simulated ranks as threads on one device
that way, passing the group in like a real one instead of patching this module.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .phase import phase


def _in_process(group) -> bool:
    return group is not None and getattr(group, "in_process", False) is True


def group_rank_world(group=None) -> tuple[int, int]:
    if _in_process(group):
        return group.rank, group.world_size
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class RingComm:
    def __new__(cls, group=None):
        if _in_process(group):  # the group brings its own ring (not a RingComm: __init__ is skipped)
            return group.ring_comm()
        return super().__new__(cls)

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError("sequence-parallel attention needs torch.distributed to be initialised "
                               "(accelerate launch / torchrun, or dist.init_process_group)")
        self.group = group
        self.rank, self.world_size = group_rank_world(group)
        nxt, prv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        if group is None:
            self.send_rank, self.recv_rank = nxt, prv
        else:
            self.send_rank = dist.get_global_rank(group, nxt)
            self.recv_rank = dist.get_global_rank(group, prv)
        self._ops: list = []
        self._reqs = None

    def send_recv(self, to_send: torch.Tensor, recv_buf: torch.Tensor | None = None,
                  reverse: bool = False) -> torch.Tensor:
        """Queue: send ``to_send`` to the next rank, receive the previous rank's into a new buffer.

        ``reverse=True`` runs the ring the other way (send to the previous rank).
        """
        to_send = to_send.contiguous()
        buf = torch.empty_like(to_send) if recv_buf is None else recv_buf
        dst, src = (self.recv_rank, self.send_rank) if reverse else (self.send_rank, self.recv_rank)
        self._ops.append(dist.P2POp(dist.isend, to_send, dst, group=self.group))
        self._ops.append(dist.P2POp(dist.irecv, buf, src, group=self.group))
        return buf

    def commit(self) -> None:
        if self._reqs is not None:
            raise RuntimeError("RingComm.commit called twice without wait")
        with phase("ring step"):
            self._reqs = dist.batch_isend_irecv(self._ops) if self._ops else []

    def wait(self) -> None:
        with phase("ring step"):
            for r in self._reqs or []:
                r.wait()
        self._reqs, self._ops = None, []


def p2p_exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group=None):
    """Issue arbitrary point-to-point sends/recvs (peers are ranks *inside* ``group``); returns requests."""
    if _in_process(group):
        return group.p2p_exchange(sends, recvs)
    def glob(r):
        return r if group is None else dist.get_global_rank(group, r)
    ops = [dist.P2POp(dist.isend, t.contiguous(), glob(p), group=group) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, glob(p), group=group) for t, p in recvs]
    with phase("ring step (p2p)"):
        return dist.batch_isend_irecv(ops) if ops else []


def all_to_all_4d(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Split ``x`` into W pieces along ``scatter_dim``, exchange, concatenate received along ``gather_dim``.

    Ulysses uses it as (B, S/W, H, D) -> (B, S, H/W, D) (scatter heads, gather sequence) and back.
    """
    _, world = group_rank_world(group)
    if world == 1:
        return x
    inputs = [t.contiguous() for t in x.chunk(world, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    with phase("all-to-all"):
        dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all_4d(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        s, g = ctx.dims
        return all_to_all_4d(grad, g, s, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Differentiable ``all_to_all_4d``."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)
