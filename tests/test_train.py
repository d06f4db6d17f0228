"""train.py end to end on CPU: 2 processes, gloo, DeepSpeed ZeRO-3 (accelerate_configs/cpu.yaml), float32.

One tiny local fixture (Llama from a config, byte-level tokenizer, packed toy corpus) shared by every test;
few launches: a single-process reference, one 2-process run per mode, and a crash/resume chain.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.background import Background
from tests.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, STEPS, LR, WARMUP = 128, 5, 3e-3, 2
COMMON = ["--seq-length", str(SEQ), "--max-train-steps", str(STEPS), "--gradient-accumulate-every", "2",
          "--learning-rate", str(LR), "--warmup-steps", str(WARMUP), "--rope-theta", "20000", "--timeout", "120"]


def _env(**extra):
    # the venv's bin first, as `make` does: DeepSpeed's JIT-built ops are cached per build environment
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("EASY_CONTEXT_CRASH", None)
    env.update(extra)
    return env


def _launch_cmd(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            os.path.join(ROOT, "accelerate_configs", "cpu.yaml"), "--num_processes", str(nproc),
            "--main_process_port", str(free_port()), os.path.join(ROOT, "train.py"), *args]


def launch(nproc: int, args: list[str], env: dict | None = None, timeout: int = 300):
    """accelerate launch train.py with the CPU DeepSpeed config (also for one process: same code path)."""
    return subprocess.run(_launch_cmd(nproc, args), cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)


def _train_args(out, mode, extra=()) -> list[str]:
    return ["--model", TOY["model"], "--dataset", TOY["data"], "--output-dir", str(out), "--parallel_mode", mode,
            *COMMON, *extra]


def run_train(nproc, out, mode, extra=(), env=None):
    return launch(nproc, _train_args(out, mode, extra), env=env)


def metrics(out) -> dict[int, dict]:
    rows = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            rows[r["step"]] = r
    return rows


def losses(out) -> list[float]:
    m = metrics(out)
    return [m[s]["loss"] for s in sorted(m)]


def _ok(p):
    assert p.returncode == 0, f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"


TOY: dict = {}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from easy_context_train.toy import build_all
    base = tmp_path_factory.mktemp("toy")
    paths = build_all(str(base), seq_lengths=(SEQ,), n_docs=120)
    TOY.update(model=paths["model"], data=paths[f"data_{SEQ}"], base=str(base))
    return TOY


@pytest.fixture(scope="module")
def reference(toy, tmp_path_factory):
    """Single-process run (data_parallel, DeepSpeed, 1 rank): the loss curve every sp mode must match. Started here,
    in the background: one process leaves a core free, the test's own 2-rank launch runs beside it; ``reference()``
    waits for it and returns the curve."""
    out = tmp_path_factory.mktemp("ref")
    job = Background(_launch_cmd(1, _train_args(out, "data_parallel")), _env(), ROOT, timeout=300)
    curve: list = []

    def result() -> list[float]:
        if not curve:
            _ok(job.wait())
            curve.append(losses(out))
        return curve[0]
    yield result
    job.stop()


# ---------------------------------------------------------------- fast unit tests
def test_lr_schedule_reaches_flag():
    from easy_context_train.optim import lr_factor
    assert [lr_factor(s, 2, 10, "constant", 0.1) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(1, 2, 10, "cosine", 0.1) == 1.0
    assert abs(lr_factor(10, 2, 10, "cosine", 0.1) - 0.1) < 1e-12
    assert abs(lr_factor(6, 2, 10, "linear", 0.0) - 0.5) < 1e-12


def test_no_decay_groups():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from easy_context_train.optim import param_groups
    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert "model.embed_tokens.weight" in nd and "model.norm.weight" in nd
    assert all("norm" in n or "embed" in n for n in nd)
    assert all(p.dim() == 2 for p in decay["params"]) and torch.is_tensor(decay["params"][0])


_WRITER = r"""
import os, signal, sys
from easy_context_train.checkpoint import _publish
root, step = sys.argv[1], sys.argv[2]
name = f"step-{step}"
tmp = os.path.join(root, f".tmp-{name}")  # as save_checkpoint: written here, renamed to step-* when complete
os.makedirs(tmp)
open(os.path.join(tmp, "weights.bin"), "wb").write(b"x" * 1000)
if step == "0000004":
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write
open(os.path.join(tmp, "train_state.json"), "w").write('{"step": %d}' % int(step))
_publish(tmp, os.path.join(root, name), root, name)
"""


def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    from easy_context_train.checkpoint import latest_checkpoint, list_checkpoints, remove_stale_temps
    root = tmp_path / "checkpoints"
    root.mkdir()
    for step, rc in (("0000002", 0), ("0000004", -9)):
        p = subprocess.run([sys.executable, "-c", _WRITER, str(root), step], cwd=ROOT, env=_env())
        assert p.returncode == rc
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2]
    latest = latest_checkpoint(str(tmp_path))
    assert json.load(open(os.path.join(latest, "train_state.json"))) == {"step": 2}
    assert os.path.getsize(os.path.join(latest, "weights.bin")) == 1000
    assert (root / ".tmp-step-0000004").exists()
    remove_stale_temps(str(tmp_path))
    assert sorted(os.listdir(root)) == ["step-0000002"]


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
def test_bad_inputs_fail_early_with_one_line(toy, tmp_path):
    nocol = tmp_path / "nocol.jsonl"
    nocol.write_text("".join(json.dumps({"text": "hello world"}) + "\n" for _ in range(4)))
    base = ["--model", toy["model"], "--dataset", toy["data"], "--output-dir", str(tmp_path / "o"),
            "--max-train-steps", "1"]
    cases = {
        "unknown mode": (["--parallel_mode", "ring_of_fire"], "invalid choice"),
        "short rows": (["--seq-length", "256"], "needs >= 257"),
        "missing column": (["--dataset", str(nocol), "--seq-length", "128"], "no 'input_ids' column"),
        "not divisible": (["--seq-length", "127"], "multiple of 2"),
        "missing model": (["--model", "/nonexistent/model", "--seq-length", "128"], "no such directory"),
    }
    for name, (extra, needle) in cases.items():
        p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *base, *extra], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=120)
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("train.py: error:")]
        assert p.returncode != 0, name
        assert len(errors) == 1 and needle in errors[0], (name, p.stderr[-2000:])
        assert "Traceback" not in p.stderr, (name, p.stderr[-2000:])
        assert not (tmp_path / "o" / "metrics.jsonl").exists(), name


# the default run's train.py representative (2 launches: the 1-process reference and zigzag on 2 ranks under
# DeepSpeed ZeRO-3, with chunked loss, selective checkpointing and the attention blocks in 2 head groups, which gather
# their ZeRO-3 parameters themselves); the other end-to-end runs are slow-only
def test_zigzag_equals_single_process_and_lr_is_flag(toy, reference, tmp_path):
    out = tmp_path / "zz"
    _ok(run_train(2, out, "zigzag_ring_attn", ["--save-rope-theta", "1e9", "--chunked-loss", "--checkpointing",
                                               "selective", "--head-chunks", "2"]))
    got, reference = losses(out), reference()
    assert len(got) == STEPS and all(abs(a - b) <= 1e-4 for a, b in zip(got, reference)), (got, reference)
    assert got[-1] < got[0] - 0.3, got  # learnable toy corpus
    m = metrics(out)
    assert m[1]["lr"] == pytest.approx(LR / WARMUP, rel=1e-12)
    assert all(m[s]["lr"] == LR for s in range(WARMUP + 1, STEPS + 1)), m  # DeepSpeed's optimizer LR
    assert {"tokens_per_s", "tokens_per_s_per_gpu", "mfu"} <= set(m[STEPS])
    # final save: HF safetensors + tokenizer + the requested RoPE theta, no training-only attention name
    cfg = json.load(open(out / "config.json"))
    assert cfg["rope_parameters"]["rope_theta"] == 1e9 and "easy_context" not in json.dumps(cfg)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.rope_parameters["rope_theta"] == 1e9
    AutoTokenizer.from_pretrained(str(out))


# each mode also carries memory options (exact, so the curve must still match): hook points exercised
# under DeepSpeed ZeRO-3 without extra launches. usp: --checkpointing auto (offload k=1, every layer selective at
# these budgets; the 2 ranks agree through one all_gather)
AUTO = ["--checkpointing", "auto", "--gpu-budget-gib", "1", "--host-budget-gib", "1"]
MEMORY_FLAGS = {"ulysses_attn": ["--chunked-loss", "--tiled-mlp"], "usp_attn": AUTO,
                "dist_flash_attn": ["--checkpointing", "none"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ulysses_attn", "usp_attn", "dist_flash_attn"])
def test_other_sp_modes_equal_single_process(toy, reference, tmp_path, mode):
    out = tmp_path / mode
    p = run_train(2, out, mode, ["--no-save-model", *MEMORY_FLAGS.get(mode, [])])
    _ok(p)
    got, reference = losses(out), reference()
    assert all(abs(a - b) <= 1e-4 for a, b in zip(got, reference)) and len(got) == STEPS, (got, reference)
    if MEMORY_FLAGS.get(mode) == AUTO:  # one line on the main process; the choice in run.json
        assert p.stdout.count("--checkpointing auto (") == 1, p.stdout[-2000:]
        chosen = json.load(open(out / "run.json"))["auto_checkpointing"]
        assert chosen["offload_every_k"] == 1 and len(chosen["selective_layers"]) > 0, chosen


@pytest.mark.slow
def test_plain_python_single_process_with_wandb_offline(toy, tmp_path):
    """Without a launcher: one process, torch AdamW (no DeepSpeed), wandb offline run in the output dir; with the
    attention blocks in head groups (--head-chunks) over offloaded checkpoints."""
    out = tmp_path / "plain"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", toy["model"], "--dataset",
                        toy["data"], "--output-dir", str(out), "--parallel_mode", "zigzag_ring_attn", *COMMON,
                        "--wandb", "easy-context-test", "--checkpointing", "offload", "--head-chunks", "2"],
                       cwd=ROOT, env=_env(WANDB_MODE="offline"), capture_output=True, text=True, timeout=300)
    _ok(p)
    got = losses(out)
    assert len(got) == STEPS and got[-1] < got[0] - 0.3, got
    assert metrics(out)[STEPS]["lr"] == LR
    assert any(n.startswith("offline-run") for n in os.listdir(out / "wandb"))


@pytest.mark.slow
def test_data_parallel_loss_decreases(toy, tmp_path):
    out = tmp_path / "dp"
    _ok(run_train(2, out, "data_parallel", ["--no-save-model"]))
    got = losses(out)
    assert len(got) == STEPS and got[-1] < got[0] - 0.3, got


@pytest.mark.slow
def test_sigkill_and_resume_give_the_same_losses(toy, reference, tmp_path):
    """Crash while writing checkpoint 4 (step-2 must survive), resume, crash after step 4 (checkpoint 4
    complete), resume again: the stitched per-step losses equal the single-process reference run."""
    out = tmp_path / "resume"
    args = ["--checkpoint-every", "2", "--no-save-model"]
    p = run_train(2, out, "zigzag_ring_attn", args, env=_env(EASY_CONTEXT_CRASH="checkpoint:4"))
    assert p.returncode != 0
    ck = out / "checkpoints"
    assert (ck / "step-0000002").is_dir() and not (ck / "step-0000004").exists()
    p = run_train(2, out, "zigzag_ring_attn", args + ["--resume"], env=_env(EASY_CONTEXT_CRASH="step:4"))
    assert p.returncode != 0 and "resumed from" in p.stdout + p.stderr
    assert (ck / "step-0000004").is_dir() and not (ck / ".tmp-step-0000004").exists()
    p = run_train(2, out, "zigzag_ring_attn", args + ["--resume"])
    _ok(p)
    assert "step-0000004" in p.stdout + p.stderr
    got, reference = losses(out), reference()
    assert len(got) == STEPS and all(abs(a - b) <= 1e-4 for a, b in zip(got, reference)), (got, reference)


def _dry_run(script):
    import shlex

    from easy_context_train.args import build_parser
    p = subprocess.run(["bash", os.path.join(ROOT, "train_scripts", script)], cwd=ROOT, capture_output=True,
                       text=True, env=_env(DRY_RUN="1"), timeout=60)
    assert p.returncode == 0, p.stderr
    cmds = [shlex.split(ln) for ln in p.stdout.splitlines() if ln.startswith("accelerate launch")]
    return [build_parser().parse_args(c[c.index("train.py") + 1:]) for c in cmds]


def test_llama_1m_recipe_is_the_stage_table():
    stages = _dry_run("EasyContext-1M-Llama-2-7B.sh")
    table = [(32768, 1e6, 1000, 2e-5, 4, "data_parallel"), (65536, 5e6, 1000, 2e-5, 2, "data_parallel"),
             (256000, 1e7, 500, 2e-5, 4, "zigzag_ring_attn"), (256000, 2.5e7, 500, 2e-5, 4, "zigzag_ring_attn"),
             (256000, 5e7, 150, 2e-5, 4, "zigzag_ring_attn"), (512000, 1e8, 300, 2e-5, 2, "zigzag_ring_attn"),
             (512000, 2.5e8, 90, 1e-5, 2, "zigzag_ring_attn")]
    got = [(a.seq_length, a.rope_theta, a.max_train_steps, a.learning_rate, a.gradient_accumulate_every,
            a.parallel_mode) for a in stages]
    assert got == table
    assert stages[0].model == "meta-llama/Llama-2-7b-hf"
    assert all(b.model == a.output_dir for a, b in zip(stages, stages[1:]))  # each stage from the last
    assert stages[-1].save_rope_theta == 1e9 and all(a.save_rope_theta is None for a in stages[:-1])
    for a in stages:  # ~1M tokens per optimizer step on 8 GPUs
        dp = 8 if a.parallel_mode == "data_parallel" else 1
        assert 1.0e6 <= a.batch_size * a.gradient_accumulate_every * a.seq_length * dp <= 1.1e6
        assert a.seq_length % 16 == 0 and a.resume


def test_danube_recipe_tokens_per_step():
    stages = _dry_run("EasyContext-256K-danube2.sh")
    assert [a.seq_length for a in stages] == [16000, 32000, 32000, 64000, 64000, 64000, 128000, 128000, 256000]
    assert [a.rope_theta for a in stages] == [3e4, 1e5, 3e5, 1e6, 2.5e6, 5e6, 1e7, 3e7, 1e8]
    for a in stages:
        dp = 8 if a.parallel_mode == "data_parallel" else 1
        assert 1.0e6 <= a.batch_size * a.gradient_accumulate_every * a.seq_length * dp <= 1.1e6
