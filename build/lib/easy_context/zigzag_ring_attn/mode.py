"""zigzag_ring_attn: a ring of sp ranks over the zigzag cut (rank r holds chunks r and 2W-1-r of 2W)."""
from __future__ import annotations

from ..mode import Mode, PlanTraffic


class ZigzagRingMode(Mode):
    name = "zigzag_ring_attn"
    attention = "easy_context.zigzag_ring_attn:zigzag_ring_attn_func"
    uses_ring = True
    packed_pairs = True
    plan_at_sp1 = True  # the planner's one-rank candidate with our kernels and memory options

    def plan_problem(self, heads, length, sp, ring):
        return f"zigzag needs the length divisible by 2*sp = {2 * sp}" if length % (2 * sp) else None

    def plan_traffic(self, sp, ring):
        return PlanTraffic(ring=sp)
