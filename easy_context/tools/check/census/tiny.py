"""A tiny random model of any causal-LM family transformers lists: its default config, shrunk.

The default config of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]``'s config class (composite configs: every
sub-config too) gets small widths (hidden 64, 4 q / 2 kv heads of 16, vocabulary 128, 4 experts of which 2 per
token) and few layers: enough that every layer type the full model has appears once (``layer_types`` and any other
per-layer list or pattern string is cut to the new depth keeping each distinct entry). Windows and chunks shrink
to ``WINDOW`` tokens so local layers are local on the census rows. What the attention sees keeps the family's
shape: MLA keeps a value head dim unlike the query/key one, MHA stays MHA.
"""
from __future__ import annotations

import copy

WINDOW = 8        # sliding windows / attention chunks: shorter than the census rows, so local layers are local
MAX_LAYERS = 4    # layers of the tiny model: at most this, at least one per distinct layer type
VOCAB = 128

# attribute -> tiny value, set where the config has the attribute with an int value (None stays None: off)
_INTS = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "head_dim": 16,
    "max_position_embeddings": 256, "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16, "laurel_rank": 8, "embedding_dim": 64,
    # MoE
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_k": 2, "moe_topk": 2, "top_k": 2, "moe_intermediate_size": 32, "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    # MLA (DeepSeek-V2/V3, Kimi): qk head dim 8 + 8, values 12 (unlike qk, as in the real configs)
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
    # recurrent / hybrid mixers
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_n_groups": 1,
    "ssm_state_size": 8, "state_size": 8, "mamba_expand": 2, "time_step_rank": 8, "n_groups": 1,
    "conv_L_cache": 3, "d_conv": 4, "mamba_d_conv": 4,
    # vision / audio towers of composite models (text-only inputs never reach them, but they are built)
    "image_size": 32, "patch_size": 8, "num_channels": 3, "projection_dim": 32, "embed_dim": 64,
    "d_model": 64, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 96, "decoder_ffn_dim": 96, "n_embd": 64, "n_head": 4,
    "n_inner": 96, "ffn_dim": 96, "d_ff": 96, "d_kv": 16, "num_heads": 4,
    # local attention
    "sliding_window": WINDOW, "attention_chunk_size": WINDOW, "window_size": WINDOW, "local_window_size": WINDOW,
    "attention_window_size": WINDOW,
}
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
# (period, offset) pairs placing one layer kind every ``period`` layers (Jamba): every other layer
_PERIODS = (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset"))
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
              "image_token_id", "image_token_index", "video_token_id", "boi_token_id", "eoi_token_id")


def config_class(model_type: str):
    """The config class the family's causal-LM class is built from (the text config of a composite family)."""
    model_cls = model_class(model_type)
    import transformers as tf
    return getattr(model_cls, "config_class", None) or tf.CONFIG_MAPPING[model_type]


def model_class(model_type: str):
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _cover(seq, n: int):
    """The first n entries of a per-layer sequence, with every distinct entry present when n allows."""
    chosen = list(seq[:n])
    missing = [t for t in dict.fromkeys(seq) if t not in chosen]
    for i, t in enumerate(missing[:max(n - 1, 0)]):
        chosen[n - 1 - i] = t
    return chosen


def _depth(config, n0: int) -> int:
    """Layers of the tiny model: one per distinct entry of the longest per-layer list (2 at least)."""
    kinds = 2
    for v in vars(config).values():
        if isinstance(v, (list, tuple, str)) and len(v) == n0 and n0 > 1:
            try:
                kinds = max(kinds, len(set(v)))
            except TypeError:  # unhashable entries (dicts): per-layer settings, kept whole
                pass
    return min(kinds, MAX_LAYERS)


