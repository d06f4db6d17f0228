"""The attention call's contract (DESIGN §2, "what cannot be run exactly"): every argument the sequence-parallel
attention function receives is implemented, known not to change the result, or refused with one line naming the
family, the layer and the argument. Nothing is dropped silently (the failure class of issue #59: gpt-oss sinks,
Llama 4 chunked masks and EXAONE 4's global layers trained wrong because the function ignored what it was handed).

What the function implements (hf/attention.py):
  position_ids            packed documents (restarts at 0) and the layout check
  sp_dispatch             the packed rows' dispatch table (dispatch/table.py)
  sliding_window          the layer's window (``sliding_attention`` layers; see ``layer_mask``)
  s_aux                   attention sinks, one logit per q head (gpt-oss; kernels.fold_sinks)
  dropout, scaling        the kernels' dropout_p (0 only, refused there) and softmax scale
  value head dim          MLA (DeepSeek-V2/V3, Kimi): values narrower or wider than q/k are zero-padded
And by the layer's type (``config.layer_types[layer_idx]``): full, sliding (window) and chunked (Llama 4's
``attention_chunk_size``: chunks of the row are documents) attention. ``attention_mask`` is always None here (the
patch registers a mask function that returns None, hf/patch.py); a layer that builds its own mask hands a tensor in,
and that is refused: its meaning (learned, bidirectional, ...) is not plain causal.

Config-level refusals (``check_layers``) run when the model is patched, before any collective; per-call ones
(``check_call``) at the first forward, on every rank alike (the same model and kwargs everywhere).
"""
from __future__ import annotations

# kwargs that carry no meaning for the attention's result at the values shown (None = any value)
_NEUTRAL = {
    "use_cache": None, "output_attentions": None, "output_hidden_states": None, "return_dict": None,
    "output_router_logits": None, "num_items_in_batch": None,  # the MoE aux loss / the loss's count: not attention
    "seq_idx": None,  # Mamba's document index of packed rows: the same documents as position_ids' restarts
    "layer_idx": None, "cache_position": None, "position_embeddings": None, "logits_to_keep": None,
    # flash-attn varlen boundaries (DataCollatorWithFlattening): the same documents as position_ids' restarts,
    # which is what the patched attention reads
    "cu_seq_lens_q": None, "cu_seq_lens_k": None, "max_length_q": None, "max_length_k": None,
    "is_causal": (None, True), "softcap": (None,), "cache": (None,), "past_key_values": (None,),
    "head_mask": (None,), "target_dtype": None, "s_aux": None, "position_ids": None,
}
# config.layer_types entries (transformers' ALLOWED_LAYER_TYPES and families' own) by what the attention must do
_FULL = ("full_attention", "hybrid", "attention", "full")             # plain causal (hybrid: attention + a mixer)
_SLIDING = ("sliding_attention", "hybrid_sliding")                     # causal within a window
_CHUNKED = ("chunked_attention",)                                      # Llama 4: chunks of the row are documents
_NOT_A_MASK = ("conv", "moe", "linear_attention", "mamba", "mlp", "sparse", "dense")  # the layer's other part
_LAYER_TYPES = _FULL + _SLIDING + _CHUNKED  # anything else (window_attention, indexed / compressed sparse, ...) refused


class AttentionContractError(ValueError):
    """An argument, mask or layer type the sequence-parallel attention does not implement."""


def where(module) -> str:
    """'<model_type> layer <i> (<Class>)' for messages."""
    cfg = getattr(module, "config", None)
    family = getattr(cfg, "model_type", "?")
    idx = getattr(module, "layer_idx", None)
    return f"{family} layer {idx if idx is not None else '?'} ({type(module).__name__})"


def _refuse(mode_name: str, module, what: str, fix: str):
    raise AttentionContractError(f"{mode_name}: {where(module)} passes {what} to its attention, which the "
                                 f"sequence-parallel kernels do not implement; {fix}")


