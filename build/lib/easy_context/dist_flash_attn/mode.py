"""dist_flash_attn: LightSeq's load-balanced ring over the contiguous cut (rank r holds chunk r of W)."""
from __future__ import annotations

from ..mode import Mode, PlanTraffic


class DistFlashMode(Mode):
    name = "dist_flash_attn"
    attention = "easy_context.dist_flash_attn:dist_flash_attn_func"
    uses_ring = True

    def plan_problem(self, heads, length, sp, ring):
        if sp > 1 and sp % 2 or length % sp:
            return f"dist_flash needs sp even (or 1) and the length divisible by {sp}"
        return None

    def plan_traffic(self, sp, ring):
        # helpers send their partial outputs back besides the k/v: more bytes per step than the zigzag ring
        return PlanTraffic(ring=sp, ring_comm_factor="dist_flash_comm_factor")
