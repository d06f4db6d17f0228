"""`python -m easy_context plan`: parameter count, MFU FLOPs, fit / no-fit verdicts, CLI, JSON, usage errors.
Pure arithmetic (no torch work, no spawns); the measured-point comparison is bench/plan_validation.py."""
from __future__ import annotations

import json

import pytest

from easy_context.tools import plan


def run(capsys, *argv):
    rc = plan.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_llama2_7b_parameter_count():
    s = plan.load_shape("llama-2-7b")
    assert s.params() == 6_738_415_616  # HF LlamaForCausalLM (Llama-2-7B) parameter count
    assert plan.load_shape("llama-3.2-3b").params() == 3_212_749_824  # tied embeddings


def test_config_dir_matches_builtin(tmp_path):
    cfg = dict(plan.load_constants()["shapes"]["llama-3-8b"], model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = plan.load_shape(str(tmp_path))
    assert s.params() == plan.load_shape("llama-3-8b").params() == 8_030_261_248
    assert (s.kv_heads, s.head_dim) == (8, 128)


def test_flops_follow_design_section5():
    s = plan.load_shape("llama-2-7b")
    L = 131072
    assert plan.model_flops_per_token(s, L) == 6 * s.params() + 6 * s.layers * L * s.hidden
    env = plan.Env(gpu="h200", gpus_per_node=1, nodes=1, seq_len=L)
    r = plan.predict(s, plan.Option("zigzag_ring_attn", 1, 1, "selective", True, False, "bare", kernel="fa4"), env)
    assert r["mfu"] == pytest.approx(plan.model_flops_per_token(s, L) * r["tokens_per_s"] / 989e12, rel=1e-3)
    assert r["mfu"] == pytest.approx(0.524, abs=0.01)  # docs/performance.md: 52.4% measured (calibration point)


def test_7b_128k_one_h200_fits_with_offload(capsys):
    rc, out, _ = run(capsys, "--model", "llama-2-7b", "--seq-length", "131072", "--gpus", "1", "--json")
    assert rc == 0
    best = json.loads(out)["candidates"][0]
    assert best["fits"] and best["checkpointing"] == "offload"
    assert best["gpu_peak_gib"] < 139.8 and "--checkpointing offload" in best["command"]
    assert "accelerate_configs/" in best["command"] and "train.py" in best["command"]


def test_offload_candidates_with_selective_layers(capsys):
    """An offload candidate with GPU memory to spare comes again with as many layers keeping their attention output
    as fit (memory/auto.py's rule): each adds one output + LSE and takes one attention forward recompute off the step;
    its command is --checkpointing auto (train.py chooses the layers from the budgets)."""
    s = plan.load_shape("llama-2-7b")
    env = plan.Env(gpu="h200", gpus_per_node=1, nodes=1, seq_len=524288, grad_accum=1, offload_every_k=2,
                   host_mem_gib=10_000)
    opt = plan.Option("zigzag_ring_attn", 1, 1, "offload", True, True, "bare", kernel="fa4", head_chunks=8)
    base = plan.predict(s, opt, env)
    from dataclasses import replace
    sel = plan.predict(s, replace(opt, selective_layers=16), env)
    out = (2 * s.d_attn + 4 * s.heads) * 524288 / 2**30
    # kept from the forward on (the peak is the larger of start-of-backward and grads-built-up: it rises by at most)
    assert base["gpu_peak_gib"] + 10 * out < sel["gpu_peak_gib"] <= base["gpu_peak_gib"] + 16 * out + 0.02
    assert 0.85 < sel["step_s"] / base["step_s"] < 0.95 and sel["selective_layers"] == 16
    from easy_context.tools.plan.search import with_selective
    row = with_selective(s, opt, env)
    assert row is not None and 0 < row["selective_layers"] <= s.layers and row["fits"]
    assert row["gpu_peak_gib"] <= 139.8 * plan.C("usable_gpu_fraction")
    rc, out_, _ = run(capsys, "--model", "llama-2-7b", "--seq-length", "131072", "--gpus", "1", "--json")
    rows = json.loads(out_)["candidates"]
    auto = [r for r in rows if r.get("selective_layers")]
    assert auto and all("--checkpointing auto" in r["command"] and "--offload-every-k" not in r["command"]
                        for r in auto)


def test_70b_1m_one_gpu_does_not_fit(capsys):
    rc, out, _ = run(capsys, "--model", "llama-2-70b", "--seq-length", "1048576", "--gpus", "1")
    assert rc == 1
    assert "nothing fits" in out and "GPU memory" in out


def test_multi_gpu_layouts_and_table(capsys):
    rc, out, _ = run(capsys, "--model", "llama-2-7b", "--seq-length", "524288", "--gpus", "8", "--top", "5")
    assert rc == 0 and "recommended" in out and "assumed NVLink" in out
    rc, out, _ = run(capsys, "--model", "llama-2-7b", "--seq-length", "524288", "--gpus", "8", "--json")
    rows = json.loads(out)["candidates"]
    modes = {r["mode"] for r in rows}
    assert {"zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"} <= modes
    fit = [r["tokens_per_s"] for r in rows if r["fits"]]
    assert fit == sorted(fit, reverse=True)
    assert all(r["dp"] * r["sp"] == 8 for r in rows)


@pytest.mark.parametrize("argv, needle", [
    (["--seq-length", "0", "--gpus", "1"], "--seq-length must be >= 1"),
    (["--seq-length", "-5", "--gpus", "1"], "--seq-length"),
    (["--seq-length", "1024", "--gpus", "0"], "--gpus must be >= 1"),
    (["--seq-length", "1024", "--gpus", "1", "--gpu", "v100"], "unknown"),
    (["--seq-length", "1024", "--gpus", "1", "--gpu-mem", "-1"], "--gpu-mem"),
])
def test_bad_args_exit_2(capsys, argv, needle):
    rc, out, err = run(capsys, "--model", "llama-2-7b", *argv)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and not out


def test_unreadable_config_exit_2(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    for model in (str(bad), str(tmp_path / "missing_dir")):
        rc, out, err = run(capsys, "--model", model, "--seq-length", "1024", "--gpus", "1")
        assert rc == 2 and "--model" in err and len(err.strip().splitlines()) == 1


def test_offload_nested_term_only_at_k_ge_2():
    """Offload k >= 2 carries the calibrated nested term (measured on an H200 and an H100 at 512K,
    bench/plan_validation.py); k = 1 does not. At 512K bare, k = 1 peaks on the gradient side (2 B x params) and k = 2
    on the kept side: the rebuilt input, its attention output + LSE and the term."""
    s = plan.load_shape("llama-2-7b")
    T = 524288
    opt = plan.Option("zigzag_ring_attn", 1, 1, "offload", True, True, "bare", kernel="fa4", head_chunks=8)

    def peak(k, gpu="h200"):
        env = plan.Env(gpu=gpu, gpus_per_node=1, nodes=1, seq_len=T, grad_accum=1, offload_every_k=k,
                       host_mem_gib=10_000)
        return plan.predict(s, opt, env)["gpu_peak_gib"]

    from easy_context.tools.plan.memory import attn_output_bytes
    term = plan.C("offload_nested_extra_bytes_per_token_dim")
    assert 4.0 < term < 7.0
    kept2 = (2 * s.hidden * T + attn_output_bytes(s, T) + term * s.hidden * T) / 2**30
    assert abs((peak(2) - peak(1)) - (kept2 - 2 * s.params() / 2**30)) < 0.05
    assert peak(2, "h100") == peak(2)  # memory does not depend on the card


def test_constants_have_value_unit_source():
    data = plan.load_constants()
    entries = list(data["constants"].values()) + [v for g in data["gpus"].values() for k, v in g.items()
                                                  if not k.startswith("_")]
    assert entries and all({"value", "unit", "source"} <= set(e) for e in entries)


def test_validation_points_within_tolerance():
    import bench.plan_validation as pv
    _, misses = pv.table()
    assert misses == 0
