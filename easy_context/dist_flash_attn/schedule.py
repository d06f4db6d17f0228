"""The load-balanced causal schedule of LightSeq / DistFlashAttn (Li et al. 2023), as pure logic.

Contiguous layout: rank r holds chunk r of W, so under a causal mask q_r needs kv_0 .. kv_r — rank W-1
has W blocks of work and rank 0 one. LightSeq's idea: ranks that run out of their own work "help" the
late ranks by computing the late rank's queries against their *own* keys/values and sending the partial
(out, lse) back to be merged by the owner. With T = W/2 steps after the diagonal:

  step 0        every rank: causal block (q_r, kv_r)
  step t=1..T   owner  (r >= t):            (q_r, kv_{r-t})          kv arrives from rank r-t
                helper (r <  t, t < T):     (q_{r-t+W}, kv_r)        q arrives from rank r-t+W,
                                                                     (out, lse) go back to it
                idle   (r <  t, t = T)

Owner o computes kv_{o-1} .. kv_{o-T} itself; helpers cover kv_0 .. kv_{o-T-1} (helper r = o+t-W at
steps t = W-o .. T-1). Every rank runs W/2 - 1 or W/2 off-diagonal blocks plus its diagonal: no rank does
more than one block more than another (total W(W-1)/2 off-diagonal blocks, like any exact method).
At step t rank r only talks to r±t (mod W): it receives from r-t what its block needs and sends to
r+t what that rank's block needs — one P2P pair per step, the same peer pattern for q and kv.

Everything here is a pure function of (rank, W): the forward and the backward derive their messages
from it, ``tests/test_dist_flash.py`` counts work with it, and the GPU simulation benchmark replays it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    """One attention block run by some rank at ``step``: queries of ``q_rank`` vs keys/values of ``kv_rank``."""
    step: int
    q_rank: int
    kv_rank: int

    @property
    def causal(self) -> bool:  # only the diagonal block is masked; every other needed block is full
        return self.q_rank == self.kv_rank

    def role(self, rank: int) -> str:
        """'diag' (own causal block), 'own' (own queries, remote kv) or 'help' (remote queries, own kv)."""
        if self.q_rank == self.kv_rank == rank:
            return "diag"
        if self.q_rank == rank:
            return "own"
        if self.kv_rank == rank:
            return "help"
        raise ValueError(f"block {self} is not run by rank {rank}")


@dataclass(frozen=True)
class Message:
    """Tensors of ``kind`` sent from ``src`` to ``dst`` for (``kind`` input) or from (result) ``step``."""
    step: int
    src: int
    dst: int
    kind: str  # forward: "kv", "q", "out_lse"; backward: "kv", "q_do_o_lse", "dkv", "dq"


def check_world_size(world_size: int) -> None:
    if world_size < 1 or (world_size > 1 and world_size % 2):
        raise ValueError(
            f"dist_flash_attn needs an even number of sequence-parallel ranks (or 1); got {world_size}. "
            "Use an even group size, or zigzag_ring_attn / ulysses_attn, which take any size")


def num_steps(world_size: int) -> int:
    """Steps of the schedule including the diagonal step 0."""
    check_world_size(world_size)
    return 1 if world_size == 1 else world_size // 2 + 1


def block_plan(rank: int, world_size: int) -> tuple[Block | None, ...]:
    """The block ``rank`` computes at each step (index = step; None = idle at that step)."""
    steps = num_steps(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    last = steps - 1
    plan: list[Block | None] = [Block(0, rank, rank)]
    for t in range(1, steps):
        if rank >= t:
            plan.append(Block(t, rank, rank - t))
        elif t < last:
            plan.append(Block(t, rank - t + world_size, rank))
        else:  # at the last step the helper's block would duplicate the owner's own kv_{o-T}
            plan.append(None)
    return tuple(plan)


def all_plans(world_size: int) -> list[tuple[Block | None, ...]]:
    return [block_plan(r, world_size) for r in range(world_size)]


def input_messages(step: int, world_size: int, backward: bool = False) -> list[Message]:
    """What must arrive before ``step``'s blocks can run (global list, same order on every rank)."""
    msgs = []
    for p, plan in enumerate(all_plans(world_size)):
        blk = plan[step]
        if blk is None or blk.causal:
            continue
        if blk.role(p) == "own":
            msgs.append(Message(step, blk.kv_rank, p, "kv"))
        else:
            msgs.append(Message(step, blk.q_rank, p, "q_do_o_lse" if backward else "q"))
    return msgs


def result_messages(step: int, world_size: int, backward: bool = False) -> list[Message]:
    """Partial results of ``step`` that belong to another rank (global list, same order on every rank).

    Forward: a helper returns (out, lse) to the owner of the queries. Backward: a helper returns dq to the
    owner of the queries, an owner returns dk/dv to the owner of the keys.
    """
    msgs = []
    for p, plan in enumerate(all_plans(world_size)):
        blk = plan[step]
        if blk is None or blk.causal:
            continue
        if blk.role(p) == "help":
            msgs.append(Message(step, p, blk.q_rank, "dq" if backward else "out_lse"))
        elif backward:
            msgs.append(Message(step, p, blk.kv_rank, "dkv"))
    return msgs


def work_counts(world_size: int) -> list[dict[str, int]]:
    """Per rank: number of diagonal, own and helper blocks (diagonal blocks cost half a full block)."""
    counts = []
    for r, plan in enumerate(all_plans(world_size)):
        c = {"diag": 0, "own": 0, "help": 0}
        for blk in plan:
            if blk is not None:
                c[blk.role(r)] += 1
        counts.append(c)
    return counts
