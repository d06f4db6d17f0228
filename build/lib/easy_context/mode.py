"""``Mode``: one sequence-parallel mode's whole anatomy, in one object.

Every mode package (``easy_context/<mode>/``) defines one subclass in its ``mode.py``; ``registry.py`` maps the
mode's name to it. Everything that differs between modes is asked of the mode, never decided by comparing names:

    degrees      how sp ranks split into ring x ulysses (``split``), validated before any process group
    cut          the token cut of a sequence over sp ranks: ``shard`` / ``unshard`` / ``seq_multiple`` /
                 ``signature`` (+ ``dispatch_of`` where packed rows are dealt by a table): ``Mode.cut``, the
                 ``cut.py`` beside the mode's ``mode.py`` ("layout" alone means ``ParallelLayout``)
    positions    ``gather_positions``: every rank's local position ids -> the global ones (packed documents)
    heads        ``check_heads``: heads that cannot split over the Ulysses degree fail before any collective
    groups       which process groups a ``ParallelLayout`` creates for it and which ones its attention takes
    attention    ``attention_fn()`` in the (B, S_local, H, D) layout; ``supports_attention_cache``
    planner      ``plan_problem`` / ``plan_traffic``: why a length or head count cannot be cut, and the bytes
                 the planner (``tools/plan``) charges per step. A mode without them is refused there.

A mode module imports nothing heavy (no torch) at import time: ``train.py --bad-flag`` reads mode names and
attributes and must fail in milliseconds. What needs torch is imported inside the methods.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class PlanTraffic:
    """What one sp rank sends per attention layer, as the planner (tools/plan/step_time.py) costs it.

    ring: ranks of the ring passing k/v blocks point to point (1 = none); ulysses: ranks of the head all-to-all
    (1 = none); kv_replicated: k/v heads are replicated up to the sp size before they move (Ulysses' GQA rule),
    which widens the k/v a rank holds; ring_kv_replicated: the ring passes those replicated k/v (USP);
    ring_comm_factor: name of the plan_constants.json entry scaling the ring's bytes (None = 1)."""
    ring: int = 1
    ulysses: int = 1
    kv_replicated: bool = False
    ring_kv_replicated: bool = False
    ring_comm_factor: str | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Mode:
    """Base class: a sequence-parallel mode over sp ranks. Subclasses set the class attributes below and override
    the methods whose default does not fit (see ``usp/mode.py`` for a mode over two process groups)."""

    name: str = ""
    # Where the cut lives when not in cut.py beside the mode's own mode.py (a mode registered from elsewhere).
    cut_module: str | None = None
    # "package.module:function" of the attention (q, k, v, dropout_p, softmax_scale, causal, **groups, docs=)
    # in the (B, S_local, H, D) layout; None = the model's own attention (no sequence parallelism).
    attention: str | None = None
    group_kwargs: tuple[str, ...] = ("group",)  # the process-group kwargs its attention takes
    degree_kwargs: tuple[str, ...] = ()         # cut kwargs besides the sp size (usp: ring_degree)
    is_parallel: bool = True     # False: no sequence parallelism (every rank a whole sequence; dp = world)
    uses_ring: bool = False      # k/v blocks pass around a ring of sp ranks (balanced causal work per step)
    ulysses: bool = False        # a head all-to-all: q heads must split over the Ulysses degree
    hybrid: bool = False         # ring x ulysses groups (a layout prints and builds both)
    packed_pairs: bool = False   # packed rows take zigzag's balanced k-pair cut (sharding.py)
    plan_at_sp1: bool = False    # the planner's candidate for one rank per sequence (data_parallel, zigzag)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # ------------------------------------------------------------------ degrees
    def sp_size(self, sp_size: int | None, ring_degree: int | None) -> int | None:
        """The sp size asked for (None: the world / what dp leaves); a mode without sp refuses one."""
        return sp_size

    def split(self, sp: int, ring_degree: int | None) -> tuple[int, int]:
        """(ring, ulysses) with ring x ulysses = sp; ``ring_degree`` only where the mode takes it."""
        if ring_degree not in (None, 1):  # parallel_layout.common_degrees names the modes that take one first
            raise ValueError(f"ring_degree={ring_degree} does not apply to {self.name}: its cut takes no ring degree "
                             "(Mode.degree_kwargs); drop it")
        return (1, sp) if self.ulysses else (sp, 1)

    def layout_kw(self, **degrees) -> dict:
        """The cut kwargs of this mode from the degrees given (``ring_degree=``); others are dropped."""
        return {k: degrees[k] for k in self.degree_kwargs if degrees.get(k) is not None}

    # ------------------------------------------------------------------ cut (token layout of a sequence)
    @property
    def cut(self):
        """The token cut: a module with shard(x, rank, world_size, dim, **kw), unshard(shards, dim, **kw),
        seq_multiple(world_size, **kw), signature(world_size, **kw) and, where packed rows are dealt by a table,
        dispatch_of(world_size, **kw). Imported on first use (cuts need torch; a Mode must not at import)."""
        return importlib.import_module(self.cut_module or type(self).__module__.rpartition(".")[0] + ".cut")

    def seq_multiple(self, world_size: int, **kw) -> int:
        return self.cut.seq_multiple(world_size, **kw)

    def signature(self, world_size: int, **kw) -> tuple:
        """How the mode cuts a sequence, canonically: equal signatures shard identically."""
        return self.cut.signature(world_size, **kw)

    def dispatch_of(self, world_size: int, **kw):
        """The packed rows' cost-balanced chunk table (dispatch/plan.py) the cut uses: the one given as ``dispatch=``, one
        planned from ``positions=`` for ``dispatch="auto"``, else None (the fixed cut)."""
        planner = getattr(self.cut, "dispatch_of", None)
        if planner is None:
            if kw.get("dispatch") is not None and not isinstance(kw["dispatch"], str):
                from .dispatch.table import DispatchError
                raise DispatchError(f"{self.name} cuts packed rows one fixed way: it takes no dispatch table")
            return None
        return planner(world_size, **kw)

    def shard(self, x, rank: int, world_size: int, dim: int = 1, **kw):
        return self.cut.shard(x, rank, world_size, dim=dim, **kw)

    def unshard(self, shards, dim: int = 1, **kw):
        return self.cut.unshard(shards, dim=dim, **kw)

    def gather_positions(self, local, groups: dict, gather, dispatch=None):
        """The global (B, L) positions from this rank's ``local`` ones: gather them in the sp ``group`` and undo the
        cut (packed rows: by their ``dispatch`` table, else decided from the gathered positions, as the cut did).
        ``gather(t, group)`` -> every group member's ``t`` in rank order."""
        import torch.distributed as dist
        from .packing import unshard_gathered
        group = groups.get("group")
        if dist.get_world_size(group) == 1:
            return local
        return unshard_gathered(self, gather(local, group), dispatch)

    @property
    def dispatches(self) -> bool:
        """Packed rows are dealt in cost-balanced chunks (dispatch/plan.py) by this mode's cut."""
        return hasattr(self.cut, "dispatch_of")

    # ------------------------------------------------------------------ heads
    def check_heads(self, num_q_heads: int, num_kv_heads: int, ulysses_degree: int, what: str) -> None:
        """Fail before any collective if the model's heads cannot be split as the mode needs (Ulysses modes)."""

    # ------------------------------------------------------------------ process groups
    def group_kinds(self) -> tuple[str, ...]:
        """The rank sets a ``ParallelLayout`` creates groups for (``ParallelLayout._rank_sets`` keys)."""
        return ("dp", "sp", "ring", "ulysses") if self.hybrid else ("dp", "sp")

    def attn_groups(self, layout) -> dict:
        """The process-group kwargs of the attention function, from a ``ParallelLayout``."""
        return {"group": layout.sp_group} if self.group_kwargs else {}

    def own_signature(self, groups: dict) -> tuple[tuple, str]:
        """(signature, description) of the cut the attention assumes, from the sizes of its groups."""
        import torch.distributed as dist
        live = dist.is_available() and dist.is_initialized()
        w = dist.get_world_size(groups.get("group")) if live and self.group_kwargs else 1
        return self.signature(w), f"{self.name} on {w} sp ranks"

    # ------------------------------------------------------------------ attention
    def attention_fn(self):
        if self.attention is None:
            return None
        mod, fn = self.attention.split(":")
        return getattr(importlib.import_module(mod), fn)

    @property
    def supports_attention_cache(self) -> bool:
        """Selective checkpointing may keep only the attention's (out, lse) and replay them (memory/selective.py)."""
        return bool(getattr(self.attention_fn(), "supports_attention_cache", False))

    # ------------------------------------------------------------------ planner (tools/plan)
    def plan_rings(self, sp: int) -> list:
        """The ring degrees the planner tries for ``sp`` ranks (None: the mode's own split)."""
        return [None]

    def plan_problem(self, heads: int, length: int, sp: int, ring: int | None) -> str | None:
        """Why the mode cannot cut ``length`` tokens / ``heads`` q heads over ``sp`` ranks (None: it can). The
        default refuses: a mode is costed only once it says what it moves (``plan_traffic``)."""
        return f"{self.name} has no planner cost model (define plan_problem and plan_traffic in its Mode)"

    def plan_traffic(self, sp: int, ring: int | None) -> PlanTraffic:
        raise ValueError(f"the planner cannot cost {self.name}: its Mode defines no plan_traffic")


__all__ = ["Mode", "PlanTraffic"]
