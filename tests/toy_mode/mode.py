"""toy_ring's Mode: a ring over a contiguous cut. No planner cost model: the planner must refuse it."""
from easy_context.mode import Mode


class ToyRingMode(Mode):
    name = "toy_ring"
    cut_module = "tests.toy_mode.layout"
    attention = "tests.toy_mode:toy_ring_attn_func"
    uses_ring = True
