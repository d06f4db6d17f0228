"""train.py extras (#18, #19): held-out eval loss, RoPE scaling flags, LoRA; 2 ranks (zigzag) == 1 process.

Reuses tests/test_train.py's toy fixture and launcher; one launch pair covers eval + RoPE scaling.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.test_train import COMMON, STEPS, TOY, _ok, launch, metrics, toy  # noqa: F401 - fixture

EVAL_ROWS = 3


@pytest.fixture(scope="module")
def eval_data(toy):  # noqa: F811
    """Held-out rows with labels (some -100) and packed-document positions (a document starts mid-row)."""
    import datasets
    src = datasets.load_from_disk(toy["data"])
    n = len(src["input_ids"][0])
    rows = [{"input_ids": ids, "labels": [-100] * 7 + ids[7:], "position_ids": list(range(50)) + list(range(n - 50))}
            for ids in src["input_ids"][-EVAL_ROWS - 1:]]
    path = os.path.join(toy["base"], "eval_rows")
    datasets.Dataset.from_list(rows).save_to_disk(path)
    return path


def _train(nproc, out, mode, extra):
    return launch(nproc, ["--model", TOY["model"], "--dataset", TOY["data"], "--output-dir", str(out),
                          "--parallel_mode", mode, *COMMON, *extra])


def _close(a, b, tol=1e-4):
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


# ---------------------------------------------------------------- end to end
EVAL_FLAGS = ["--eval-every", "2", "--eval-rows", str(EVAL_ROWS)]
ROPE_FLAGS = ["--rope-scaling", "yarn", "--rope-factor", "4", "--rope-original-max-positions", "32"]


@pytest.mark.slow
def test_eval_loss_and_yarn_zigzag_equal_single_process(toy, eval_data, tmp_path):  # noqa: F811
    """One launch pair: held-out eval_loss (#19) and yarn-scaled RoPE (#18), W=2 zigzag == 1 process."""
    runs = {}
    for nproc, mode in ((1, "data_parallel"), (2, "zigzag_ring_attn")):
        out = tmp_path / f"{mode}"
        save = ["--no-save-model"] if nproc == 1 else []
        _ok(_train(nproc, out, mode, [*EVAL_FLAGS, "--eval-dataset", eval_data, *ROPE_FLAGS, *save]))
        runs[nproc] = metrics(out)
    one, two = runs[1], runs[2]
    evals = {n: {s: r["eval_loss"] for s, r in m.items() if "eval_loss" in r} for n, m in runs.items()}
    assert sorted(evals[1]) == sorted(evals[2]) == [2, 4, STEPS], evals  # every 2 steps and at the end
    assert _close([evals[1][s] for s in (2, 4, 5)], [evals[2][s] for s in (2, 4, 5)]), evals
    assert _close([one[s]["loss"] for s in sorted(one)], [two[s]["loss"] for s in sorted(two)]), (one, two)
    assert evals[2][STEPS] < evals[2][2]  # the toy corpus is learnable, held-out rows too
    # the scaling is trained with and saved: config.json and the reloaded model carry it (theta kept)
    out = tmp_path / "zigzag_ring_attn"
    rp = json.load(open(out / "config.json"))["rope_parameters"]
    assert rp == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                  "rope_theta": 20000.0}, rp
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(str(out)).model.rotary_emb.rope_type == "yarn"


