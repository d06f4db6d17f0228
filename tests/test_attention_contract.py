"""The attention call's contract (issue #59, easy_context/hf/contract.py): every argument the sequence-parallel attention
receives is implemented or refused by name.

Implemented, exact against one process (fp32, logits 1e-5 relative, every gradient 1e-4): gpt-oss sinks, DeepSeek-V3
MLA (value head dim != q/k head dim), Llama 4 chunked attention + NoPE q temperature, EXAONE 4's sliding:global layers,
under zigzag and Ulysses on 2 gloo ranks (dist_flash and USP 4 in the slow set), plain and packed rows. Refused, one line
naming the family, the layer and the argument, before the kernels run (config-level ones when the model is patched,
before any collective).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.harness import run_ranks

CONTRACT = ("gpt_oss", "deepseek_v3", "llama4_text", "exaone4")
GRAD_REL = 1e-4
# two documents restarting at 0 (a chunk of 8 and a window of 8 both cut inside them)
PACKED = torch.cat([torch.arange(20), torch.arange(12)]).unsqueeze(0)


def _equiv(rank, world_size, modes, packed_families, ring_degree=None):
    from easy_context import ParallelLayout
    from tests.model_equiv import check_model_equivalence
    for mode in modes:
        kw = {}
        if mode == "usp_attn":  # ring x ulysses groups from one layout (both degrees > 1 at W=4)
            usp = ParallelLayout.build("usp_attn", ring_degree=ring_degree)
            kw = dict(layout_kw=usp.layout_kw, groups=usp.attn_groups(), sp_group=usp.sp_group)
        for family in CONTRACT:
            check_model_equivalence(rank, world_size, mode, family, seq_len=32, rel=GRAD_REL, **kw)
        for family in packed_families:
            check_model_equivalence(rank, world_size, mode, family, seq_len=32, rel=GRAD_REL, position_ids=PACKED,
                                    **kw)


def test_contract_families_2_ranks():
    """The four families of #59, exact under zigzag and Ulysses; packed rows for sinks and chunks (zigzag)."""
    run_ranks(_equiv, 2, args=(("zigzag_ring_attn", "ulysses_attn"), ("gpt_oss", "llama4_text")), timeout=600)


@pytest.mark.slow
def test_contract_families_dist_flash_and_packed_ulysses_2_ranks():
    run_ranks(_equiv, 2, args=(("dist_flash_attn",), CONTRACT), timeout=600)


@pytest.mark.slow
def test_contract_families_usp_4_ranks():
    run_ranks(_equiv, 4, args=(("usp_attn",), ("gpt_oss", "llama4_text")), kwargs={"ring_degree": 2}, timeout=900)


# ------------------------------------------------------------------------------------------ kernels, one process
def _sink_reference(q, k, v, sinks, scale):
    """Eager softmax over [causal scores, sink] (gpt-oss' eager_attention_forward, in (B, L, H, D))."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, n, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("mode", ["zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"])
def test_sinks_one_rank_match_eager(mode):
    """Each mode's public function with ``sinks=`` equals the eager sink softmax, forward and every gradient."""
    import easy_context as ec
    fn = {"zigzag_ring_attn": ec.zigzag_ring_attn_func, "dist_flash_attn": ec.dist_flash_attn_func,
          "ulysses_attn": ec.ulysses_attn_func, "usp_attn": ec.usp_attn_func}[mode]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    scale = 1 / math.sqrt(8)
    out = fn(q, k, v, softmax_scale=scale, causal=True, sinks=sinks)
    ref = _sink_reference(q, k, v, sinks, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    want = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    for name, a, b in zip("qkvs", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{mode} d{name}: {m}")


# ------------------------------------------------------------------------------------------ refusals
def _llama():
    from tests.model_equiv import build_model
    return build_model("llama")


def _call(attn_fn, model, attention_mask=None, **kwargs):
    layer = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    return attn_fn(layer, q, kv, kv, attention_mask, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"attention_mask": torch.zeros(1, 1, 8, 8)}, r"llama layer 0 \(LlamaAttention\) passes its own attention_mask"),
    ({"softcap": 50.0}, r"llama layer 0 \(LlamaAttention\) passes attention logit soft-capping \(softcap=50.0\)"),
    ({"is_causal": False}, r"passes is_causal=False"),
    ({"token_type_ids": torch.ones(1, 8)}, r"passes the argument token_type_ids=<tensor \(1, 8\)>"),
    ({"some_new_flag": "x"}, r"passes the argument some_new_flag='x'"),
    ({"s_aux": torch.zeros(3)}, r"attention sinks of shape \(3,\) for 4 q heads"),
])
def test_each_unimplemented_argument_is_refused_by_name(kwargs, match):
    """A hand-built call per argument: one line naming family, layer and argument, before any kernel or collective
    (no process group exists here: reaching a collective would raise something else)."""
    from easy_context.hf.attention import make_attention_fn
    from easy_context.hf.contract import AttentionContractError
    from easy_context.registry import get_mode
    fn = make_attention_fn(get_mode("zigzag_ring_attn"))
    with pytest.raises(AttentionContractError, match=match) as err:
        _call(fn, _llama(), **kwargs)
    assert "\n" not in str(err.value)


def test_neutral_arguments_pass():
    """Arguments that do not change attention's result (use_cache, varlen boundaries of the same documents) run."""
    from easy_context.hf.attention import make_attention_fn
    from easy_context.registry import get_mode
    fn = make_attention_fn(get_mode("zigzag_ring_attn"))
    out, _ = _call(fn, _llama(), use_cache=False, output_attentions=False, is_causal=True,
                   cu_seq_lens_q=torch.tensor([0, 8]), max_length_q=8)
    assert out.shape == (1, 8, 4, 16)


def test_config_level_refusals_before_any_collective():
    """Known from the config: an unknown layer type and logit soft-capping are refused when the model is patched
    (no process group exists here)."""
    from easy_context import apply_seq_parallel_monkey_patch
    from easy_context.hf.contract import AttentionContractError
    from tests.model_equiv import build_model
    model = build_model("exaone4")
    model.config.layer_types = ["sliding_attention", "bidirectional_attention", "sliding_attention",
                                "full_attention"]
    with pytest.raises(AttentionContractError, match=r"exaone4 layer 1 \(Exaone4Attention\) passes layer type "
                                                     r"'bidirectional_attention'"):
        apply_seq_parallel_monkey_patch("ulysses_attn", model)
    import transformers as tf
    cfg = tf.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=64)
    with pytest.raises(ValueError, match=r"gemma2 layer 0 .*soft-capping"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", tf.Gemma2ForCausalLM(cfg))


def test_chunked_documents_start_at_each_document():
    """Llama 4's chunks of a packed row start at each document's own position 0, and keep the cut's layout flag."""
    from easy_context import packing
    docs = packing.documents(PACKED)
    chunked = docs.with_chunks(8)
    assert chunked.doc_ids[0].tolist() == [0] * 8 + [1] * 8 + [2] * 4 + [3] * 8 + [4] * 4
    assert chunked.packed == docs.packed and chunked.pairs(2) == docs.pairs(2)
    plain = packing.Documents(torch.zeros(1, 32, dtype=torch.long))
    assert not plain.with_chunks(8).packed and plain.with_chunks(8).count() == 4
