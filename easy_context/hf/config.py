"""Model config facts shared by training and evaluation: where a config keeps its RoPE theta."""
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


__all__ = ["set_rope_theta", "get_rope_theta"]
