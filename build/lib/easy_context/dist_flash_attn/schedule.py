"""The load-balanced causal schedule of LightSeq / DistFlashAttn (Li et al. 2023), as pure logic.

Contiguous layout: rank r holds chunk r of W, so under a causal mask q_r needs kv_0 .. kv_r — rank W-1
has W blocks of work and rank 0 one. LightSeq's idea: ranks that run out of their own work "help" the
late ranks by computing the late rank's queries against their *own* keys/values and sending the partial
(out, lse) back to be merged by the owner. With T = W/2 steps after the diagonal:

  step 0        every rank: causal block (q_r, kv_r)
  step t=1..T   owner  (r >= t):            (q_r, kv_{r-t})          kv arrives from rank r-t
                helper (r <  t, t < T):     (q_{r-t+W}, kv_r)        q arrives from rank r-t+W,
                                                                     (out, lse) go back to it
  step T        rank r < T and owner o = r+T need the same block (q_o, kv_r): LightSeq leaves r idle;
                here (``split_last``) o runs the first half of q_o's rows and r the second half.

Owner o computes kv_{o-1} .. kv_{o-T} itself; helpers cover kv_0 .. kv_{o-T-1} (helper r = o+t-W at
steps t = W-o .. T-1). Work per rank (a causal diagonal block costs half a full one):
  LightSeq (split_last=False): W/2 - 1/2 or W/2 + 1/2 blocks — within one block, max/mean 1 + 1/W;
  split_last=True (default):   W/2 blocks on every rank — exactly balanced.
Total W²/2 blocks of (S/W)², i.e. the S²/2 of one causal kernel: no redundant work.
At step t rank r only talks to r±t (mod W): it receives from r-t what its block needs and sends to
r+t what that rank's block needs; at step T these are the same peer.

Everything here is a pure function of (rank, W): the forward and the backward derive their messages
from it, ``tests/test_dist_flash.py`` counts work with it, and the GPU simulation benchmark replays it
(``Block.q_rows(n)`` gives the rows of the q_rank's local chunk of length n a block covers).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    """One attention block run by some rank at ``step``: queries of ``q_rank`` vs keys/values of ``kv_rank``."""
    step: int
    q_rank: int
    kv_rank: int
    half: int | None = None  # None: all rows of q_rank's chunk; 0 / 1: its first / second half

    @property
    def causal(self) -> bool:  # only the diagonal block is masked; every other needed block is full
        return self.q_rank == self.kv_rank

    def q_rows(self, n: int) -> slice:
        """Rows of the q_rank's local chunk (length n) this block covers."""
        if self.half is None:
            return slice(0, n)
        return slice(0, n // 2) if self.half == 0 else slice(n // 2, n)

    @property
    def cost(self) -> float:
        """Work in units of one full (S/W)² block."""
        return (0.5 if self.causal else 1.0) * (1.0 if self.half is None else 0.5)

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


def block_plan(rank: int, world_size: int, split_last: bool = True) -> tuple[Block | None, ...]:
    """The block ``rank`` computes at each step (index = step; None = idle at that step).

    split_last=False is LightSeq's schedule (ranks < W/2 idle at the last step); the default splits the
    last step's blocks by query rows so every rank does the same work. The distributed functions turn it
    off for a local length of 1 (nothing to split).
    """
    steps = num_steps(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    last = steps - 1
    plan: list[Block | None] = [Block(0, rank, rank)]
    for t in range(1, steps):
        split = split_last and t == last
        if rank >= t:
            plan.append(Block(t, rank, rank - t, 0 if split else None))
        elif t < last:
            plan.append(Block(t, rank - t + world_size, rank))
        elif split:  # owner rank+T runs the first half of this very block
            plan.append(Block(t, rank + t, rank, 1))
        else:  # LightSeq: the helper's block would duplicate the owner's own kv_{o-T}
            plan.append(None)
    return tuple(plan)


def all_plans(world_size: int, split_last: bool = True) -> list[tuple[Block | None, ...]]:
    return [block_plan(r, world_size, split_last) for r in range(world_size)]


def input_messages(step: int, world_size: int, backward: bool = False, split_last: bool = True) -> list[Message]:
    """What must arrive before ``step``'s blocks can run (global list, same order on every rank).

    A helper receives only the rows of the owner's queries its block covers (``Block.q_rows``).
    """
    msgs = []
    for p, plan in enumerate(all_plans(world_size, split_last)):
        blk = plan[step]
        if blk is None or blk.causal:
            continue
        if blk.role(p) == "own":
            msgs.append(Message(step, blk.kv_rank, p, "kv"))
        else:
            msgs.append(Message(step, blk.q_rank, p, "q_do_o_lse" if backward else "q"))
    return msgs


def result_messages(step: int, world_size: int, backward: bool = False, split_last: bool = True) -> list[Message]:
    """Partial results of ``step`` that belong to another rank (global list, same order on every rank).

    Forward: a helper returns (out, lse) to the owner of the queries. Backward: a helper returns dq to the
    owner of the queries, an owner returns dk/dv to the owner of the keys.
    """
    msgs = []
    for p, plan in enumerate(all_plans(world_size, split_last)):
        blk = plan[step]
        if blk is None or blk.causal:
            continue
        if blk.role(p) == "help":
            msgs.append(Message(step, p, blk.q_rank, "dq" if backward else "out_lse"))
        elif backward:
            msgs.append(Message(step, p, blk.kv_rank, "dkv"))
    return msgs


def work_counts(world_size: int, split_last: bool = True) -> list[dict[str, float]]:
    """Per rank: number of diagonal, own and helper blocks, and the work ``cost`` in full-block units."""
    counts = []
    for r, plan in enumerate(all_plans(world_size, split_last)):
        c = {"diag": 0, "own": 0, "help": 0, "cost": 0.0}
        for blk in plan:
            if blk is not None:
                c[blk.role(r)] += 1
                c["cost"] += blk.cost
        counts.append(c)
    return counts
