"""A Llama-2-7B-shaped model (random init, bf16) built directly on the GPU, and step helpers."""
from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist


def llama7b_config(tiny: bool = False):
    from transformers import LlamaConfig
    if tiny:  # CPU smoke test of the benchmark code paths
        return LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=256, max_position_embeddings=1 << 20)
    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=1 << 21,
                       rope_theta=1e7)


def mistral7b_config(window: int | None = 4096, tiny: bool = False):
    """Mistral-7B v0.1 shape (GQA 32/8, MLP 14336, sliding window 4096)."""
    from transformers import MistralConfig
    if tiny:
        return MistralConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, sliding_window=window and 16)
    return MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1 << 21,
                         rope_theta=1e7, sliding_window=window)


def build_model(config, device, attn="sdpa"):
    from transformers import AutoModelForCausalLM
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    finally:
        torch.set_default_dtype(prev)
    model.config.use_cache = False
    return model.train()


def one_rank_group():
    """A single-rank process group so the sequence-parallel code path runs unchanged on one GPU."""
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def model_flops_per_token(model, seq_len: int) -> float:
    """MFU FLOP count (docs/performance.md): 6·N + 6·n_layers·L·d_model (causal attn, fwd+bwd, no recompute)."""
    c = model.config
    return 6.0 * n_params(model) + 6.0 * c.num_hidden_layers * seq_len * c.hidden_size
