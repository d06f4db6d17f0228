"""``python -m easy_context check``: passes on correct set-ups, fails on injected wrong ones, usage errors early.

Spawning ranks costs seconds of imports each, so the multi-rank cases share one 4-rank spawn (``run_cases``)
and the CLI end to end runs once on 2 ranks.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from easy_context.tools import check

ROOT = Path(__file__).resolve().parents[1]
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, rope_theta=50000.0)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """User-style model dirs: config.json only (no weights)."""
    import transformers as tf
    root = tmp_path_factory.mktemp("models")
    tf.LlamaConfig(**_TINY).save_pretrained(root / "llama")
    tf.Qwen2Config(**{**_TINY, "rope_theta": 1e6}, use_sliding_window=False).save_pretrained(root / "qwen2")
    # a "big" Llama-3-like config: 32 q / 8 kv heads of 64, shrunk by --hidden
    tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=1000, rope_parameters={
                       "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}).save_pretrained(root / "big")
    tf.MistralConfig(**_TINY, sliding_window=8).save_pretrained(root / "windowed")
    # every other supported family, as a user's config.json (built from tests/model_equiv's tiny configs)
    from tests.model_equiv import CONTRACT_FAMILIES, EXTRA_FAMILIES, make_config
    for family in CONTRACT_FAMILIES:  # issue #59: sinks (gpt-oss: no SDPA, judged against eager), MLA, chunks
        make_config(family).save_pretrained(root / family)
    for family in EXTRA_FAMILIES:
        extra = {"sliding_window": 6} if family == "gemma3" else {}  # local layers really windowed
        make_config(family, num_hidden_layers=4, **extra).save_pretrained(root / family)
    return root


# every supported family under some mode (all modes across them), in the shared 4-rank spawn
FAMILY_CASES = {"mixtral": ["--parallel_mode", "ulysses_attn", "--seq-len", "24"],
                "qwen2_moe": ["--parallel_mode", "zigzag_ring_attn", "--sp_size", "2"],
                "qwen3_moe": ["--parallel_mode", "usp_attn", "--ring_degree", "2"],
                "phi3": ["--parallel_mode", "dist_flash_attn"],
                "olmo2": ["--parallel_mode", "zigzag_ring_attn", "--packed"],
                "gemma3": ["--parallel_mode", "zigzag_ring_attn", "--seq-len", "32"],
                "gpt_oss": ["--parallel_mode", "zigzag_ring_attn", "--seq-len", "32", "--packed"],
                "deepseek_v3": ["--parallel_mode", "ulysses_attn", "--seq-len", "32"],
                "llama4_text": ["--parallel_mode", "usp_attn", "--ring_degree", "2", "--seq-len", "32", "--packed"],
                "exaone4": ["--parallel_mode", "dist_flash_attn", "--seq-len", "32"]}


def _plan(argv):
    return check.plan_case(check.build_parser().parse_args(argv))


def test_cli_end_to_end(configs, capsys):
    # one rank keeps this cheap; the multi-rank cases run in test_cases_on_four_ranks' single spawn
    code = check.main(["--model", str(configs / "llama" / "config.json"), "--parallel_mode", "zigzag_ring_attn",
                       "--world", "1", "--packed"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "\nPASS" in out and "rope       default, theta 50000" in out and "dp 1 x sp 1" in out, out


def test_cases_on_four_ranks(configs):
    llama, qwen2 = ["--model", str(configs / "llama")], ["--model", str(configs / "qwen2")]
    argvs = {  # failing cases last: a failure that left ranks out of step would spoil the cases after it
        "zigzag_sp2_dp2": llama + ["--world", "4", "--sp_size", "2"],
        "usp": llama + ["--parallel_mode", "usp_attn", "--world", "4", "--ring_degree", "2"],
        "usp_packed": llama + ["--parallel_mode", "usp_attn", "--world", "4", "--ring_degree", "2", "--packed"],
        "qwen2_zigzag_dp2_packed": qwen2 + ["--world", "4", "--sp_size", "2", "--packed"],
        "qwen2_ulysses": qwen2 + ["--parallel_mode", "ulysses_attn", "--world", "4", "--seq-len", "24"],
        "big_shrunk_dist_flash": ["--model", str(configs / "big"), "--parallel_mode", "dist_flash_attn",
                                  "--world", "4", "--hidden", "256", "--vocab", "64"],
        **{f"family_{f}": ["--model", str(configs / f), "--world", "4", *a] for f, a in FAMILY_CASES.items()},
        "windowed_zigzag_packed": ["--model", str(configs / "windowed"), "--world", "4", "--seq-len", "32",
                                   "--packed"],
        # attention blocks in head groups over offloaded checkpoints (q/k/v biases in qwen2)
        "heads_qwen2_zigzag_dp2_packed": qwen2 + ["--world", "4", "--sp_size", "2", "--packed", "--head-chunks", "2"],
        "heads_usp": llama + ["--parallel_mode", "usp_attn", "--world", "4", "--ring_degree", "2", "--head-chunks", "2"],
        "theta": llama + ["--parallel_mode", "usp_attn", "--world", "4", "--ring_degree", "2",
                          "--inject", "theta_mismatch"],
        "ring": llama + ["--parallel_mode", "usp_attn", "--world", "4", "--ring_degree", "2",
                         "--inject", "ring_degree_mismatch"],
    }
    planned = {name: _plan(a) for name, a in argvs.items()}
    outcomes = check.run_cases([c for c, _ in planned.values()], world=4, timeout=300)
    reports = {}
    for (name, (case, info)), outcome in zip(planned.items(), outcomes):
        reports[name] = check.judge(case, info, outcome)
    for name in ("zigzag_sp2_dp2", "usp", "usp_packed", "qwen2_zigzag_dp2_packed", "qwen2_ulysses", "big_shrunk_dist_flash",
                 "windowed_zigzag_packed", "heads_qwen2_zigzag_dp2_packed", "heads_usp",
                 *(f"family_{f}" for f in FAMILY_CASES)):
        text, code = reports[name]
        assert code == 0 and "\nPASS" in text, f"{name}:\n{text}"
    assert "R2×U2" in reports["usp"][0]
    assert "attention blocks in 2 head groups" in reports["heads_usp"][0], reports["heads_usp"][0]
    assert "logits dp 1" in reports["qwen2_zigzag_dp2_packed"][0] and "docs" in reports["usp_packed"][0]
    assert "window     8\n" in reports["windowed_zigzag_packed"][0], reports["windowed_zigzag_packed"][0]
    big = reports["big_shrunk_dist_flash"][0]
    assert "llama3, theta 500000" in big and "factor=32.0" in big and "4 q / 1 kv heads, head_dim 64" in big, big

    text, code = reports["theta"]
    assert code == 1 and "\nFAIL" in text and "theta 200000" in text and "<- differs" in text, text
    text, code = reports["ring"]
    assert code == 1 and "\nFAIL" in text and "sharded for ring 2, attention run with ring 4" in text, text
    assert "rope       default, theta 50000" in text, text  # the model summary is there even when the run raised


@pytest.mark.parametrize("argv, message", [
    (["--parallel_mode", "ring"], "unknown --parallel_mode 'ring'; valid modes: data_parallel"),
    (["--parallel_mode", "usp_attn", "--world", "4", "--ring_degree", "3"], "ring_degree (3) must divide 4"),
    (["--world", "3", "--sp_size", "2"], "sp_size must divide 3"),
    (["--parallel_mode", "zigzag_ring_attn", "--ring_degree", "2"], "only applies to usp_attn"),
    (["--world", "2", "--seq-len", "6"], "must be a multiple of 4"),
    (["--parallel_mode", "ulysses_attn", "--world", "8"], "heads"),
    (["--inject", "ring_degree_mismatch"], "needs --parallel_mode usp_attn"),
    (["--hidden", "48"], "valid values: 32"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--head-chunks", "3"], "--head-chunks 3 must divide the 2 kv heads"),
    (["--parallel_mode", "data_parallel", "--head-chunks", "2"], "--head-chunks needs a sequence-parallel mode"),
])
def test_usage_errors(configs, capsys, argv, message):
    assert check.main(["--model", str(configs / "llama")] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_usage_errors_config(configs, tmp_path, capsys):
    assert check.main(["--model", str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert check.main(["--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    assert check.main(["--model", str(tmp_path / "config.json")]) == 2
    assert "cannot read the config" in capsys.readouterr().err
    assert check.main(["--model", str(configs / "phi3"), "--head-chunks", "2"]) == 2  # fused qkv_proj
    assert "Phi3Attention is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        check.main(["--model", str(configs / "llama"), "--inject", "bogus"])
    assert e.value.code == 2


def test_shrink_keeps_attention_geometry(configs):
    case, info = _plan(["--model", str(configs / "big"), "--hidden", "512", "--layers", "3"])
    c = case.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (3, 512, 8, 2, 64)
    assert c.intermediate_size == 2048 and c.vocab_size == 1000
    assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["rope_theta"] == 500000.0
    assert case.seq_len == 16 and case.ring is None and case.sp_config is None
    case, _ = _plan(["--model", str(configs / "llama"), "--rope-theta", "1e7", "--inject", "theta_mismatch",
                     "--parallel_mode", "usp_attn", "--world", "4"])
    assert case.config.rope_parameters["rope_theta"] == 1e7 and case.sp_config.rope_parameters["rope_theta"] == 4e7
    assert case.ring == case.ring_run == 4


def test_layer_types_keep_every_kind():
    types = ["sliding_attention"] * 5 + ["full_attention"]
    assert check._pick_layer_types(types, 2) == ["sliding_attention", "full_attention"]
    assert check._pick_layer_types(types, 1) == ["sliding_attention"]


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "easy_context", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "check" in out.stdout and "plan" in out.stdout, out
    out = subprocess.run([sys.executable, "-m", "easy_context", "frobnicate"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr, out
    out = subprocess.run([sys.executable, "-m", "easy_context", "check", "--model", "/nonexistent"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no such file or directory" in out.stderr, out


def test_missing_command_module_is_reported(monkeypatch, capsys):
    import easy_context.__main__ as entry
    monkeypatch.setitem(entry.COMMANDS, "plan", ("easy_context.tools.no_such_tool", "x"))
    assert entry.main(["plan"]) == 2
    assert "not available" in capsys.readouterr().err


def test_train_commands_have_their_own_door(capsys):
    """#61: the recipe's commands live behind `python -m easy_context_train`; the old spelling runs them after one
    line saying where they went, and the library's door lists only its own tools."""
    import easy_context.__main__ as lib
    import easy_context_train.__main__ as train
    assert lib.main(["--help"]) == 0 and "retrieval-data" not in capsys.readouterr().out
    assert train.main(["--help"]) == 0 and "retrieval-data" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:  # argparse's --help
        lib.main(["faults", "--help"])
    assert done.value.code == 0
    err = capsys.readouterr().err
    assert "moved to `python -m easy_context_train faults`" in err, err