def check_call(mode_name: str, module, attention_mask, kwargs: dict, allowed: tuple = ()) -> None:
    """Refuse any argument of this call the attention does not implement (one line, before the kernels run)."""
    if attention_mask is not None:
        _refuse(mode_name, module, f"its own attention_mask ({type(attention_mask).__name__} of shape "
                f"{tuple(getattr(attention_mask, 'shape', ()))})", "such a mask (learned, bidirectional, ...) is not "
                "plain causal; this family cannot be trained exactly here (use data_parallel)")
    if kwargs.get("softcap") is not None:
        _refuse(mode_name, module, f"attention logit soft-capping (softcap={kwargs['softcap']})",
                "setting config.attn_logit_softcapping=None gives a different model, so this family cannot be "
                "trained exactly here")
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise AttentionContractError(f"{mode_name}: a KV cache is not supported inside sequence-parallel "
                                     "attention; call the model with use_cache=False")
    if kwargs.get("is_causal") is False:
        _refuse(mode_name, module, "is_causal=False (bidirectional attention)", "only causal attention is "
                "sequence-parallel here")
    for name, value in kwargs.items():
        ok = _NEUTRAL.get(name, ())
        if name in allowed or ok is None or value is None or value is False:
            continue
        if not _is_tensor(value) and value in ok:
            continue
        _refuse(mode_name, module, f"the argument {name}={_show(value)}", "open an issue naming the family; until it "
                "is implemented, use data_parallel for this model")


def _is_tensor(x) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


def _show(value) -> str:
    if _is_tensor(value):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def layer_type(module) -> str | None:
    """``config.layer_types[layer_idx]`` of an attention module, or None where the config has no per-layer types."""
    cfg = getattr(module, "config", None)
    types = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if not types or idx is None or not 0 <= idx < len(types) or types[idx] in _NOT_A_MASK:
        return None  # no per-layer type, or one that says what else the layer is, not what its attention masks
    kind = types[idx]
    return "full_attention" if kind in _FULL else "sliding_attention" if kind in _SLIDING else kind


def layer_mask(mode_name: str, module, sliding_window, passed: bool) -> tuple[int | None, int | None]:
    """(window, chunk) of this layer's causal mask. ``passed``: the call named ``sliding_window`` (even as None).

    A window the call passes wins; a call that passes none takes the module's own (Qwen2-MoE keeps it there) but
    never on a ``full_attention`` layer (EXAONE 4 sets ``sliding_window`` on every layer's module and passes None
    for its global ones). ``chunked_attention``: Llama 4's chunks of ``config.attention_chunk_size`` tokens."""
    kind = layer_type(module)
    cfg = getattr(module, "config", None)
    if kind is not None and kind not in _LAYER_TYPES:
        _refuse(mode_name, module, f"layer type {kind!r}", f"supported layer types are {_LAYER_TYPES}")
    if sliding_window is None:
        if kind == "sliding_attention":
            sliding_window = getattr(module, "sliding_window", None) or getattr(cfg, "sliding_window", None)
        elif kind is None and not passed:
            sliding_window = getattr(module, "sliding_window", None)
    chunk = None
    if kind == "chunked_attention":
        chunk = getattr(cfg, "attention_chunk_size", None)
        if not chunk:
            _refuse(mode_name, module, "a chunked_attention layer without config.attention_chunk_size",
                    "set the chunk size in the config")
    return sliding_window, chunk


def check_layers(model, mode_name: str) -> None:
    """Config-level refusals, before any collective: every attention layer's type is one the kernels implement and
    no layer soft-caps its logits."""
    from .route import attention_layers
    for _, module in attention_layers(model):
        cfg = getattr(module, "config", None)
        kind = layer_type(module)
        if kind is not None and kind not in _LAYER_TYPES:
            _refuse(mode_name, module, f"layer type {kind!r}", f"supported layer types are {_LAYER_TYPES}")
        cap = getattr(cfg, "attn_logit_softcapping", None)
        if cap is not None:
            _refuse(mode_name, module, f"attention logit soft-capping (config.attn_logit_softcapping={cap})",
                    "setting it to None gives a different model, so this family cannot be trained exactly here")
        if kind == "chunked_attention" and not getattr(cfg, "attention_chunk_size", None):
            _refuse(mode_name, module, "a chunked_attention layer without config.attention_chunk_size",
                    "set the chunk size in the config")


__all__ = ["AttentionContractError", "check_call", "check_layers", "layer_mask", "layer_type", "where"]
