"""A model the patch cannot route is refused, naming the layer class, at every door (issue #45): the library patch,
SeqParallelLM, train.py and `check` (before any process group), the Trainer integration (test_integrations.py).
Bloom, Falcon and MPT compute attention themselves in transformers 5 (each rank would attend to its own shard
only: silently wrong); Mamba has a recurrent mixer without a sequence-parallel path."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

from easy_context import apply_seq_parallel_monkey_patch
from easy_context.hf.route import attention_layers, check_config_routable

ROOT = Path(__file__).resolve().parents[1]
UNROUTABLE = {
    "bloom": (lambda: tf.BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=64), "BloomAttention"),
    "falcon": (lambda: tf.FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=64),
               "FalconAttention"),
    "mpt": (lambda: tf.MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64), "MptAttention"),
    "mamba": (lambda: tf.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64), "MambaMixer"),
}


def _model(config):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(UNROUTABLE))
def test_unroutable_models_are_refused_naming_the_layer(family):
    make, layer = UNROUTABLE[family]
    model = _model(make())
    before = {n: p.clone() for n, p in model.named_parameters()}
    impl = model.config._attn_implementation
    for mode in ("zigzag_ring_attn", "ulysses_attn", "usp_attn", "dist_flash_attn"):
        with pytest.raises(ValueError, match=layer):
            apply_seq_parallel_monkey_patch(mode, model)
        with pytest.raises(ValueError, match=layer):
            check_config_routable(make(), mode)
    assert model.config._attn_implementation == impl  # refused before anything was patched
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    check_config_routable(make(), "data_parallel")  # one process: nothing to route
    from easy_context.inference import SeqParallelLM
    with pytest.raises(ValueError, match=layer):
        SeqParallelLM(model, "zigzag_ring_attn")


def test_routable_families_pass_and_layers_are_found():
    small = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                 intermediate_size=64, vocab_size=64)
    for config in (tf.LlamaConfig(**small), tf.Qwen3Config(head_dim=8, **small),
                   tf.Gemma3TextConfig(head_dim=8, **small)):
        check_config_routable(config, "zigzag_ring_attn")
        with torch.device("meta"):
            assert len(attention_layers(tf.AutoModelForCausalLM.from_config(config))) == 2


def test_train_py_and_check_refuse_before_any_rank(tmp_path):
    """train.py (plain python, one line, exit 2 before the process group) and `check` (exit 2, no spawn)."""
    from easy_context.tools import check
    make, layer = UNROUTABLE["bloom"]
    make().save_pretrained(tmp_path / "bloom")
    assert check.main(["--model", str(tmp_path / "bloom"), "--parallel_mode", "zigzag_ring_attn"]) == 2
    out = subprocess.run([sys.executable, "train.py", "--model", str(tmp_path / "bloom"), "--dataset",
                          str(tmp_path / "none"), "--output-dir", str(tmp_path / "out"), "--seq-length", "64",
                          "--parallel_mode", "zigzag_ring_attn"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and layer in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_enable_sequence_parallel_refuses_before_reading_heads(tmp_path):
    """The Trainer door: a Bloom (and a Mamba, which has no num_attention_heads) is named, not an AttributeError."""
    from transformers import Trainer, TrainingArguments

    from easy_context.integrations import enable_sequence_parallel
    for family in ("bloom", "mamba"):
        make, layer = UNROUTABLE[family]
        trainer = Trainer(model=_model(make()), args=TrainingArguments(output_dir=str(tmp_path / family),
                                                                       use_cpu=True, report_to="none"))
        with pytest.raises(ValueError, match=layer):
            enable_sequence_parallel(trainer, mode="zigzag_ring_attn")
