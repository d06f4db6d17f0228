"""Find the recurrent / linear-attention / convolution layers of a model, and refuse those we cannot run exactly.

Sequence parallelism cuts the sequence across ranks; a layer that carries a state along the sequence computes a
wrong result on every rank but the first unless the state crosses ranks (easy_context.recurrent's chain does
that for the classes with an adapter). Anything else is refused with one line naming the class, never run.

A module is a sequence-mixing recurrent layer when (first match wins, outermost module only):
  * its class name looks like one (gated DeltaNet, Mamba mixers, short convolutions, RG-LRU, RWKV, linear
    attention: ``_NAME``, which covers every hybrid in the transformers range this project pins), or
  * it owns state-space parameters (``A_log`` / ``dt_bias``), or
  * it owns a causal depthwise ``nn.Conv1d`` (groups == channels, padding == kernel - 1) — a short convolution
    under any name.
And a config whose ``layer_types`` name a recurrent kind (``linear_attention``, ``mamba``, ``conv``, ...) or whose
``model_type`` is a known recurrent family is refused even when no module matched (a class we cannot recognise).
"""
from __future__ import annotations

import re

import torch
from ..registry import get_mode

_NAME = re.compile(r"(GatedDeltaNet|DeltaAttention|LinearAttention|Mixer$|MambaLayer|ShortConv|RecurrentBlock|Rglru|"
                   r"RwkvSelfAttention|xLSTMBlock|mLSTM|sLSTM)")
_RECURRENT_LAYER_TYPES = re.compile(r"(linear|mamba|conv|recurrent|ssm|delta|rwkv|retention|lstm)", re.I)
# model types made only / partly of recurrent layers (a config with no layer_types, e.g. nemotron_h's pattern)
_RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "falcon_h1", "bamba", "nemotron_h", "granitemoehybrid",
                          "jamba", "zamba", "zamba2", "recurrent_gemma", "rwkv", "xlstm", "lfm2", "lfm2_moe", "lfm3",
                          "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_linear",
                          "olmo_hybrid", "bailing_hybrid", "lara_mini", "inkling", "inkling2", "zaya")


def _causal_depthwise_conv(m) -> bool:
    if not isinstance(m, torch.nn.Conv1d):
        return False
    k = m.kernel_size[0]
    return k > 1 and m.groups == m.in_channels and m.padding[0] == k - 1


def is_recurrent(module) -> bool:
    """Does ``module`` itself look like a sequence-mixing recurrent layer (see the module doc)?"""
    if _NAME.search(type(module).__name__):
        return True
    own = dict(module.named_parameters(recurse=False))
    if "A_log" in own or "dt_bias" in own:
        return True
    return any(_causal_depthwise_conv(c) for c in module.children())


def recurrent_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every recurrent layer, outermost only (a mixer's own conv is not listed)."""
    found, inside = [], []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if is_recurrent(m):
            found.append((name, m))
            inside.append(name)
    return found


def _config_hint(config) -> str | None:
    """What the config says about recurrent layers (None: nothing)."""
    text = getattr(config, "get_text_config", lambda: config)()
    for cfg in (config, text):
        types = getattr(cfg, "layer_types", None)
        if isinstance(types, (list, tuple)):
            bad = sorted({t for t in types if isinstance(t, str) and _RECURRENT_LAYER_TYPES.search(t)})
            if bad:
                return f"layer_types {bad}"
        if getattr(cfg, "model_type", None) in _RECURRENT_MODEL_TYPES:
            return f"model_type {cfg.model_type!r}"
    return None


def check_supported(mode, model) -> list[tuple[str, torch.nn.Module]]:
    """The recurrent layers of ``model`` (all with an adapter), or ValueError naming the first unsupported one.

    Called by apply_seq_parallel_monkey_patch for every sequence-parallel mode before anything is patched."""
    from .adapter import get_adapter, supported_classes
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    layers = recurrent_layers(model)
    seq_algo = getattr(mode, "name", mode)
    for name, m in layers:
        if get_adapter(m) is None:
            raise ValueError(
                f"{seq_algo}: {type(m).__name__} (layer {name}) of model type {model_type!r} carries a state along "
                "the sequence and has no exact sequence-parallel implementation here; it would train silently "
                f"wrong, so it is refused. Supported recurrent layers: {', '.join(supported_classes()) or 'none'}; "
                "use parallel_mode data_parallel for this model")
    if not layers and config is not None:
        hint = _config_hint(config)
        if hint is not None:
            raise ValueError(
                f"{seq_algo}: model type {model_type!r} has recurrent layers ({hint}) but none of its modules is "
                "one easy_context recognises; it would train silently wrong, so it is refused. Supported recurrent "
                f"layers: {', '.join(supported_classes()) or 'none'}; use parallel_mode data_parallel")
    return layers





def check_config(mode, config) -> list[tuple[str, str]]:
    """(name, class name) of the recurrent layers; check_supported for a config alone (``python -m easy_context check``, before any rank starts): the model is
    built on the meta device (no memory, no weights). A config that cannot be built that way is left to the ranks."""
    import transformers
    mode = get_mode(mode)  # a name from a user (check's --mode)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - the ranks build it for real and report
        if _config_hint(config) is not None and mode.is_parallel:
            check_supported(mode, _Shell(config))
        return []
    if not mode.is_parallel:
        return [(n, type(m).__name__) for n, m in recurrent_layers(model)]
    return [(n, type(m).__name__) for n, m in check_supported(mode, model)]


class _Shell(torch.nn.Module):
    """A model with no modules and only a config: check_supported then judges by the config."""

    def __init__(self, config):
        super().__init__()
        self.config = config
def refuse_in_inference(model) -> None:
    """SeqParallelLM (eval_needle / eval_ppl) decodes with its own attention and keeps no recurrent state: refuse."""
    layers = recurrent_layers(model)
    if layers:
        name, m = layers[0]
        raise ValueError(f"SeqParallelLM: {type(m).__name__} (layer {name}) of model type "
                         f"{getattr(model.config, 'model_type', None)!r} carries a recurrent state that the sequence-"
                         "parallel evaluation engine does not keep yet; evaluate this model with model.generate on one "
                         "process")
    hint = _config_hint(getattr(model, "config", None)) if getattr(model, "config", None) is not None else None
    if hint is not None:
        raise ValueError(f"SeqParallelLM: model type {model.config.model_type!r} has recurrent layers ({hint}) that "
                         "the sequence-parallel evaluation engine does not support")


__all__ = ["is_recurrent", "recurrent_layers", "check_supported", "check_config", "refuse_in_inference"]
