"""ParallelLayout: the one object that owns how ranks split into data and sequence parallelism.

    world = dp x sp,   sp = ring x ulysses (usp_attn; other sp modes: ring = sp or ulysses = sp)
    rank  = dp_rank * sp + sp_rank          (sp ranks consecutive: the sp collectives stay in a node)
    sp_rank = ring_rank * ulysses + ulysses_rank                       (usp/layout.py's order)

Build it once, after the process group exists, on every rank (``new_group`` is collective: every rank
creates every group in the same order). Groups spanning the whole world are ``None`` (the default group).
Modelled on torchtitan's ``ParallelDims`` (validation printing the whole equation) and picotron's
``ProcessGroupManager`` (compact ``__str__``).

    layout = ParallelLayout.build("usp_attn", sp_size=4, ring_degree=2)   # 8 ranks: DP(2)-SP(4: R2xU2)
    apply_seq_parallel_monkey_patch("usp_attn", model, layout=layout)
    batch = layout.shard(input_ids)   # this rank's piece in the mode's layout
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .registry import get_algo


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_degrees(seq_algo: str, world_size: int, sp_size: int | None = None, ring_degree: int | None = None,
                 dp_size: int | None = None) -> tuple[int, int, int, int]:
    """Pure validation: returns (dp, sp, ring, ulysses) or raises ValueError with the fix."""
    get_algo(seq_algo)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if seq_algo == "data_parallel":
        if sp_size not in (None, 1) or ring_degree not in (None, 1):
            raise ValueError(f"data_parallel has no sequence parallelism (got sp_size={sp_size}, "
                             f"ring_degree={ring_degree}); drop them or pick a sequence-parallel mode")
        sp = 1
    else:
        sp = sp_size
        if sp is None:  # default: one sp group over the world, or what is left after dp_size
            if dp_size is not None and (dp_size < 1 or world_size % dp_size != 0):
                raise ValueError(f"dp_size ({dp_size}) must divide world_size {world_size} (dp x sp = world_size); "
                                 f"valid dp sizes: {_divisors(world_size)}")
            sp = world_size if dp_size is None else world_size // dp_size
        if sp < 1 or world_size % sp != 0:
            raise ValueError(
                f"dp x sp = world_size has no whole dp for sp({sp}): world_size {world_size} / {sp} = "
                f"{world_size / sp if sp else float('inf'):.3g}; sp_size must divide {world_size}, "
                f"valid sp sizes: {_divisors(world_size)}")
    dp = world_size // sp if dp_size is None else dp_size
    if dp * sp != world_size:
        raise ValueError(f"dp({dp}) x sp({sp}) = {dp * sp} != world_size {world_size}; "
                         f"choose dp = world_size / sp = {world_size / sp:g} or another sp in {_divisors(world_size)}")
    if seq_algo == "usp_attn":
        ring = sp if ring_degree is None else int(ring_degree)
        if ring < 1 or sp % ring != 0:
            raise ValueError(f"usp_attn needs ring x ulysses = sp({sp}), so ring_degree ({ring_degree}) must "
                             f"divide {sp}; valid ring degrees: {_divisors(sp)}")
        return dp, sp, ring, sp // ring
    if ring_degree not in (None, 1) and seq_algo != "data_parallel":
        raise ValueError(f"ring_degree={ring_degree} only applies to usp_attn (ring x ulysses); "
                         f"drop it for {seq_algo} or use usp_attn")
    if seq_algo == "ulysses_attn":
        return dp, sp, 1, sp
    return dp, sp, sp, 1  # ring-style modes (zigzag_ring_attn, dist_flash_attn) and data_parallel


@dataclass
class ParallelLayout:
    seq_algo: str
    world_size: int
    rank: int
    dp: int
    sp: int
    ring: int
    ulysses: int
    dp_group: object = None
    sp_group: object = None
    ring_group: object = None
    ulysses_group: object = None
    _all_groups: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, seq_algo: str, sp_size: int | None = None, ring_degree: int | None = None,
              world_size: int | None = None, *, dp_size: int | None = None, rank: int | None = None):
        """Validate the degrees and create every process group once (collective over the world).

        sp_size: ranks sharing one sequence (default: the world). ring_degree: usp_attn's ring size
        (default: sp, i.e. no Ulysses split, as ``prepare_seq_parallel_inputs`` does). world_size/rank
        default to the process group's; without an initialised process group nothing is created (the
        groups stay None) — useful for world_size 1 and for planning/tests.
        """
        import torch.distributed as dist
        live = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if live else 1
        elif live and world_size != dist.get_world_size():
            raise ValueError(f"world_size {world_size} != the process group's {dist.get_world_size()}; "
                             "omit world_size to use the process group's")
        if rank is None:
            rank = dist.get_rank() if live else 0
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        dp, sp, ring, uly = plan_degrees(seq_algo, world_size, sp_size, ring_degree, dp_size)
        layout = cls(seq_algo, world_size, rank, dp, sp, ring, uly)
        if live and world_size > 1:
            layout._make_groups()
        return layout

    def _rank_sets(self) -> dict[str, list[list[int]]]:
        """Every group's ranks, in the creation order all processes follow."""
        sp, u, r = self.sp, self.ulysses, self.ring
        return {
            "dp": [[d * sp + s for d in range(self.dp)] for s in range(sp)],
            "sp": [[d * sp + s for s in range(sp)] for d in range(self.dp)],
            "ulysses": [[d * sp + i * u + j for j in range(u)] for d in range(self.dp) for i in range(r)],
            "ring": [[d * sp + i * u + j for i in range(r)] for d in range(self.dp) for j in range(u)],
        }

    def _make_groups(self) -> None:
        import torch.distributed as dist
        made: dict[tuple[int, ...], object] = {}
        mine = {}
        for kind, sets in self._rank_sets().items():
            if kind in ("ulysses", "ring") and self.seq_algo != "usp_attn":
                continue
            for ranks in sets:
                key = tuple(ranks)
                if key not in made:  # the same rank set is one group (e.g. sp == ring when U == 1)
                    made[key] = None if len(ranks) == self.world_size else dist.new_group(list(ranks))
                if self.rank in ranks:
                    mine[kind] = made[key]
        self.dp_group, self.sp_group = mine["dp"], mine["sp"]
        self.ring_group, self.ulysses_group = mine.get("ring"), mine.get("ulysses")
        self._all_groups = made

    # ------------------------------------------------------------------ coordinates
    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.ulysses

    @property
    def layout_kw(self) -> dict:
        """Extra kwargs of the mode's layout (``ring_degree`` for usp_attn)."""
        return get_algo(self.seq_algo).layout_kw(ring_degree=self.ring)

    @property
    def seq_multiple(self) -> int:
        """The global sequence length must be a multiple of this: zigzag cuts 2*ring equal chunks, the
        contiguous/Ulysses split needs sp equal pieces (usp: 2 * ring * ulysses)."""
        return get_algo(self.seq_algo).layout_module().seq_multiple(self.sp, **self.layout_kw)

    def check_seq_len(self, length: int) -> None:
        m = self.seq_multiple
        if length % m != 0:
            lo = length - length % m
            raise ValueError(f"{self}: sequence length {length} must be a multiple of {m}; "
                             f"use {lo or m} or {lo + m}")

    def check_heads(self, num_q_heads: int, num_kv_heads: int | None = None) -> None:
        """Fail before any collective if the model's heads do not split over the Ulysses degree."""
        if self.ulysses == 1:
            return
        from .ulysses_attn.attention import kv_replication
        kv_replication(num_q_heads, num_kv_heads or num_q_heads, self.ulysses,
                       what=f"{self.seq_algo} ({self})")

    # ------------------------------------------------------------------ use
    def attn_groups(self, seq_algo: str | None = None) -> dict:
        """Process-group kwargs of the attention function (what apply_seq_parallel_monkey_patch binds)."""
        seq_algo = seq_algo or self.seq_algo
        algo = get_algo(seq_algo)
        if seq_algo != self.seq_algo and algo.group_kwargs:
            raise ValueError(f"this layout was built for {self.seq_algo}, not {seq_algo}; "
                             f"build one with ParallelLayout.build({seq_algo!r}, ...)")
        if seq_algo == "usp_attn":
            return {"ring_group": self.ring_group, "ulysses_group": self.ulysses_group}
        return {"group": self.sp_group} if algo.group_kwargs else {}

    def shard(self, tensor: torch.Tensor, dim: int = 1, positions: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of ``tensor`` along ``dim`` (the sp split; dp ranks hold other samples).
        ``positions``: the batch's global position ids (packed rows take the balanced k-pair layout)."""
        from .api import shard_sequence
        return shard_sequence(self.seq_algo, tensor, self.sp_rank, self.sp, dim=dim, positions=positions,
                              **self.layout_kw)

    def prepare_inputs(self, input_ids, position_ids, target_ids, device) -> dict:
        """``prepare_seq_parallel_inputs`` with this layout's sp rank, size and degrees."""
        from .api import prepare_seq_parallel_inputs
        return prepare_seq_parallel_inputs(self.seq_algo, input_ids, position_ids, target_ids, self.sp_rank,
                                           self.sp, device, **self.layout_kw)

    def __str__(self) -> str:
        if self.seq_algo == "usp_attn":
            sp = f"SP({self.sp}: R{self.ring}\u00d7U{self.ulysses})"
        else:
            sp = f"SP({self.sp})"
        return f"DP({self.dp})-{sp}"

    def describe(self) -> str:
        """``__str__`` plus this rank's coordinates, for logs."""
        coords = f"rank {self.rank}: dp {self.dp_rank}, sp {self.sp_rank}"
        if self.seq_algo == "usp_attn":
            coords += f" (ring {self.ring_rank}, ulysses {self.ulysses_rank})"
        return f"{self.seq_algo} {self} [{coords}]"


__all__ = ["ParallelLayout", "plan_degrees"]
