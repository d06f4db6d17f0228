"""ulysses_attn: head all-to-all over the contiguous cut (DeepSpeed-Ulysses)."""
from __future__ import annotations

from ..mode import Mode, PlanTraffic


class UlyssesMode(Mode):
    name = "ulysses_attn"
    attention = "easy_context.ulysses_attn:ulysses_attn_func"
    ulysses = True

    def check_heads(self, num_q_heads, num_kv_heads, ulysses_degree, what):
        if ulysses_degree > 1:
            from .attention import kv_replication
            kv_replication(num_q_heads, num_kv_heads, ulysses_degree, what=what)

    def plan_problem(self, heads, length, sp, ring):
        if heads % sp or length % sp:
            return f"ulysses needs q heads ({heads}) and the length divisible by sp = {sp}"
        return None

    def plan_traffic(self, sp, ring):
        return PlanTraffic(ulysses=sp, kv_replicated=True)
