"""ParallelLayout: the one object that owns how ranks split into data and sequence parallelism.

    world = dp x sp,   sp = ring x ulysses (the mode's split: usp_attn both; ring modes ring = sp; ulysses = sp)
    rank  = dp_rank * sp + sp_rank          (sp ranks consecutive: the sp collectives stay in a node)
    sp_rank = ring_rank * ulysses + ulysses_rank                       (usp/cut.py's order)

Build it once, after the process group exists, on every rank (``new_group`` is collective: every rank
creates every group in the same order). Groups spanning the whole world are ``None`` (the default group).
Modelled on torchtitan's ``ParallelDims`` (validation printing the whole equation) and picotron's
``ProcessGroupManager`` (compact ``__str__``).

    layout = ParallelLayout.build("usp_attn", sp_size=4, ring_degree=2)   # 8 ranks: DP(2)-SP(4: R2xU2)
    apply_seq_parallel_monkey_patch(model, layout)   # the layout carries the mode, its degrees and groups
    batch = layout.shard(input_ids)   # this rank's piece in the mode's cut (its token layout)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .mode import Mode, _divisors
from .registry import get_mode, modes_taking


def plan_degrees(seq_algo, world_size: int, sp_size: int | None = None, ring_degree: int | None = None,
                 dp_size: int | None = None) -> tuple[int, int, int, int]:
    """Pure validation: returns (dp, sp, ring, ulysses) or raises ValueError with the fix (the mode's split)."""
    return common_degrees(get_mode(seq_algo), world_size, sp_size, ring_degree, dp_size)


def common_degrees(mode: Mode, world_size: int, sp_size: int | None, ring_degree: int | None,
                   dp_size: int | None) -> tuple[int, int, int, int]:
    """(dp, sp, ring, ulysses) for ``mode`` on ``world_size`` ranks, or ValueError with the fix."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    sp = mode.sp_size(sp_size, ring_degree)
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
    if ring_degree not in (None, 1) and "ring_degree" not in mode.degree_kwargs:
        takers = " / ".join(modes_taking("ring_degree"))
        raise ValueError(f"ring_degree={ring_degree} only applies to {takers} (ring x ulysses); "
                         f"drop it for {mode.name} or use {takers}")
    ring, uly = mode.split(sp, ring_degree)
    return dp, sp, ring, uly


@dataclass
class ParallelLayout:
    mode: Mode  # a mode name is accepted and resolved here (the one place that turns names into modes)
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
    # packed rows: the sliding window of every attention layer of the model (hf.config.attention_window), so that the
    # dispatch's cost model caps each token's keys by it; None: full causal costs. Set before the first batch: the
    # planner (easy_context_train/plan_ahead.py) and prepare_inputs take it from layout_kw, so every rank plans alike
    dispatch_window: int | None = None
    # packed rows: ``prepare_inputs`` deals them by a cost-balanced table (dispatch/plan.py) that the model call carries
    # (``prepared.model_kwargs``); False (or EASY_CONTEXT_PACKED_LAYOUT=pairs at build): the fixed k-pair cut
    packed_dispatch: bool | None = None

    def __post_init__(self):
        self.mode = get_mode(self.mode)
        if self.packed_dispatch is None:
            from .dispatch.table import packed_layout
            self.packed_dispatch = packed_layout() == "dispatch"

    @property
    def seq_algo(self) -> str:
        """The mode's name (the public string form)."""
        return self.mode.name

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, mode, sp_size: int | None = None, ring_degree: int | None = None,
              world_size: int | None = None, *, dp_size: int | None = None, rank: int | None = None):
        """Validate the degrees and create every process group once (collective over the world).

        ``mode``: a ``Mode`` or a mode name.
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
        mode = get_mode(mode)
        dp, sp, ring, uly = common_degrees(mode, world_size, sp_size, ring_degree, dp_size)
        layout = cls(mode, world_size, rank, dp, sp, ring, uly)
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
        kinds = self.mode.group_kinds()
        for kind, sets in self._rank_sets().items():
            if kind not in kinds:
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
        """Extra kwargs of the mode's cut besides the sp size (``ring_degree`` for usp_attn; ``window``, the
        dispatch's cost window, when ``dispatch_window`` is set and the mode dispatches packed rows)."""
        kw = self.mode.layout_kw(ring_degree=self.ring)
        if self.dispatch_window is not None and self.mode.dispatches:
            kw["window"] = int(self.dispatch_window)
        return kw

    @property
    def seq_multiple(self) -> int:
        """The global sequence length must be a multiple of this: zigzag cuts 2*ring equal chunks, the
        contiguous/Ulysses split needs sp equal pieces (usp: 2 * ring * ulysses)."""
        return self.mode.seq_multiple(self.sp, **self.layout_kw)

    def check_seq_len(self, length: int) -> None:
        m = self.seq_multiple
        if length % m != 0:
            lo = length - length % m
            raise ValueError(f"{self}: sequence length {length} must be a multiple of {m}; "
                             f"use {lo or m} or {lo + m}")

    def check_heads(self, num_q_heads: int, num_kv_heads: int | None = None) -> None:
        """Fail before any collective if the model's heads do not split over the Ulysses degree."""
        self.mode.check_heads(num_q_heads, num_kv_heads or num_q_heads, self.ulysses, what=f"{self.mode.name} ({self})")

    # ------------------------------------------------------------------ use
    def attn_groups(self, mode=None) -> dict:
        """Process-group kwargs of the attention function (what apply_seq_parallel_monkey_patch binds).
        ``mode`` (a Mode or name) other than the layout's own: only a mode without groups (data_parallel)."""
        mode = self.mode if mode is None else get_mode(mode)
        if mode.name != self.mode.name and mode.group_kwargs:
            raise ValueError(f"this layout was built for {self.mode.name}, not {mode.name}; "
                             f"build one with ParallelLayout.build({mode.name!r}, ...)")
        return mode.attn_groups(self)

    def shard(self, tensor: torch.Tensor, dim: int = 1, positions: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of ``tensor`` along ``dim`` (the sp split; dp ranks hold other samples).
        ``positions``: the batch's global position ids (packed rows take the balanced k-pair cut)."""
        from .api import shard_sequence
        return shard_sequence(self.mode, tensor, self.sp_rank, self.sp, dim=dim, positions=positions,
                              **self.layout_kw)

    def prepare_inputs(self, input_ids, position_ids, target_ids, device, dispatch=None, **vlm):
        """``prepare_seq_parallel_inputs`` with this layout's sp rank, size and degrees; packed rows dispatched
        (``packed_dispatch``). ``dispatch``: the table when it was planned elsewhere (easy_context_train/plan_ahead.py), else
        planned here. ``vlm``: a VLM batch's model= / pixel_values= / grids (vlm/inputs.py). Pass
        ``**prepared.model_kwargs`` to the model (the table's route to the attention)."""
        from .api import prepare_seq_parallel_inputs
        if dispatch is None and self.packed_dispatch and self.mode.dispatches:
            dispatch = "auto"
        return prepare_seq_parallel_inputs(self.mode, input_ids, position_ids, target_ids, self.sp_rank,
                                           self.sp, device, dispatch=dispatch, **self.layout_kw, **vlm)

    def __str__(self) -> str:
        if self.mode.hybrid:
            sp = f"SP({self.sp}: R{self.ring}\u00d7U{self.ulysses})"
        else:
            sp = f"SP({self.sp})"
        return f"DP({self.dp})-{sp}"

    def describe(self) -> str:
        """``__str__`` plus this rank's coordinates, for logs."""
        coords = f"rank {self.rank}: dp {self.dp_rank}, sp {self.sp_rank}"
        if self.mode.hybrid:
            coords += f" (ring {self.ring_rank}, ulysses {self.ulysses_rank})"
        return f"{self.mode.name} {self} [{coords}]"


__all__ = ["ParallelLayout", "plan_degrees"]
