"""One record per model family: everything the package needs to know about it, in one place.

Adding a family is one entry here (plus a tiny config in tests/model_equiv.py). The SP attention needs nothing
per family (every listed attention class dispatches through transformers' ``ALL_ATTENTION_FUNCTIONS``); the
entry names the attention class for the family-string patch and, when the family's RMSNorm is the Llama form or
the (1 + w) fp32 form and its RoPE the plain Llama one, opts it into the lean norm (``ops/lean_norm.py``) and the
fused RoPE (``ops/rope.py``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str                    # transformers.models.<name>.modeling_<name>
    attention: str               # attention class (family-string patch, compat check)
    norm: str | None = None      # RMSNorm class the lean/fused norm replaces exactly (None: HF's own)
    fused_rope: bool = False     # apply_rotary_pos_emb is x*cos + rotate_half(x)*sin (checked at patch time)
    model_types: tuple[str, ...] = ()  # config.model_type values other than ``name``
    recurrent: tuple[str, ...] = ()    # recurrent layer classes (hybrids, issue #30): run by easy_context.recurrent's
    #                                    chain, on model instances only (a family-string patch of a hybrid is refused)
    norm_plus_one: bool = False  # that class is the (1 + w) form in fp32 (Gemma, Qwen3-Next, Qwen3.5), not w * n


_TABLE = (
    Family("llama", "LlamaAttention", "LlamaRMSNorm", True),
    Family("mistral", "MistralAttention", "MistralRMSNorm", True),
    Family("qwen2", "Qwen2Attention", "Qwen2RMSNorm", True),
    Family("qwen3", "Qwen3Attention", "Qwen3RMSNorm", True),
    Family("mixtral", "MixtralAttention"),           # MoE: routing is per token, untouched by SP
    Family("qwen2_moe", "Qwen2MoeAttention"),
    Family("qwen3_moe", "Qwen3MoeAttention"),
    Family("phi3", "Phi3Attention"),                  # fused qkv_proj / gate_up_proj
    Family("olmo2", "Olmo2Attention"),                # q/k norms over all heads
    Family("gemma3", "Gemma3Attention", "Gemma3RMSNorm", model_types=("gemma3_text",), norm_plus_one=True),
    # hybrids: softmax layers as above; the linear / conv layers through easy_context/recurrent (docs/hybrid.md)
    Family("qwen3_next", "Qwen3NextAttention", "Qwen3NextRMSNorm", norm_plus_one=True,
           recurrent=("Qwen3NextGatedDeltaNet",)),  # gated DeltaNet + MoE
    Family("qwen3_5", "Qwen3_5Attention", "Qwen3_5RMSNorm", model_types=("qwen3_5_text",), norm_plus_one=True,
           recurrent=("Qwen3_5GatedDeltaNet",)),
    Family("lfm2", "Lfm2Attention", "Lfm2RMSNorm", recurrent=("Lfm2ShortConv",)),  # short convolutions
)
# Hybrid Mamba-2 models (issue #30): the softmax layers as above, the Mamba-2 mixers run by
# easy_context/recurrent/mamba2.py. falcon_h1 runs attention and a mixer side by side in every layer.
_TABLE += (
    Family("nemotron_h", "NemotronHAttention", recurrent=("NemotronHMamba2Mixer",)),  # no RoPE
    Family("bamba", "BambaAttention", recurrent=("BambaMixer",)),
    Family("granitemoehybrid", "GraniteMoeHybridAttention", recurrent=("GraniteMoeHybridMambaLayer",)),
    Family("falcon_h1", "FalconH1Attention", recurrent=("FalconH1Mixer",)),
)
FAMILIES: dict[str, Family] = {f.name: f for f in _TABLE}

# Families whose attention computes something the sequence-parallel kernels do not (issue #59's census): refused by
# config.model_type before anything is patched or any collective runs (hf/route.py), with what differs and where.
REFUSED: dict[str, str] = {
    "doge": "DogeAttention adds a learned dynamic mask to the attention logits (exp(A * softplus(dt_proj(v))) per key "
            "and head, top-k kept beyond keep_window_size; transformers models/doge/modeling_doge.py, "
            "prepare_dynamic_mask) through attention_mask; the kernels take no additive bias, so the logits and the "
            "gradients of A and dt_proj would be wrong",
    "deepseek_v4": "DeepseekV4Attention appends compressed-KV entries (the CSA / HCA compressor, with a per-query block "
                   "bias) to the keys of its own rank's tokens (transformers models/deepseek_v4/modeling_deepseek_v4.py, "
                   "DeepseekV4Attention.forward): keys outnumber queries and each rank would compress only its shard",
}
NORM_CLASSES: tuple[str, ...] = tuple(f.norm for f in _TABLE if f.norm)
PLUS_ONE_NORMS: tuple[str, ...] = tuple(f.norm for f in _TABLE if f.norm and f.norm_plus_one)
ROPE_ATTENTIONS: tuple[str, ...] = tuple(f.attention for f in _TABLE if f.fused_rope)


def refusal(config) -> tuple[str, str] | None:
    """(model_type, reason) when ``config`` (or its text config) is a family listed in REFUSED, else None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in (config, text):
        mt = getattr(c, "model_type", None)
        if mt in REFUSED:
            return mt, REFUSED[mt]
    return None


def family_of_model_type(model_type: str | None) -> str | None:
    """The family name of a ``config.model_type`` (None when not listed)."""
    for f in _TABLE:
        if model_type == f.name or model_type in f.model_types:
            return f.name
    return None


__all__ = ["Family", "FAMILIES", "REFUSED", "refusal", "NORM_CLASSES", "PLUS_ONE_NORMS", "ROPE_ATTENTIONS", "family_of_model_type"]
