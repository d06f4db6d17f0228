"""The adapters shipped with easy_context (imported on first lookup, registered by class name).

Each class here was checked against one process by tests/test_hybrid.py (forward and backward, packed
documents, every mode); add a class only with such a test."""
from .adapter import register_adapter
from .cache_adapter import HybridCacheAdapter, delta_rule_state

_DELTA = HybridCacheAdapter(delta_rule_state)   # conv window + gated delta-rule state
_SHORT_CONV = HybridCacheAdapter(None)          # conv window only

for _name in ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet"):
    register_adapter(_name, _DELTA)
register_adapter("Lfm2ShortConv", _SHORT_CONV)
from . import mamba2  # noqa: E402,F401  (Mamba-2 mixers: nemotron_h, bamba, granitemoehybrid, falcon_h1)