# ---------------------------------------------------------------- RoPE scaling: fast unit tests
def _llama_config(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=64, max_position_embeddings=256, rope_theta=20000.0, **kw)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "llama3"])
def test_rope_scaling_config(rope_type):
    from transformers import LlamaForCausalLM

    from easy_context_train.modeling import set_rope_scaling
    cfg = _llama_config()
    set_rope_scaling(cfg, rope_type, 4.0, None if rope_type == "linear" else 64)
    rp = cfg.rope_parameters
    assert rp["rope_type"] == rope_type and rp["factor"] == 4.0 and rp["rope_theta"] == 20000.0
    assert rp.get("original_max_position_embeddings") == (64 if rope_type in ("yarn", "llama3") else None)
    if rope_type == "llama3":
        assert (rp["low_freq_factor"], rp["high_freq_factor"]) == (1.0, 4.0)
    # dynamic reads its base length from max_position_embeddings; the others name the extended length
    assert cfg.max_position_embeddings == {"dynamic": 64, "linear": 1024}.get(rope_type, 256)
    cfg.validate_rope()  # HF accepts it ...
    rot = LlamaForCausalLM(cfg).model.rotary_emb  # ... and builds the scaled rotary
    assert rot.rope_type == rope_type
    # re-scaling replaces the previous type's keys (no llama3 leftovers in a yarn config)
    set_rope_scaling(cfg, "yarn", 2.0, 64)
    assert "low_freq_factor" not in cfg.rope_parameters and cfg.rope_parameters["factor"] == 2.0


def test_rope_scaling_errors():
    from easy_context_train.args import parse_args
    from easy_context_train.errors import UsageError
    from easy_context_train.modeling import check_rope_for_sp, set_rope_scaling
    for bad in (None, 1.0, 0.5):
        with pytest.raises(UsageError, match="--rope-factor > 1"):
            set_rope_scaling(_llama_config(), "yarn", bad)
    cfg = _llama_config()
    set_rope_scaling(cfg, "dynamic", 2.0)
    check_rope_for_sp(cfg, "data_parallel")
    with pytest.raises(UsageError, match="sequence-parallel"):
        check_rope_for_sp(cfg, "zigzag_ring_attn")
    base = ["--output-dir", "/tmp/easy_context_unused_out"]
    for argv, needle in ((["--rope-scaling", "yarn"], "needs --rope-factor > 1"),
                         (["--rope-scaling", "yarn", "--rope-factor", "1"], "needs --rope-factor > 1"),
                         (["--rope-factor", "4"], "need --rope-scaling"),
                         (["--rope-scaling", "linear", "--rope-factor", "2", "--rope-original-max-positions", "8"],
                          "linear scaling has no original length"),
                         (["--rope-scaling", "dynamic", "--rope-factor", "2"], "sequence-parallel"),
                         (["--eval-every", "2"], "needs --eval-dataset")):
        with pytest.raises(SystemExit):
            parse_args(base + argv)


def test_fused_rope_is_exact_under_yarn():
    """The fused RoPE consumes the cos/sin of the model's (scaled) rotary module: same logits and grads."""
    import copy

    import torch
    from transformers import LlamaForCausalLM

    from easy_context.ops import apply_fused_ops
    from easy_context_train.modeling import set_rope_scaling
    torch.manual_seed(0)
    cfg = _llama_config()
    set_rope_scaling(cfg, "yarn", 4.0, 16)
    ref = LlamaForCausalLM(cfg).float()
    fused = copy.deepcopy(ref)
    assert apply_fused_ops(fused, norms=False)["rope"] == 1
    ids = torch.randint(0, 64, (1, 48))
    outs = []
    for m in (ref, fused):
        out = m(input_ids=ids).logits
        out.square().sum().backward()
        outs.append((out.detach(), m.model.layers[0].self_attn.q_proj.weight.grad))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-6) and torch.allclose(outs[0][1], outs[1][1], atol=1e-6)


# ---------------------------------------------------------------- LoRA
def test_merged_state_dict_equals_peft_model():
    """--merge-lora's fold (W + B A alpha/r; modules_to_save copies) gives the PeftModel's logits."""
    import argparse

    import torch
    from transformers import LlamaForCausalLM

    from easy_context_train.lora import apply_lora, merged_state_dict
    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config())
    args = argparse.Namespace(lora_rank=4, lora_alpha=None, lora_targets="q_proj,v_proj,down_proj",
                              lora_train_embeddings_norms=True)
    peft_model = apply_lora(base, args)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if p.requires_grad:  # adapters (B starts at 0) and trainable embedding / norm copies
                p.add_(torch.randn_like(p) * 0.05)
    assert all(not p.requires_grad for n, p in peft_model.named_parameters() if "lora_" not in n
               and ".modules_to_save." not in n)
    merged = LlamaForCausalLM(_llama_config())
    merged.load_state_dict(merged_state_dict(peft_model.state_dict(), peft_model.peft_config["default"]))
    ids = torch.randint(0, 64, (1, 24))
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)


