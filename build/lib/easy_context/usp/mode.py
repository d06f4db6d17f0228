"""usp_attn: ring x ulysses over two process groups (usp/cut.py documents the cut and the rank order)."""
from __future__ import annotations

from ..mode import Mode, PlanTraffic, _divisors


class UspMode(Mode):
    name = "usp_attn"
    attention = "easy_context.usp:usp_attn_func"
    group_kwargs = ("ring_group", "ulysses_group")
    degree_kwargs = ("ring_degree",)
    uses_ring = True
    ulysses = True
    hybrid = True
    packed_pairs = True

    def split(self, sp, ring_degree):
        ring = sp if ring_degree is None else int(ring_degree)
        if ring < 1 or sp % ring != 0:
            raise ValueError(f"usp_attn needs ring x ulysses = sp({sp}), so ring_degree ({ring_degree}) must "
                             f"divide {sp}; valid ring degrees: {_divisors(sp)}")
        return ring, sp // ring

    def gather_positions(self, local, groups, gather, dispatch=None):
        from .cut import gather_positions
        return gather_positions(local, groups, gather, dispatch)

    def check_heads(self, num_q_heads, num_kv_heads, ulysses_degree, what):
        if ulysses_degree > 1:
            from ..ulysses_attn.attention import kv_replication
            kv_replication(num_q_heads, num_kv_heads, ulysses_degree, what=what)

    def attn_groups(self, layout):
        return {"ring_group": layout.ring_group, "ulysses_group": layout.ulysses_group}

    def own_signature(self, groups):
        import torch.distributed as dist
        from .attention import resolve_groups  # usp's own reading of None groups
        live = dist.is_available() and dist.is_initialized()
        _, r, u, _ = resolve_groups(groups.get("ring_group"), groups.get("ulysses_group")) if live else (0, 1, 1, 0)
        return self.signature(r * u, ring_degree=r), f"{self.name} with ring {r} x ulysses {u}"

    def plan_rings(self, sp):
        return [r for r in range(2, sp) if sp % r == 0]

    def plan_problem(self, heads, length, sp, ring):
        r = ring or sp
        u = sp // r
        if sp % r or heads % u or length % (2 * sp):
            return f"usp needs ring x ulysses = sp, q heads divisible by ulysses ({u}), length by {2 * sp}"
        return None

    def plan_traffic(self, sp, ring):
        r = ring or sp
        return PlanTraffic(ring=r, ulysses=sp // r, kv_replicated=True, ring_kv_replicated=True)
