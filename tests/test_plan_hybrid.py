"""`python -m easy_context plan` on hybrids (issue #49): a Qwen3.5-9B-shape config (transformers' Qwen3_5TextConfig
defaults: 24 gated DeltaNet + 8 attention layers) and a Qwen3-Next MoE at 7-9B widths. Parameter counts equal the
model's; at 128K the hybrid's FLOPs and predicted step are below its attention-only twin's; the state exchange
bytes and the working set follow cost_model/hybrid.py's formulas. Arithmetic only (models built on the meta device)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from easy_context.tools import plan

L = 131072


def _qwen35(**kw):
    import transformers as tf
    return tf.Qwen3_5TextConfig(**kw)  # the Qwen3.5-9B shape: hidden 4096, 32 layers, 3 linear : 1 full


def _qwen3_next(**kw):
    import transformers as tf
    return tf.Qwen3NextConfig(**{**dict(hidden_size=4096, num_hidden_layers=8, num_experts=16, num_experts_per_tok=4,
                                         moe_intermediate_size=1024, shared_expert_intermediate_size=1024), **kw})


def _shape(cfg, name="hybrid"):
    return plan.shape_from_dict(name, cfg.to_dict())


def _hf_params(cfg) -> int:
    import torch
    import transformers as tf
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("make", [_qwen35, _qwen3_next])
def test_hybrid_parameter_count_matches_the_model(make):
    cfg = make()
    s = _shape(cfg)
    assert s.params() == _hf_params(cfg)
    kinds = cfg.layer_types
    assert s.n_attn == kinds.count("full_attention") and s.recurrent[0].count == kinds.count("linear_attention")


def test_hybrid_flops_and_step_below_attention_only_twin_at_128k():
    hyb = _shape(_qwen35())
    twin = _shape(_qwen35(layer_types=["full_attention"] * 32), "twin")
    assert not twin.recurrent and twin.n_attn == 32 and hyb.n_attn == 8
    f_h, f_t = plan.model_flops_per_token(hyb, L), plan.model_flops_per_token(twin, L)
    assert f_h < 0.6 * f_t, (f_h, f_t)
    # the attention term shrinks to the 8 softmax layers; the recurrent state math adds 3 x its forward FLOPs
    r = hyb.recurrent[0]
    assert f_h == pytest.approx(6 * hyb.params() + 6 * 8 * L * 4096 + 3 * 24 * r.state_flops())
    env = plan.Env(gpu="h200", gpus_per_node=1, nodes=1, seq_len=L, grad_accum=1)
    opt = plan.Option("zigzag_ring_attn", 1, 1, "layer", True, True, "bare", kernel="fa4")
    p_h, p_t = plan.predict(hyb, opt, env), plan.predict(twin, opt, env)
    assert p_h["step_s"] < p_t["step_s"], (p_h, p_t)
    # the model file's torch rule (measured ~0.2 TFLOP/s at 128K) makes the hybrid slower than its twin
    slow = plan.predict(hyb, replace(opt, linear_kernel="torch"), env)
    assert slow["step_s"] > p_t["step_s"] > p_h["step_s"]


@pytest.mark.parametrize("mode, pieces", [("zigzag_ring_attn", 2), ("ulysses_attn", 1), ("dist_flash_attn", 1)])
def test_state_exchange_bytes_equal_the_formula(mode, pieces):
    from easy_context.cost_model.step_time import recurrent_exchange
    s = _shape(_qwen35())
    H, dk, dv, K, conv = 32, 128, 128, 4, 2 * 16 * 128 + 32 * 128
    per_piece = 4 * H * dk * (dk + dv) + 2 * (K - 1) * conv + 4  # (R, P) fp32 + the bf16 conv tail + its flag
    assert sum(s.recurrent[0].piece_bytes()) == per_piece
    assert 4 * H * dk * (dk + dv) == 4 * 2**20  # 4 MiB of (R, P) per piece and row
    sp, B = 8, 2
    opt = plan.Option(mode, 1, sp, "layer", True, True, "bare", kernel="fa4")
    sent, msgs = recurrent_exchange(s, opt, B)
    assert sent == 24 * pieces * (sp - 1) * B * per_piece and msgs == 24 * 2
    env = plan.Env(gpu="h200", gpus_per_node=8, nodes=1, seq_len=L, batch=B, grad_accum=1)
    row = plan.predict(s, opt, env)
    assert row["recurrent_exchange_mib_per_micro"] == pytest.approx(3 * sent / 2**20, abs=0.01)  # fwd, recompute, bwd
    assert row["breakdown_s"]["recurrent_comm"] > 0
    assert recurrent_exchange(s, replace(opt, sp=1), B) == (0.0, 0)


def test_hybrid_memory_terms():
    """The selective option keeps attention outputs of the softmax layers only; the recurrent working set follows
    the per-token formula and holds every piece's summary when sp > 1."""
    from easy_context.cost_model.memory import attn_output_bytes, recurrent_working_set
    s = _shape(_qwen35())
    T = L
    env = plan.Env(gpu="h200", gpus_per_node=1, nodes=1, seq_len=L, grad_accum=1)
    opt = plan.Option("zigzag_ring_attn", 1, 1, "layer", True, True, "zero3-offload", kernel="fa4")
    lay = plan.gpu_memory(s, opt, env, T, 1)
    sel = plan.gpu_memory(s, replace(opt, checkpointing="selective"), env, T, 1)
    assert sel - lay == pytest.approx(s.n_attn * attn_output_bytes(s, T))
    r = s.recurrent[0]
    assert recurrent_working_set(s, opt, T, 1) == pytest.approx(plan.C("recurrent_ws_factor") * r.working_set_per_token(4096) * T)
    sp8 = replace(opt, sp=8)
    assert recurrent_working_set(s, sp8, T / 8, 1) - recurrent_working_set(s, sp8, 0, 1) == pytest.approx(
        plan.C("recurrent_ws_factor") * r.working_set_per_token(4096) * T / 8)
    assert recurrent_working_set(s, sp8, 0, 1) == 16 * sum(r.piece_bytes())  # 2 pieces x 8 ranks


