"""The adapters shipped with easy_context, by layer class name (``BUILTIN``; adapter.py registers them on the first
lookup). This module imports no adapter registry: data flows one way (adapter.py -> builtin.py -> the layers' code).

Each class here was checked against one process by tests/test_hybrid.py (forward and backward, packed
documents, every mode); add a class only with such a test."""
from .cache_adapter import HybridCacheAdapter, delta_rule_state
from .mamba2 import MAMBA2_CLASSES, run_chunk, zero_state


class Mamba2Adapter:
    """The adapter the recurrent chain (easy_context/recurrent/chain.py) calls for every Mamba-2 mixer class
    (mamba2.py: nemotron_h, bamba, granitemoehybrid, falcon_h1)."""
    zero_state = staticmethod(zero_state)
    run_chunk = staticmethod(run_chunk)

    @staticmethod
    def run_plan(plan, layer, x):
        """All of this rank's pieces at once (no serial chain): mamba2_parallel.py."""
        from .mamba2_parallel import run_plan
        return run_plan(plan, layer, x)


_DELTA = HybridCacheAdapter(delta_rule_state)   # conv window + gated delta-rule state
_SHORT_CONV = HybridCacheAdapter(None)          # conv window only

BUILTIN = {"Qwen3NextGatedDeltaNet": _DELTA, "Qwen3_5GatedDeltaNet": _DELTA, "Lfm2ShortConv": _SHORT_CONV,
           **{name: Mamba2Adapter() for name in MAMBA2_CLASSES}}

__all__ = ["BUILTIN", "Mamba2Adapter"]
