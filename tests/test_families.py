"""More model families under every sequence-parallel mode: MoE (Mixtral, Qwen3-MoE), fused projections (Phi-3),
q/k norms (OLMo-2), Gemma 3 (local/global layers with a window >= the length, query_pre_attn_scalar). Each equals
one process (logits, loss, every gradient; float32, rel 1e-5), W = 2 for every mode and W = 4 (zigzag, USP) for
one MoE family; packed documents for two; soft-capping and windows shorter than the sequence refuse by name."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.model_equiv import EXTRA_FAMILIES

MODES = ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn")


def _refusals(rank, world_size):
    import transformers as tf

    from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
    from tests.model_equiv import build_model
    torch.manual_seed(0)
    gemma2 = tf.Gemma2ForCausalLM(tf.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, attn_logit_softcapping=50.0, sliding_window=4096)).float()
    windowed = build_model("mistral", sliding_window=8)
    for model, match in ((gemma2, r"attn_logit_softcapping=50.0\) is not supported"),
                         (windowed, r"window 8\) shorter than the sequence \(32 tokens\)")):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
        p = prepare_seq_parallel_inputs("zigzag_ring_attn", torch.randint(0, 128, (1, 32)),
                                        torch.arange(32)[None], torch.zeros(1, 32, dtype=torch.long), rank,
                                        world_size, torch.device("cpu"))
        with pytest.raises(ValueError, match=match):
            model(p["local_input_ids"], position_ids=p["local_position_ids"], use_cache=False)


def _w2(rank, world_size):
    from tests.model_equiv import check_model_equivalence
    for family in EXTRA_FAMILIES:
        for mode in MODES:
            check_model_equivalence(rank, world_size, mode, family, labels_mask="random")
    check_model_equivalence(rank, world_size, "zigzag_ring_attn", "phi3", patch="family")
    docs = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2,
                         3, 4])  # documents across shard / zigzag-chunk edges, one of length 1
    for family, mode in (("mixtral", "zigzag_ring_attn"), ("gemma3", "ulysses_attn")):
        check_model_equivalence(rank, world_size, mode, family, position_ids=docs)
    # RoPE scaling types: positions stay global, so every scaled rotary is exact under every mode
    for rope in ({"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                 {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 16},
                 {"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}):
        for mode in MODES:
            check_model_equivalence(rank, world_size, mode, "llama", model_kw={"rope_parameters": rope})
    _refusals(rank, world_size)
    # Gemma 3's local layers really run through the SP attention (a short window is seen, and refused)
    with pytest.raises(ValueError, match="window 8"):
        check_model_equivalence(rank, world_size, "zigzag_ring_attn", "gemma3", model_kw={"sliding_window": 8})


def _w4(rank, world_size):
    from easy_context import ParallelLayout
    from tests.model_equiv import check_model_equivalence
    check_model_equivalence(rank, world_size, "zigzag_ring_attn", "qwen3_moe")
    usp = ParallelLayout.build("usp_attn", ring_degree=2)
    check_model_equivalence(rank, world_size, "usp_attn", "qwen3_moe", layout_kw=usp.layout_kw,
                            groups=usp.attn_groups(), sp_group=usp.sp_group, labels_mask="random")


@pytest.mark.parametrize("world,body", [(2, _w2), (4, _w4)], ids=["W2", "W4"])
def test_families_equal_single_process(world, body):
    run_ranks(body, world_size=world, timeout=300)