def _shrink_layers(config, ch: dict, notes: list) -> None:
    key = next((k for k in _LAYER_COUNTS if isinstance(getattr(config, k, None), int)), None)
    if key is None:
        return
    n0 = getattr(config, key)
    n = min(n0, _depth(config, n0))
    if getattr(config, "num_kv_shared_layers", 0):  # Gemma 3n: later layers reuse earlier ones' KV
        n = max(n, 4)
        ch["num_kv_shared_layers"] = n // 2
    for k, v in list(vars(config).items()):
        if k.startswith("_") or n0 <= 1 or k in ch:
            continue
        if isinstance(v, (list, tuple)) and len(v) == n0:
            ch[k] = type(v)(_cover(list(v), n))
        elif isinstance(v, str) and len(v) == n0 and len(set(v)) <= 4:  # pattern strings (Nemotron-H "M*M-")
            ch[k] = "".join(_cover(list(v), n))
        elif isinstance(v, (list, tuple)) and v and all(isinstance(i, int) and 0 <= i < n0 for i in v) \
                and any(s in k for s in ("layers", "layer_idx", "indices", "idxs", "layer_ids")):
            ch[k] = type(v)([i for i in v if i < n] or [n - 1])  # layer index lists: one of that kind at least
    if "num_kv_shared_layers" in ch and isinstance(ch.get("layer_types"), list):
        half = ch["layer_types"][: n // 2]
        ch["layer_types"] = half + half  # the shared layers repeat the kinds of the layers they read from
    ch[key] = n
    for period, offset in _PERIODS:
        if isinstance(getattr(config, period, None), int):
            ch[period], ch[offset] = 2, 1
    if isinstance(getattr(config, "first_k_dense_replace", None), int) and config.first_k_dense_replace:
        ch["first_k_dense_replace"] = 1  # a dense layer, then MoE ones
    if n != n0:
        notes.append(f"layers {n0}->{n}")


_FILL_NONE = ("head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts")  # None = unset, not off


def _changes(config, notes: list) -> dict:
    """The tiny settings of one (sub-)config, as constructor keywords (derived fields are derived again)."""
    ch: dict = {}
    have = dict(vars(config))
    for k, v in _INTS.items():
        cur = have.get(k, getattr(config, k, None) if k in getattr(config, "attribute_map", {}) else None)
        if isinstance(cur, int) and not isinstance(cur, bool) and cur > 0:
            ch[k] = min(cur, v) if k in ("num_experts_per_tok", "moe_k", "top_k", "moe_topk") else v
        elif cur is None and k in _FILL_NONE and k in have:
            ch[k] = v
    q0, kv0 = have.get("num_attention_heads"), have.get("num_key_value_heads")
    if isinstance(kv0, int) and isinstance(q0, int):  # MHA stays MHA, GQA becomes 4:2, MQA 4:1
        ch["num_key_value_heads"] = 4 if kv0 == q0 else (1 if kv0 == 1 else 2)
    elif kv0 is None and isinstance(q0, int) and "num_key_value_heads" in have:  # unset: MHA (Nemotron)
        ch["num_key_value_heads"] = 4
    if "layer_types" in have and have["layer_types"] is None and "num_dense_layers" in have:  # LFM2-MoE
        ch["layer_types"] = ["conv", "full_attention"]
    if isinstance(have.get("qk_rope_head_dim"), int) and "head_dim" in have:  # MLA: head_dim is the RoPE part
        ch["head_dim"] = ch["qk_rope_head_dim"]
    for k in ("rotary_dim", "rotary_emb_base_dim"):  # GPT-J / CodeGen: RoPE on part of the head
        if isinstance(have.get(k), int):
            ch[k] = 8
    expand = have.get("mamba_expand", have.get("expand"))
    for heads, dim in (("mamba_n_heads", "mamba_d_head"), ("n_mamba_heads", "mamba_headdim")):
        if isinstance(have.get(heads), int) and isinstance(expand, int):  # heads x head dim = expand x hidden
            ch[dim] = 16
            ch[heads] = expand * 64 // 16
            if "mamba_d_ssm" in have:
                ch["mamba_d_ssm"] = expand * 64
    if config.model_type == "mamba2":
        ch["num_heads"], ch["head_dim"] = have.get("expand", 2) * 64 // 16, 16
    for k in ("chunk_size", "mamba_chunk_size"):
        if isinstance(have.get(k), int):
            ch[k] = 16
    for k in ("num_codebooks",):
        if isinstance(have.get(k), int):
            ch[k] = 1
    if "is_decoder" in have:
        ch["is_decoder"] = True
    for k in _TOKEN_IDS:  # ids inside the small vocabulary
        v = have.get(k)
        if isinstance(v, int) and v >= VOCAB:
            ch[k] = VOCAB - 1 - _TOKEN_IDS.index(k)
        elif isinstance(v, list) and any(isinstance(i, int) and i >= VOCAB for i in v):
            ch[k] = [min(i, VOCAB - 1) for i in v if isinstance(i, int)]
    for k, v in have.items():  # no randomness in training mode: dropout, layer drop, router jitter (PhiMoE)
        if isinstance(v, float) and v > 0 and any(s in k for s in ("dropout", "pdrop", "layerdrop", "jitter",
                                                                        "drop_path")):
            ch[k] = 0.0
    _shrink_layers(config, ch, notes)
    if "use_cache" in have:
        ch["use_cache"] = False
    return ch


def _tree(config, notes: list) -> dict:
    """The changes of a config and, as dicts, of its sub-configs (vision towers etc.)."""
    ch = _changes(config, notes)
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            ch[key] = {"model_type": getattr(sub, "model_type", None), **_tree(sub, [])}
    return ch


def tiny_config(model_type: str):
    """(config, notes): the family's default config shrunk (every sub-config too). Raises what the config raises."""
    cls = config_class(model_type)
    notes: list[str] = []
    return cls(**_tree(cls(), notes)), notes


def build(model_type: str, config=None, seed: int = 0):
    """The tiny float32 model (train mode) and the attention implementation of the reference: SDPA where the
    family supports it, else eager. Gated DeltaNet / Mamba decays drawn so the state lives for tens of tokens: with
    transformers' init the decay gradients (A_log, dt_bias) cancel below float32 resolution: the one-process float32
    reference is itself that far from float64, so no other summation order can match it (tests/test_census.py)."""
    import torch
    config = copy.deepcopy(config if config is not None else tiny_config(model_type)[0])
    cls = model_class(model_type)
    impl = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32, attn_implementation=impl)
    from ....recurrent.init import slow_decay_
    slow_decay_(model, seed)
    if hasattr(model, "set_default_language"):  # X-MOD: one language adapter for the whole batch
        model.set_default_language(next(iter(getattr(config, "languages", None) or ["en_XX"])))  # hybrids: decay gradients resolvable in float32, as ``check`` does (recurrent/init.py)
    return model.float().train(), impl


__all__ = ["tiny_config", "build", "model_class", "config_class", "WINDOW", "VOCAB"]
