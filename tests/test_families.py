"""More model families under every sequence-parallel mode: MoE (Mixtral, Qwen3-MoE), fused projections (Phi-3),
q/k norms (OLMo-2), Gemma 3 (local/global layers with a window >= the length, query_pre_attn_scalar). Each equals
one process (logits, loss, every gradient; float32, rel 1e-5), W = 2 for every mode (USP as ring 2) and W = 4
(zigzag, USP 2x2) for one MoE family; packed documents for two; sliding windows (shorter than a chunk, longer than a shard, 2 tokens,
Gemma 3's local layers, with packed documents) under every mode; soft-capping refuses by name."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.model_equiv import EXTRA_FAMILIES

MODES = ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn")
# documents across shard / zigzag-chunk edges, one of length 1 (32 tokens)
DOCS = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4])


def _refusals(rank, world_size):
    import transformers as tf

    from easy_context import apply_seq_parallel_monkey_patch
    from tests.model_equiv import build_model
    torch.manual_seed(0)
    gemma2 = tf.Gemma2ForCausalLM(tf.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, attn_logit_softcapping=50.0, sliding_window=4096)).float()
    # refused when patched (issue #59: known from the config, before any collective)
    for model, match in ((gemma2, r"gemma2 layer 0 \(Gemma2Attention\) passes attention logit soft-capping "
                                  r"\(config.attn_logit_softcapping=50.0\)"),):
        with pytest.raises(ValueError, match=match):
            apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)


def _w2(rank, world_size):
    from tests.model_equiv import check_model_equivalence
    from easy_context import ParallelLayout
    usp = ParallelLayout.build("usp_attn", ring_degree=2)  # W=2: ring 2 x ulysses 1 (USP's ring path)
    for family in EXTRA_FAMILIES:
        for mode in MODES:
            check_model_equivalence(rank, world_size, mode, family, labels_mask="random")
        check_model_equivalence(rank, world_size, "usp_attn", family, layout_kw=usp.layout_kw,
                                groups=usp.attn_groups(), sp_group=usp.sp_group)
    check_model_equivalence(rank, world_size, "zigzag_ring_attn", "phi3", patch="family")
    for family, mode in (("mixtral", "zigzag_ring_attn"), ("gemma3", "ulysses_attn")):
        check_model_equivalence(rank, world_size, mode, family, position_ids=DOCS)
    # RoPE scaling types: positions stay global, so every scaled rotary is exact under every mode
    for rope in ({"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                 {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 16},
                 {"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}):
        for mode in MODES:
            check_model_equivalence(rank, world_size, mode, "llama", model_kw={"rope_parameters": rope})
    _refusals(rank, world_size)
    _windows(rank, world_size)


def _windows(rank, world_size):
    """Sliding windows shorter than a shard, longer than one, of 2 tokens; Gemma 3's local layers; with packing."""
    from tests.model_equiv import check_model_equivalence
    for mode in MODES:
        for w in (5, 24, 2):
            check_model_equivalence(rank, world_size, mode, "mistral", model_kw={"sliding_window": w},
                                    labels_mask="random" if w == 5 else None)
        check_model_equivalence(rank, world_size, mode, "gemma3", model_kw={"sliding_window": 6})
        check_model_equivalence(rank, world_size, mode, "mistral", model_kw={"sliding_window": 4}, position_ids=DOCS)


def _w4(rank, world_size):
    from easy_context import ParallelLayout
    from tests.model_equiv import check_model_equivalence
    check_model_equivalence(rank, world_size, "zigzag_ring_attn", "qwen3_moe")
    usp = ParallelLayout.build("usp_attn", ring_degree=2)
    check_model_equivalence(rank, world_size, "usp_attn", "qwen3_moe", layout_kw=usp.layout_kw,
                            groups=usp.attn_groups(), sp_group=usp.sp_group, labels_mask="random")
    # sliding windows on 4 ranks: zigzag (window < a chunk of 4 rows, window > a shard) and USP
    for w in (3, 13):
        check_model_equivalence(rank, world_size, "zigzag_ring_attn", "mistral", model_kw={"sliding_window": w})
        check_model_equivalence(rank, world_size, "usp_attn", "mistral", layout_kw=usp.layout_kw,
                                groups=usp.attn_groups(), sp_group=usp.sp_group, model_kw={"sliding_window": w})
    check_model_equivalence(rank, world_size, "usp_attn", "gemma3", layout_kw=usp.layout_kw, groups=usp.attn_groups(),
                            sp_group=usp.sp_group, model_kw={"sliding_window": 5}, position_ids=DOCS)


@pytest.mark.parametrize("world,body", [(2, _w2), (4, _w4)], ids=["W2", "W4"])
def test_families_equal_single_process(world, body):
    run_ranks(body, world_size=world, timeout=300)


def test_train_keeps_the_sliding_window_unless_asked(tmp_path):
    from easy_context_train.args import parse_args
    from easy_context_train.modeling import load_config
    from tests.model_equiv import make_config
    make_config("mistral", sliding_window=8).save_pretrained(tmp_path / "mistral")
    make_config("gemma3", sliding_window=8).save_pretrained(tmp_path / "gemma3")
    base = ["--dataset", "d", "--output-dir", str(tmp_path / "o")]
    for name in ("mistral", "gemma3"):
        args = parse_args(["--model", str(tmp_path / name), *base])
        assert load_config(args.model, None, args).sliding_window == 8  # the model as it is: exact under SP
        args = parse_args(["--model", str(tmp_path / name), *base, "--no-sliding-window"])
        cfg = load_config(args.model, None, args)
        assert cfg.sliding_window is None if name == "mistral" else cfg.sliding_window >= 2 ** 30
        if name == "gemma3":
            assert "sliding_attention" in cfg.layer_types  # local layers keep their own RoPE
