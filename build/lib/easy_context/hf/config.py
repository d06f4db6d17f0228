"""Model config facts shared by training and evaluation: where a config keeps its RoPE theta, the RoPE scaling of
--rope-scaling and whether sequence parallelism is exact under a config's RoPE, and the sliding window every
attention layer shares."""
from __future__ import annotations

from ..errors import UsageError


def _theta_home(config) -> dict | None:
    """Where --rope-theta goes: ``config.rope_parameters`` (transformers 5), or with a RoPE per layer type (Gemma 3)
    the global layers' entry: a local layer sees at most its window (512), far below any trained length."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        return rp["full_attention"]
    return rp if isinstance(rp, dict) else None


def set_rope_theta(config, theta: float) -> None:
    """transformers 5 keeps theta in ``config.rope_parameters["rope_theta"]`` (per layer type: the global layers');
    older configs in ``rope_theta``."""
    home = _theta_home(config)
    if home is not None:
        home["rope_theta"] = float(theta)
    if hasattr(config, "rope_theta") or home is None:
        config.rope_theta = float(theta)


def get_rope_theta(config) -> float:
    home = _theta_home(config)
    if home is not None and "rope_theta" in home:
        return float(home["rope_theta"])
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


ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3")
# keys a previous scaling may have left in rope_parameters (replaced, never mixed with the new type's)
_SCALING_KEYS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
                 "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate", "short_factor", "long_factor")
LLAMA3_FREQ_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}  # Llama 3.1's published values


def set_rope_scaling(config, rope_type: str, factor: float, original: int | None = None) -> None:
    """--rope-scaling: ``config.rope_parameters`` (transformers 5) gets ``rope_type`` + ``factor`` (+ the
    pretraining length ``original_max_position_embeddings`` for yarn / llama3), theta and partial-rotary kept.
    ``original`` defaults to the config's ``max_position_embeddings``; for yarn / llama3 / linear that becomes
    ``original x factor`` (the extended length); dynamic NTK reads the original length from
    ``max_position_embeddings`` itself, so there it is set to ``original``."""
    if rope_type not in ROPE_SCALINGS:
        raise UsageError(f"--rope-scaling must be one of {', '.join(ROPE_SCALINGS)}, got {rope_type!r}")
    if factor is None or not factor > 1:
        raise UsageError(f"--rope-scaling {rope_type} needs --rope-factor > 1, got {factor}")
    rp = getattr(config, "rope_parameters", None)
    if not isinstance(rp, dict) or not rp:
        raise UsageError(f"--rope-scaling: model type {config.model_type!r} has no single RoPE "
                         "(config.rope_parameters); cannot scale it")
    if any(isinstance(v, dict) for v in rp.values()):  # per-layer-type RoPE (Gemma 3 local/global)
        raise UsageError(f"--rope-scaling: {config.model_type!r} has a RoPE per layer type "
                         f"({', '.join(rp)}); scaling only one global RoPE is supported")
    original = int(original or config.max_position_embeddings)
    new = {k: v for k, v in rp.items() if k not in _SCALING_KEYS}
    new.setdefault("rope_theta", get_rope_theta(config))
    new.update(rope_type=rope_type, factor=float(factor))
    if rope_type in ("yarn", "llama3"):
        new["original_max_position_embeddings"] = original
    if rope_type == "llama3":
        new.update(LLAMA3_FREQ_FACTORS)
    config.rope_parameters = new
    config.max_position_embeddings = original if rope_type == "dynamic" else max(
        config.max_position_embeddings, int(original * factor))


def check_rope_for_sp(config, parallel_mode) -> None:
    """dynamic / longrope pick their frequencies from the largest position id a forward sees; a sequence-
    parallel rank sees only its shard, so ranks (and a 1-process run) would disagree: refused."""
    rp = getattr(config, "rope_parameters", None) or {}
    types = {v.get("rope_type") for v in rp.values() if isinstance(v, dict)} | {rp.get("rope_type")}
    bad = types & {"dynamic", "longrope"}
    from ..registry import get_mode
    mode = get_mode(parallel_mode)
    if bad and mode.is_parallel:
        raise UsageError(f"RoPE type {bad.pop()!r} rescales by the longest position of each forward, which a "
                         f"sequence-parallel rank sees only part of; --parallel_mode {mode.name} would not be "
                         "exact: use --rope-scaling yarn/linear/llama3, or --parallel_mode data_parallel")


__all__ = ["set_rope_theta", "get_rope_theta", "sliding_window", "attention_window", "set_rope_scaling",
           "check_rope_for_sp", "ROPE_SCALINGS"]
