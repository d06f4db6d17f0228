"""The user's config, read (no weights) and shrunk: fewer layers / a narrower model with the attention geometry,
RoPE and window settings kept; RoPE theta set everywhere the config keeps it."""
from __future__ import annotations

import copy
import os

from .case import CheckUsageError


def load_user_config(path: str):
    """AutoConfig from a model directory or a config.json path; no weights, no download for local paths."""
    if not os.path.exists(path):
        raise CheckUsageError(f"--model {path!r}: no such file or directory (give a model directory or its "
                              "config.json)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckUsageError(f"--model {path!r}: directory has no config.json")
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any loader failure is the user's file
        raise CheckUsageError(f"--model {path!r}: cannot read the config: {str(e).splitlines()[0]}") from None
    problem = missing_fields(config, path)
    if problem:
        raise CheckUsageError(problem)
    return config


# the fields a config must spell out: transformers fills a missing one with its class default (Llama: 4096 wide, 32
# heads, 32000 tokens), i.e. another model than the user's, which would then be checked (or trained) instead
REQUIRED = (("hidden_size", "the model width"), ("num_attention_heads", "the attention head count"),
            ("num_hidden_layers", "the layer count"), ("vocab_size", "the vocabulary size"))


def missing_fields(config, path: str, flag: str = "--model") -> str | None:
    """One line naming the fields ``path``'s config.json lacks (an alias of the class's ``attribute_map``, or the field
    in a ``text_config``-like sub-dict, counts), or None. Read strictly by ``check`` and train.py."""
    from transformers import PretrainedConfig
    try:
        raw, _ = PretrainedConfig.get_config_dict(path)
    except Exception:  # noqa: BLE001 - AutoConfig read it: nothing more to say here
        return None
    amap = getattr(type(config), "attribute_map", None) or {}
    dicts = [raw] + [v for k, v in raw.items() if isinstance(v, dict) and k.endswith("_config")]
    subs = [config] + [getattr(config, k) for k in ("text_config", "llm_config") if hasattr(config, k)]
    try:  # the class's own defaults: a value that differs came from the file (an alias, or derived: Nemotron-H's
        defaults = type(config)()  # layer count from its block pattern)
    except Exception:  # noqa: BLE001 - a config class that needs arguments: judge by the spelled keys alone
        defaults = None
    missing = []
    for name, what in REQUIRED:
        if not any(hasattr(c, name) for c in subs):
            continue  # a field this model type does not have
        names = {name, amap.get(name)} | {k for k, v in amap.items() if v == name}
        value = getattr(config, name, None)
        if defaults is not None and hasattr(defaults, name) and getattr(defaults, name) != value:
            continue
        if not any(n in d for d in dicts for n in names if n):
            default = next((getattr(c, name) for c in subs if hasattr(c, name)), None)
            missing.append(f"{name!r} ({what}; transformers would use its default {default})")
    if not missing:
        return None
    return (f"{flag} {path!r}: config.json has no {', '.join(missing)}, not your model's value: add "
            f"{'it' if len(missing) == 1 else 'them'} to config.json")


def _heads(config) -> tuple[int, int, int]:
    q = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or q
    hd = getattr(config, "head_dim", None) or config.hidden_size // q
    return q, kv, hd


def _thetas(config) -> list[tuple[str | None, dict]]:
    """The rope_parameters dict(s): one, or one per layer type (Gemma 3: sliding/full)."""
    rp = getattr(config, "rope_parameters", None)
    if not isinstance(rp, dict):
        return []
    if all(isinstance(v, dict) for v in rp.values()) and rp:
        return list(rp.items())
    return [(None, rp)]


def set_theta(config, fn) -> None:
    """theta <- fn(theta) everywhere the config keeps it (rope_parameters, per layer type, legacy rope_theta)."""
    entries = _thetas(config)
    for _, params in entries:
        if "rope_theta" in params:
            params["rope_theta"] = float(fn(params["rope_theta"]))
    if getattr(config, "rope_theta", None) is not None:
        config.rope_theta = float(fn(config.rope_theta))
    elif not entries:
        raise CheckUsageError(f"{config.model_type}: the config has no RoPE theta to set")


def _pick_layer_types(types: list, n: int) -> list:
    """The first n layer types, but with every type of the full model present when n allows (so a
    2-layer Gemma 3 still has a global-attention layer)."""
    chosen = list(types[:n])
    missing = [t for t in dict.fromkeys(types) if t not in chosen]
    for i, t in enumerate(missing[:n - 1] if n > 1 else []):
        chosen[n - 1 - i] = t
    return chosen


def shrink_config(config, layers: int | None, hidden: int | None = None, intermediate: int | None = None,
                  vocab: int | None = None) -> tuple[object, list[str]]:
    """A copy of ``config`` with fewer layers / a narrower model; head_dim, the q/kv ratio, RoPE and window
    settings stay. Returns (config, notes about what changed)."""
    config = copy.deepcopy(config)
    notes = []
    n0 = config.num_hidden_layers
    if layers is not None:
        if layers < 1:
            raise CheckUsageError(f"--layers must be >= 1; got {layers}")
        config.num_hidden_layers = layers
        types = getattr(config, "layer_types", None)
        if isinstance(types, (list, tuple)) and types:
            config.layer_types = _pick_layer_types(list(types), layers)
        mlp_only = getattr(config, "mlp_only_layers", None)
        if isinstance(mlp_only, (list, tuple)):
            config.mlp_only_layers = [i for i in mlp_only if i < layers]
        if layers != n0:
            notes.append(f"layers {n0} -> {layers}")
    q, kv, hd = _heads(config)
    h0 = config.hidden_size
    if hidden is not None and hidden != h0:
        ratio = q // kv if q % kv == 0 else None
        if hidden < 1 or (q * hidden) % h0 != 0 or ratio is None or ((q * hidden) // h0) % ratio != 0:
            valid = [h0 * k // q for k in range(ratio or q, q, ratio or q) if (h0 * k) % q == 0]
            raise CheckUsageError(
                f"--hidden {hidden}: heads must shrink in proportion keeping head_dim {hd} and the q/kv ratio "
                f"{q}:{kv}; with hidden {h0} and {q} heads, valid values: {', '.join(map(str, valid)) or 'none'}")
        q_new = q * hidden // h0
        kv_new = q_new * kv // q
        config.hidden_size, config.num_attention_heads = hidden, q_new
        if hasattr(config, "num_key_value_heads"):
            config.num_key_value_heads = kv_new
        config.head_dim = hd  # explicit, or the model would derive hidden / heads
        notes.append(f"hidden {h0} -> {hidden}, heads {q}/{kv} -> {q_new}/{kv_new} (head_dim {hd})")
        if intermediate is None:
            for attr in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
                v = getattr(config, attr, None)
                if isinstance(v, int) and v > 0:
                    setattr(config, attr, max(1, round(v * hidden / h0)))
                    notes.append(f"{attr} {v} -> {getattr(config, attr)}")
    if intermediate is not None:
        if intermediate < 1:
            raise CheckUsageError(f"--intermediate must be >= 1; got {intermediate}")
        notes.append(f"intermediate_size {config.intermediate_size} -> {intermediate}")
        config.intermediate_size = intermediate
    if vocab is not None and vocab != config.vocab_size:
        if vocab < 2:
            raise CheckUsageError(f"--vocab must be >= 2; got {vocab}")
        notes.append(f"vocab {config.vocab_size} -> {vocab}")
        config.vocab_size = vocab
        for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(config, attr, None)
            if isinstance(v, int) and v >= vocab:
                setattr(config, attr, vocab - 1 if attr != "pad_token_id" else None)
    # dropout / router noise draw different random numbers on each rank: off, or nothing could match
    for k, v in config.to_dict().items():
        if isinstance(v, float) and v > 0 and ("dropout" in k or "pdrop" in k or "jitter" in k):
            setattr(config, k, 0.0)
            notes.append(f"{k} {v} -> 0")
    config.use_cache = False
    return config, notes
