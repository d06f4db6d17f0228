"""MoE under train.py: the router load-balancing loss over every rank's tokens equals one process."""
from __future__ import annotations

import shutil

import pytest
import torch

from easy_context_train.moe import aux_coef, router_aux_loss
from tests.model_equiv import build_model
from tests.test_train import TOY, _ok, launch, metrics, toy  # noqa: F401  (fixture)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_aux_loss_equals_hf_in_one_process(family):
    model = build_model(family)
    out = model(torch.randint(0, 128, (2, 24)), output_router_logits=True)
    _, value = router_aux_loss(out.router_logits, model.config)
    assert value == pytest.approx(float(out.aux_loss.detach()), rel=1e-6)


def test_aux_flag_checks(tmp_path):
    from easy_context_train.args import parse_args
    from easy_context_train.errors import UsageError
    base = ["--model", "m", "--dataset", "d", "--output-dir", str(tmp_path / "o")]
    llama, mixtral = build_model("llama").config, build_model("mixtral").config
    with pytest.raises(UsageError, match="--router-aux-loss-coef: LlamaConfig has no num_local_experts"):
        aux_coef(llama, parse_args(base + ["--router-aux-loss-coef", "0.1"]))
    assert aux_coef(mixtral, parse_args(base)) == 0.0  # HF's default: output_router_logits false
    mixtral.output_router_logits = True
    assert aux_coef(mixtral, parse_args(base)) == mixtral.router_aux_loss_coef
    assert aux_coef(mixtral, parse_args(base + ["--router-aux-loss-coef", "0.5"])) == 0.5
    with pytest.raises(SystemExit):
        parse_args(base + ["--router-aux-loss-coef", "-1"])


@pytest.mark.slow
def test_mixtral_zigzag_with_aux_loss_equals_single_process(toy, tmp_path):  # noqa: F811
    import transformers as tf
    model_dir = tmp_path / "tiny-mixtral"
    torch.manual_seed(0)
    vocab = tf.AutoTokenizer.from_pretrained(TOY["model"]).__len__()
    tf.MixtralForCausalLM(tf.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, bos_token_id=1,
        eos_token_id=2, rope_theta=10000.0)).save_pretrained(model_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TOY['model']}/{f}", model_dir / f)
    common = ["--model", str(model_dir), "--dataset", TOY["data"], "--seq-length", "128", "--max-train-steps", "3",
              "--gradient-accumulate-every", "2", "--learning-rate", "3e-3", "--warmup-steps", "1",
              "--router-aux-loss-coef", "0.5", "--no-save-model", "--timeout", "120"]
    _ok(launch(1, [*common, "--output-dir", str(tmp_path / "ref"), "--parallel_mode", "data_parallel"]))
    _ok(launch(2, [*common, "--output-dir", str(tmp_path / "zz"), "--parallel_mode", "zigzag_ring_attn"]))
    ref, got = metrics(tmp_path / "ref"), metrics(tmp_path / "zz")
    assert sorted(got) == [1, 2, 3]
    for s in got:
        for key in ("loss", "router_aux_loss"):
            assert abs(got[s][key] - ref[s][key]) <= 1e-4, (s, key, got[s], ref[s])
    assert ref[1]["router_aux_loss"] > 0.9  # E * sum f * P is ~1 when balanced: the term is really there
