"""Tiny random hybrid (softmax + recurrent) models for the tests of easy_context.recurrent (issue #30).

``make_hybrid_config(family)`` gives a float32-friendly config with one linear/recurrent layer and one softmax
layer (order: recurrent first, so a wrong state reaches the attention layer too); ``build_hybrid(family)`` the
model, same seed -> same weights on every rank."""
from __future__ import annotations

import contextlib

import torch

# supported (adapters in easy_context/recurrent) and refused-but-buildable families
SUPPORTED = ("qwen3_next", "lfm2", "qwen3_5")
MAMBA2 = ("nemotron_h", "falcon_h1", "bamba", "granitemoehybrid")  # Mamba-2 adapter (recurrent/mamba2.py)
REFUSED = ("mamba2", "jamba")

_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=4096, tie_word_embeddings=False)


def make_hybrid_config(family: str, layers: tuple[str, ...] | None = None, **overrides):
    import transformers as tf
    kw = dict(_ATTN)
    if family in ("qwen3_next", "qwen3_5"):
        kw.update(intermediate_size=96, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                  layer_types=list(layers or ("linear_attention", "full_attention")),
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.25})
        kw["num_hidden_layers"] = len(kw["layer_types"])
        if family == "qwen3_next":
            cls = tf.Qwen3NextConfig
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)
        else:
            cls = tf.Qwen3_5TextConfig
    elif family == "lfm2":
        cls = tf.Lfm2Config
        kw.update(intermediate_size=96, conv_L_cache=3, conv_bias=True, block_auto_adjust_ff_dim=False,
                  layer_types=list(layers or ("conv", "full_attention")), rope_parameters={"rope_theta": 50000.0})
        kw["num_hidden_layers"] = len(kw["layer_types"])
    elif family == "nemotron_h":
        cls = tf.NemotronHConfig
        kw.update(intermediate_size=96, layers_block_type=["mamba", "attention"], head_dim=16, ssm_state_size=8,
                  mamba_num_heads=4, mamba_head_dim=16, n_groups=1, conv_kernel=4, chunk_size=8, expand=1)
    elif family == "falcon_h1":
        cls = tf.FalconH1Config
        kw.update(intermediate_size=96, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                  mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8)
    elif family == "bamba":
        cls = tf.BambaConfig
        kw.update(intermediate_size=96, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4,
                  mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8,
                  mamba_expand=1)
    elif family == "granitemoehybrid":
        cls = tf.GraniteMoeHybridConfig
        kw.update(intermediate_size=96, num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=0,
                  shared_intermediate_size=96, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                  mamba_d_conv=4, mamba_chunk_size=8, mamba_expand=1)
    elif family == "mamba2":
        cls = tf.Mamba2Config
        kw = dict(hidden_size=64, vocab_size=128, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8,
                  expand=1, n_groups=1, conv_kernel=4, chunk_size=8, tie_word_embeddings=False)
    elif family == "jamba":
        cls = tf.JambaConfig
        kw.update(intermediate_size=96, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1)
    else:
        raise ValueError(f"unknown hybrid family {family!r}; choose one of {SUPPORTED + MAMBA2 + REFUSED}")
    kw.update(overrides)
    return cls(**kw)


def build_hybrid(family: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    import transformers as tf
    torch.manual_seed(seed)
    if family == "mamba2":  # no attention layer at all
        attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(make_hybrid_config(family, **overrides), dtype=torch.float32,
                                                attn_implementation=attn_implementation)
    if family in ("qwen3_next", "qwen3_5"):  # a decay that keeps the state alive (easy_context/recurrent/init.py)
        from easy_context.recurrent.init import slow_decay_
        slow_decay_(model, seed)
    return model.float().train()


@contextlib.contextmanager
def drop_recurrent_state():
    """The mutation the hybrid tests run (kept out of library code): every recurrent state a rank receives from
    another is replaced by zeros — the serial chain's receives and the parallel paths' published pieces of other
    ranks (recurrent/exchange.py) — i.e. what crosses ranks is lost; an equivalence test must then fail."""
    import torch

    from easy_context.recurrent import chain, exchange
    recv, publish = chain._recv, exchange._Publish.forward

    def forward(ctx, plan, like, *local):
        out, k = publish(ctx, plan, like, *local), len(like)
        return tuple(t if plan.pieces[j // k].owner == plan.me else torch.zeros_like(t) for j, t in enumerate(out))
    chain._recv = lambda like, src: tuple(torch.zeros_like(b) for b in recv(like, src))
    exchange._Publish.forward = staticmethod(forward)
    try:
        yield
    finally:
        chain._recv, exchange._Publish.forward = recv, staticmethod(publish)