def test_plan_cli_prices_a_qwen35_run(capsys, tmp_path):
    _qwen35().save_pretrained(tmp_path)
    rc = plan.main(["--model", str(tmp_path), "--seq-length", str(L), "--gpus", "8", "--top", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "hybrid: 24 gated DeltaNet + 8 softmax attention layers" in out and "4096.0 KiB" in out
    rc = plan.main(["--model", str(tmp_path), "--seq-length", str(L), "--gpus", "8", "--json"])
    rows = json.loads(capsys.readouterr().out)["candidates"]
    sp = [r for r in rows if r["sp"] > 1]
    assert sp and all(r["recurrent_exchange_mib_per_micro"] > 0 and r["linear_kernel"] == "fla" for r in sp)


def test_unpriced_recurrent_layer_type_is_a_usage_error():
    d = dict(_qwen35().to_dict(), layer_types=["rwkv_block", "full_attention"] * 16)
    with pytest.raises(plan.PlanUsageError, match="rwkv_block"):
        plan.shape_from_dict("x", d)
    d = dict(_qwen35().to_dict(), layer_types=["chunked_attention"] * 32)  # not recurrent: softmax attention
    assert plan.shape_from_dict("x", d).n_attn == 32


def test_auto_checkpointing_keeps_only_the_softmax_layers_outputs():
    """--checkpointing auto on a hybrid: selective layers are softmax-attention layers only (the last ones first), and
    the working set is the larger of one attention layer's and one gated DeltaNet layer's backward."""
    from easy_context.cost_model.hybrid import kinds_from_config
    from easy_context.memory.auto import GiB, choose_checkpointing
    cfg = _qwen35()
    per_layer = kinds_from_config(cfg.to_dict())[0]
    attn = [i for i, k in enumerate(per_layer) if k == "attention"]
    assert len(attn) == 8 and attn[-1] == 31  # 3 linear : 1 full over 32 layers
    s = _shape(cfg)
    gpu = (139.8 - 36.0) * GiB  # an H200 after bf16 weights + gradients of ~9B parameters
    assert s.attn_layers == tuple(attn)
    roomy = choose_checkpointing(s, 131072, gpu, 200 * GiB)
    assert roomy.selective_layers == tuple(attn)  # every softmax output fits; no recurrent layer is "selective"
    tight = choose_checkpointing(s, 327680, gpu, 200 * GiB)
    assert tight.selective_layers == (15, 19, 23, 27, 31)  # the last softmax layers only, as many as fit
    with pytest.raises(ValueError, match="one layer's backward"):  # gated DeltaNet's working set, not attention's
        choose_checkpointing(s, 524288, gpu, 200 * GiB)
    # one process may run the recurrent layers in tiles (configure_memory's recurrent_tiles): 512K then fits, with
    # the fewest tiles that fit (each costs one more forward of those layers); 128K needs none
    from easy_context.memory.auto import TILES
    tiled = choose_checkpointing(s, 524288, gpu, 200 * GiB, recurrent_tiles=TILES)
    fewer = tiled.recurrent_tiles // 2
    assert tiled.recurrent_tiles > 1 and "recurrent layers in" in tiled.describe()
    with pytest.raises(ValueError, match="one layer's backward"):
        choose_checkpointing(s, 524288, gpu, 200 * GiB, recurrent_tiles=(fewer,))
    assert choose_checkpointing(s, 131072, gpu, 200 * GiB, recurrent_tiles=TILES).recurrent_tiles == 1