@pytest.mark.slow
def test_lora_zigzag_equals_single_process_and_saves_adapter(toy, tmp_path):  # noqa: F811
    """LoRA under zigzag (selective checkpointing, chunked loss, merge), Ulysses (layer checkpointing, periodic
    checkpoints of the PEFT model under ZeRO-3, a crash after step 4 and --resume) and dist_flash_attn
    (checkpoint offload: reentrant-style backward with frozen inputs) == LoRA in 1 process; the adapter loads back."""
    from tests.test_train import _env
    lora = ["--lora-rank", "4", "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj",
            "--lora-train-embeddings-norms"]
    one, two, uly, dfa = tmp_path / "one", tmp_path / "two", tmp_path / "uly", tmp_path / "dfa"
    _ok(_train(1, one, "data_parallel", [*lora, "--no-save-model"]))
    _ok(_train(2, two, "zigzag_ring_attn", [*lora, "--merge-lora", "--chunked-loss", "--checkpointing", "selective"]))
    uly_args = [*lora, "--no-save-model", "--checkpoint-every", "2"]
    p = launch(2, ["--model", TOY["model"], "--dataset", TOY["data"], "--output-dir", str(uly),
                   "--parallel_mode", "ulysses_attn", *COMMON, *uly_args], env=_env(EASY_CONTEXT_CRASH="step:4"))
    assert p.returncode != 0 and (uly / "checkpoints" / "step-0000004").is_dir(), p.stderr[-2000:]
    p = _train(2, uly, "ulysses_attn", [*uly_args, "--resume"])
    _ok(p)
    assert "resumed from" in p.stdout + p.stderr
    _ok(_train(2, dfa, "dist_flash_attn", [*lora, "--no-save-model", "--checkpointing", "offload"]))
    a, b, c, d = metrics(one), metrics(two), metrics(uly), metrics(dfa)
    la, lb, lc, ld = ([m[s]["loss"] for s in sorted(m)] for m in (a, b, c, d))
    assert len(la) == STEPS and _close(la, lb) and _close(la, lc) and _close(la, ld), (la, lb, lc, ld)
    assert lb[-1] < lb[0] - 0.1, lb  # the adapters learn
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    adapter = two / "adapter"
    assert (adapter / "adapter_model.safetensors").exists() and (adapter / "adapter_config.json").exists()
    cfg = json.load(open(adapter / "adapter_config.json"))
    assert cfg["r"] == 4 and set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"}
    # the adapter loads back onto the base (with the training RoPE theta) and gives the merged model's logits
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(TOY["model"])
    cfg.rope_parameters["rope_theta"] = 20000.0  # COMMON's --rope-theta
    base = AutoModelForCausalLM.from_pretrained(TOY["model"], config=cfg)
    ids = torch.randint(0, 300, (1, 64))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        got = PeftModel.from_pretrained(base, str(adapter))(input_ids=ids).logits
        want = AutoModelForCausalLM.from_pretrained(str(two))(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert not torch.allclose(before, want, atol=1e-3)  # training changed the model


def test_checkpointing_flag_choices_are_configure_memorys_plus_auto():
    from easy_context.cost_model.constants import PLANNED_CHECKPOINTING
    from easy_context.memory import CHECKPOINTING
    from easy_context_train.args import CHECKPOINTING as FLAG
    assert FLAG == (*CHECKPOINTING, "auto") and set(PLANNED_CHECKPOINTING) <= set(CHECKPOINTING)
