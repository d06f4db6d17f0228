"""The model's shape (from a built-in name or a config, no weights), its parameter count and FLOPs per token."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .constants import PlanUsageError, load_constants
from .hybrid import RecurrentKind, kinds_from_config


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
    # hybrids (cost_model/hybrid.py): the recurrent layer kinds with their counts; softmax attention in the rest
    recurrent: tuple[RecurrentKind, ...] = ()
    mlp_layers: int | None = None  # layers with an MLP (None: every layer; nemotron_h: its "-" / "E" blocks)
    attn_output_gate: bool = False  # q_proj also yields a sigmoid gate of the attention output (qwen3_next, qwen3_5)
    shared_expert_intermediate: int = 0  # MoE: a gated shared expert of this width beside the routed ones
    mlp_matrices: int = 3  # 3: gated MLP (gate, up, down); 2: up, down (nemotron_h's relu^2)
    layer_kinds: tuple[str, ...] = ()  # hybrids: each layer's kind (hybrid.kinds_from_config); () = all attention

    @property
    def n_recurrent(self) -> int:
        return sum(r.count for r in self.recurrent)

    @property
    def attn_layers(self) -> tuple[int, ...]:  # indices of the softmax-attention layers
        return tuple(i for i, k in enumerate(self.layer_kinds or ("attention",) * self.layers) if k == "attention")

    @property
    def n_attn(self) -> int:  # softmax-attention layers
        mixers = self.layers if self.mlp_layers is None else self.layers - self.mlp_layers
        return mixers - self.n_recurrent

    @property
    def n_mlp(self) -> int:
        return self.layers if self.mlp_layers is None else self.mlp_layers

    @property
    def d_attn(self) -> int:  # width of q and of the attention output
        return self.heads * self.head_dim

    @property
    def d_kv(self) -> int:
        return self.kv_heads * self.head_dim

    def attn_params(self) -> int:
        h = self.hidden
        p = h * self.d_attn * (2 if self.attn_output_gate else 1) + 2 * h * self.d_kv + self.d_attn * h
        if self.qkv_bias:
            p += self.d_attn + 2 * self.d_kv
        if self.qk_norm:
            p += 2 * self.head_dim
        return p

    def mlp_params(self, active: bool = False) -> int:
        if self.experts > 1:
            n = self.experts_per_token if active else self.experts
            shared = 3 * self.hidden * self.shared_expert_intermediate + self.hidden if self.shared_expert_intermediate \
                else 0  # the shared expert and its gate
            return n * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts + shared  # + router
        return self.mlp_matrices * self.hidden * self.intermediate  # gated MLP: gate, up, down

    def layer_params(self) -> int:
        """The largest layer (what ZeRO-3 gathers at a time): a mixer (attention or recurrent) + its MLP + norms."""
        mixers = ([self.attn_params()] if self.n_attn else []) + [r.params(self.hidden) for r in self.recurrent]
        return max(mixers or [0]) + (self.mlp_params() if self.n_mlp else 0) + 2 * self.hidden  # + two RMSNorms

    def params(self) -> int:
        emb = self.vocab * self.hidden
        norms = (self.layers - (self.n_mlp if self.mlp_layers is not None else 0) + self.n_mlp) * self.hidden
        body = self.n_attn * self.attn_params() + self.n_mlp * self.mlp_params() \
            + sum(r.count * r.params(self.hidden) for r in self.recurrent)
        return emb * (1 if self.tied else 2) + body + norms + self.hidden  # + final norm

    def matmul_params_active(self) -> int:
        """Per layer (on average over the layers), the weights each token multiplies (MoE: its experts only)."""
        return self.matmul_params_active_total() / self.layers

    def matmul_params_active_total(self) -> int:
        """Over all layers, the weights each token multiplies (MoE: its experts only; recurrent layers: their
        projections)."""
        return self.n_attn * self.attn_params() + self.n_mlp * self.mlp_params(active=True) \
            + sum(r.count * r.proj_params(self.hidden) for r in self.recurrent)

    def recurrent_flops_per_token(self) -> float:
        """Forward FLOPs per token of every recurrent layer's state math (chunked rule / SSD / conv), all layers."""
        return sum(r.count * r.state_flops() for r in self.recurrent)

    def mlp_width_active(self) -> int:
        return self.experts_per_token * self.moe_intermediate if self.experts > 1 else self.intermediate


def model_flops_per_token(shape: Shape, seq_len: int) -> float:
    """The MFU FLOP count (README): 6·N_params + 6·n_layers·L·d_model (causal attention, fwd+bwd, no recompute).
    Hybrids: the attention term counts the softmax-attention layers only, and each recurrent layer adds 3 x its
    state math's forward FLOPs (cost_model/hybrid.py; independent of L)."""
    return 6.0 * shape.params() + 6.0 * shape.n_attn * seq_len * shape.hidden + 3.0 * shape.recurrent_flops_per_token()


def shape_from_dict(name: str, d: dict) -> Shape:
    from types import SimpleNamespace

    from ..hf.config import attention_window
    g = d.get
    heads = int(g("num_attention_heads"))
    hidden = int(g("hidden_size"))
    head_dim = g("head_dim") or hidden // heads
    experts = int(g("num_local_experts") or g("num_experts") or 1)
    if experts > 1 and len(g("mlp_only_layers") or ()) >= int(g("num_hidden_layers")):
        experts = 1  # qwen3_next with mlp_only_layers = every layer: dense MLPs
    try:
        per_layer, recurrent = kinds_from_config(d)
    except (ValueError, TypeError) as e:  # a kind named but its widths missing: not a config written for it
        raise PlanUsageError(f"{name}: {e}; plan prices gated DeltaNet (qwen3_next, qwen3_5), short convolutions "
                             "(lfm2) and Mamba-2 (nemotron_h)") from None
    mt = g("model_type") or ""
    block = mt == "nemotron_h" or any(k in ("mlp", "moe") for k in per_layer)  # a layer is a mixer OR an MLP
    gated = mt.startswith(("qwen3_next", "qwen3_5"))
    return Shape(name=name, hidden=hidden, intermediate=int(g("intermediate_size") or 0),
                 layers=len(per_layer) if block else int(g("num_hidden_layers")), heads=heads,
                 kv_heads=int(g("num_key_value_heads") or heads), head_dim=int(head_dim),
                 vocab=int(g("vocab_size")), tied=bool(g("tie_word_embeddings", False)), experts=experts,
                 experts_per_token=int(g("num_experts_per_tok") or 1),
                 moe_intermediate=int(g("moe_intermediate_size") or g("intermediate_size") or 0),
                 qkv_bias=bool(g("attention_bias", False)) or g("model_type") in ("qwen2", "qwen2_moe"),
                 qk_norm=mt in ("qwen3", "qwen3_moe", "olmo2", "lfm2") or gated,
                 window=attention_window(SimpleNamespace(**d)), recurrent=recurrent,
                 mlp_layers=sum(k in ("mlp", "moe") for k in per_layer) if block else None, attn_output_gate=gated,
                 shared_expert_intermediate=int(g("shared_expert_intermediate_size") or 0) if experts > 1 else 0,
                 mlp_matrices=2 if mt == "nemotron_h" else 3, layer_kinds=per_layer)


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
        if d.get("num_hidden_layers") is None and d.get("layers_block_type"):  # nemotron_h: the block list
            d["num_hidden_layers"] = len(d["layers_block_type"])
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
