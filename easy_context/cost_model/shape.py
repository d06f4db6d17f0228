"""The model's shape (from a built-in name or a config, no weights), its parameter count and FLOPs per token."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .constants import PlanUsageError, load_constants


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 1          # MoE: experts per layer (each a gated MLP of width moe_intermediate)
    experts_per_token: int = 1
    moe_intermediate: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    window: int | None = None  # the sliding window of every attention layer (hf.config.attention_window), else None

    @property
    def d_attn(self) -> int:  # width of q and of the attention output
        return self.heads * self.head_dim

    @property
    def d_kv(self) -> int:
        return self.kv_heads * self.head_dim

    def attn_params(self) -> int:
        h = self.hidden
        p = h * self.d_attn + 2 * h * self.d_kv + self.d_attn * h
        if self.qkv_bias:
            p += self.d_attn + 2 * self.d_kv
        if self.qk_norm:
            p += 2 * self.head_dim
        return p

    def mlp_params(self, active: bool = False) -> int:
        if self.experts > 1:
            n = self.experts_per_token if active else self.experts
            return n * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts  # + router
        return 3 * self.hidden * self.intermediate  # gated MLP: gate, up, down

    def layer_params(self) -> int:
        return self.attn_params() + self.mlp_params() + 2 * self.hidden  # + two RMSNorms

    def params(self) -> int:
        emb = self.vocab * self.hidden
        return emb * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden  # + final norm

    def matmul_params_active(self) -> int:
        """Per layer, the weights each token multiplies (MoE: its experts only)."""
        return self.attn_params() + self.mlp_params(active=True)

    def mlp_width_active(self) -> int:
        return self.experts_per_token * self.moe_intermediate if self.experts > 1 else self.intermediate


def model_flops_per_token(shape: Shape, seq_len: int) -> float:
    """The MFU FLOP count (README): 6·N_params + 6·n_layers·L·d_model (causal attention, fwd+bwd, no recompute)."""
    return 6.0 * shape.params() + 6.0 * shape.layers * seq_len * shape.hidden


def shape_from_dict(name: str, d: dict) -> Shape:
    from types import SimpleNamespace

    from ..hf.config import attention_window
    g = d.get
    heads = int(g("num_attention_heads"))
    hidden = int(g("hidden_size"))
    head_dim = g("head_dim") or hidden // heads
    experts = int(g("num_local_experts") or g("num_experts") or 1)
    return Shape(name=name, hidden=hidden, intermediate=int(g("intermediate_size") or 0),
                 layers=int(g("num_hidden_layers")), heads=heads,
                 kv_heads=int(g("num_key_value_heads") or heads), head_dim=int(head_dim),
                 vocab=int(g("vocab_size")), tied=bool(g("tie_word_embeddings", False)), experts=experts,
                 experts_per_token=int(g("num_experts_per_tok") or 1),
                 moe_intermediate=int(g("moe_intermediate_size") or g("intermediate_size") or 0),
                 qkv_bias=bool(g("attention_bias", False)) or g("model_type") in ("qwen2", "qwen2_moe"),
                 qk_norm=g("model_type") in ("qwen3", "qwen3_moe", "olmo2"),
                 window=attention_window(SimpleNamespace(**d)))


def load_shape(model: str) -> Shape:
    """A built-in name (plan_constants.json "shapes"), a model directory or a config.json path."""
    shapes = load_constants()["shapes"]
    if model.lower() in shapes:
        return shape_from_dict(model.lower(), shapes[model.lower()])
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise PlanUsageError(f"--model {model!r}: not a built-in shape ({', '.join(shapes)}) and no such file or "
                             "directory (pass a model directory or its config.json; nothing is downloaded)")
    try:
        from transformers import AutoConfig
        if os.path.isdir(path):
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        else:  # a config file of any name: AutoConfig wants a directory or config.json; build from its dict
            with open(path) as f:
                raw = json.load(f)
            cfg = AutoConfig.for_model(**raw)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        d = text.to_dict()
        for key in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size"):
            if d.get(key) is None:
                raise KeyError(key)
        d["tie_word_embeddings"] = getattr(cfg, "tie_word_embeddings", d.get("tie_word_embeddings", False))
        return shape_from_dict(os.path.basename(os.path.normpath(path)), d)
    except PlanUsageError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable config is one line, exit 2
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanUsageError(f"--model {model!r}: config unreadable ({type(e).__name__}: {msg[:200]})") from None
