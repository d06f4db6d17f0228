"""Can the patch route this model? Every attention layer must call transformers' ``AttentionInterface``
(``ALL_ATTENTION_FUNCTIONS``), where the sequence-parallel function is registered, and every recurrent layer must
have an adapter (recurrent/detect.py). A layer that computes attention itself (Bloom, Falcon, MPT in transformers
5) would attend to its own rank's shard only: the model trains, silently wrong. Such a model is refused before
anything is patched, naming the layer class.

Layers that route but compute something else are refused too, by family: ``families.REFUSED`` (Doge's learned
mask, DeepSeek-V4's compressed KV), sparse-attention indexers (DSA), and models whose forward takes no
``position_ids`` while a position table numbers tokens from the input length (BART-style decoders).

Attention layers are found by class name (``...Attention``, ``...Attn``, outermost only, recurrent ones aside) and
judged by the source of their ``forward``; the check needs no forward pass and no collective, so it runs on a model
built on the meta device too (``check_config_routable``, for ``check``)."""
from __future__ import annotations

import functools
import inspect
import re

import torch

_ATTN_NAME = re.compile(r"(Attention|Attn|MLA)(\d*)$")  # LongcatFlashMLA


@functools.lru_cache(maxsize=None)
def dispatches_through_interface(cls) -> bool:
    """Does ``cls.forward`` hand its attention to transformers' AttentionInterface?"""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source (compiled / built at run time): cannot vouch for it
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src


def attention_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every attention layer, outermost only (recurrent layers are not listed)."""
    from ..recurrent.detect import is_recurrent
    found, inside = [], []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if _ATTN_NAME.search(type(m).__name__) and not is_recurrent(m) and any(True for _ in m.parameters()):
            found.append((name, m))
            inside.append(name)
    return found


def _sparse_indexer(model) -> tuple[str, str] | None:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, HY-V4, ...): an ``...Indexer`` module in an attention layer
    picks each query's top ``index_topk`` keys and masks the rest through ``attention_mask`` / ``indices=``."""
    for name, m in model.named_modules():
        if type(m).__name__.endswith("Indexer"):
            mt = getattr(getattr(model, "config", None), "model_type", "?")
            return mt, (f"its attention layers select keys with a sparse-attention indexer ({type(m).__name__} at "
                        f"{name}: each query keeps its top index_topk keys, the rest masked through attention_mask or "
                        "indices=); the kernels attend to every causal key")
    return None


def _no_positions(model) -> tuple[str, str] | None:
    """A causal LM whose forward takes no ``position_ids`` (BART-style decoders, MusicGen, Whisper's decoder in
    transformers 5.24) numbers each call's tokens from 0 itself: every rank's shard would restart at position 0."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return None
    if "position_ids" in params or not hasattr(model, "config"):
        return None
    table = next((type(m).__name__ for m in model.modules() if re.search(r"Position(al)?Embedding", type(m).__name__)),
                 None)
    if table is None:  # RoPE models without the argument may pass it on through **kwargs (the census checks them)
        return None
    return (getattr(model.config, "model_type", "?"),
            f"{type(model).__name__}.forward takes no position_ids, so its {table} numbers each rank's shard from "
            "position 0 (it reads the input length)")


def check_routable(model, mode) -> None:
    """ValueError naming the first layer class the patch cannot route (see the module doc); nothing for a model
    whose every attention layer goes through the AttentionInterface and whose recurrent layers all have adapters."""
    from ..families import refusal
    from ..recurrent.detect import check_supported, recurrent_layers
    what = type(model).__name__
    refused = refusal(getattr(model, "config", None)) or _sparse_indexer(model)
    if refused:  # the layers route, but what they compute is not what the kernels compute (families.REFUSED)
        raise ValueError(f"{mode.name}: {what} ({refused[0]}) cannot be made sequence-parallel exactly: {refused[1]}. "
                         "Use --parallel_mode data_parallel for this family")
    attn = attention_layers(model)
    bad = [(n, m) for n, m in attn if not dispatches_through_interface(type(m))]
    if bad:
        name, layer = bad[0]
        raise ValueError(
            f"{mode.name}: {what} cannot be made sequence-parallel: its attention layer {type(layer).__name__} "
            f"({len(bad)} of them, e.g. {name}) computes attention itself instead of through transformers' "
            "AttentionInterface, so the patch cannot route it and each rank would attend to its own shard only (a "
            "silently wrong model). Use a model whose attention goes through the AttentionInterface (Llama, Mistral, "
            "Qwen 2/3, Gemma 3, ...; `python -m easy_context check --matrix` lists them), or data_parallel")
    check_supported(mode, model)  # recurrent layers without an exact sequence-parallel path: refused there
    refused = _no_positions(model)
    if refused:
        raise ValueError(f"{mode.name}: {what} ({refused[0]}) cannot be made sequence-parallel exactly: {refused[1]}. "
                         "Use --parallel_mode data_parallel for this family")
    if not attn and not recurrent_layers(model):
        raise ValueError(f"{mode.name}: {what} has no attention layer the patch recognises (no module class named "
                         "...Attention), so nothing would be sequence-parallel; use data_parallel for it")


def check_config_routable(config, mode) -> None:
    """``check_routable`` on a model built from ``config`` on the meta device (no weights, no memory); nothing to
    check for a mode without sequence parallelism. ``mode``: a Mode or its name (check's --mode, tests)."""
    import transformers as tf

    from ..registry import get_mode
    mode = get_mode(mode)
    if not mode.is_parallel:
        return
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    check_routable(model, mode)


__all__ = ["check_routable", "check_config_routable", "attention_layers", "dispatches_through_interface"]
