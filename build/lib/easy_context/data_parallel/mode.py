"""data_parallel: no sequence parallelism; every rank holds whole sequences, attention stays the model's own."""
from __future__ import annotations

from ..mode import Mode, PlanTraffic


class DataParallelMode(Mode):
    name = "data_parallel"
    attention = None
    group_kwargs = ()
    is_parallel = False
    plan_at_sp1 = True  # the planner's plain Hugging Face baseline

    def sp_size(self, sp_size, ring_degree):
        if sp_size not in (None, 1) or ring_degree not in (None, 1):
            raise ValueError(f"data_parallel has no sequence parallelism (got sp_size={sp_size}, "
                             f"ring_degree={ring_degree}); drop them or pick a sequence-parallel mode")
        return 1

    def split(self, sp, ring_degree):
        return 1, 1

    def gather_positions(self, local, groups, gather, dispatch=None):
        return local  # nothing was cut (the base signature: packing.gather_positions passes dispatch=)

    def plan_problem(self, heads, length, sp, ring):
        return None if sp == 1 else "data_parallel has sp = 1"

    def plan_traffic(self, sp, ring):
        return PlanTraffic()
