"""Model config facts shared by training and evaluation: where a config keeps its RoPE theta, and the sliding window
every attention layer shares."""
from __future__ import annotations


def set_rope_theta(config, theta: float) -> None:
    """transformers 5 keeps theta in ``config.rope_parameters["rope_theta"]``; older configs in ``rope_theta``."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = float(theta)
    if hasattr(config, "rope_theta") or not isinstance(rp, dict):
        config.rope_theta = float(theta)


def get_rope_theta(config) -> float:
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(config.rope_theta)


def sliding_window(config) -> int | None:
    """The window the built model's local layers use, None for full attention everywhere."""
    w = getattr(config, "sliding_window", None)
    if not w or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and types and "sliding_attention" not in types:
        return None
    return int(w)


def attention_window(config) -> int | None:
    """The sliding window of *every* attention layer (Mistral v0.1, a Qwen2 with sliding layers only), or None when
    some layer attends to the whole document (Gemma 2 / 3's global layers, no window at all). What the packed-row
    dispatch may cap each token's cost by (``ParallelLayout.dispatch_window``): a local layer's keys stop at the
    window, so long documents cost far less than their full causal square. Models mixing local and global layers are
    planned for their global ones (None): those hold the quadratic part of the cost."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and any(t != "sliding_attention" for t in types):
        return None
    return sliding_window(config)


__all__ = ["set_rope_theta", "get_rope_theta", "sliding_window", "attention_window"]
