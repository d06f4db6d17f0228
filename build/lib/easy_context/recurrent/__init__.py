"""Recurrent / linear-attention / short-convolution layers of hybrid models under sequence parallelism.

Interface (adapter.py): an adapter per layer class ``zero_state(layer, batch, dtype, device)`` and
``run_chunk(layer, hidden_states_chunk, state, resets) -> (out_chunk, final_state)``, registered with
``register_adapter(layer_class_name, adapter)``. detect.py refuses layers without one.
"""
from .adapter import Adapter, get_adapter, register_adapter, run_with_resets, supported_classes
from .detect import check_supported, recurrent_layers

__all__ = ["Adapter", "register_adapter", "get_adapter", "supported_classes", "run_with_resets", "check_supported",
           "recurrent_layers"]
