"""A finished run is final, a resumed run is the same run (#60): the 11 cases of the second probe, one test each
(``case_N`` = the issue's row N). One process wherever the behaviour is the same; the launches under the default
ZeRO-3 config are in ``python -m easy_context faults --full``.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["--parallel_mode", "data_parallel", "--seq-length", "128", "--gradient-accumulate-every", "1",
         "--learning-rate", "3e-3", "--warmup-steps", "2", "--rope-theta", "20000", "--checkpoint-every", "2"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    env.pop("EASY_CONTEXT_CRASH", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from easy_context_train.toy import build_all
    return build_all(str(tmp_path_factory.mktemp("toy")), seq_lengths=(128,), n_docs=120)


def _train(toy, out, *extra, crash=None, data=None):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", toy["model"], "--dataset",
           data or toy["data_128"], "--output-dir", str(out), *TRAIN, *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(**({"EASY_CONTEXT_CRASH": crash} if crash else {})),
                       capture_output=True, text=True, timeout=600)
    log = (p.stdout + p.stderr).replace("\r", "\n")
    return p.returncode, [ln[ln.index("train.py: "):] for ln in log.splitlines() if "train.py: " in ln], log


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _finished_dir(tmp_path, steps=(2, 4), final=4, run_id="r1"):
    """What a finished run leaves: model, run.json (finished at ``final``), metrics, this run's checkpoints."""
    out = tmp_path / "out"
    out.mkdir()
    for name, text in (("config.json", "{}"), ("model.safetensors", "weights"), ("tokenizer.json", "{}")):
        (out / name).write_text(text)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, final + 1)))
    (out / "run.json").write_text(json.dumps({"run_id": run_id, "finished": {"step": final, "model": True}}))
    for s in steps:
        ck = out / "checkpoints" / f"step-{s:07d}"
        ck.mkdir(parents=True)
        (ck / "train_state.json").write_text(json.dumps({"step": s, "run_id": run_id}))
    return out


def _args(out, target):
    return SimpleNamespace(output_dir=str(out), max_train_steps=target, log_file=str(out / "metrics.jsonl"),
                           resume=True)


# ------------------------------------------------------------------------------- 1. --resume into a finished run
def test_case1_resume_into_a_finished_run_never_replaces_it(tmp_path):
    from easy_context_train.checkpoint import list_checkpoints
    from easy_context_train.errors import UsageError
    from easy_context_train.run_state import FINISHED, keep_finished_model, plan_resume, read_state
    out = _finished_dir(tmp_path)
    found = list_checkpoints(str(out))
    assert read_state(str(out), found).kind == FINISHED
    with pytest.raises(UsageError, match=r"run r1 in .* finished at step 4 \(config.json, model.safetensors\); "
                                         r"--max-train-steps 3 is before that.*replace the finished model"):
        plan_resume(_args(out, 3), found)
    assert plan_resume(_args(out, 4), found) == "done"
    assert plan_resume(_args(out, 6), found) == "extend"  # from the final step's checkpoint
    with pytest.raises(UsageError, match="its last checkpoint is step 2, so its final state .* cannot be continued"):
        plan_resume(_args(out, 6), found[:1])  # never from an older checkpoint
    sha = _sha(out / "model.safetensors")
    (out / "final-step-0000004").mkdir()  # a user's directory of that name: kept, another name is chosen
    kept = keep_finished_model(str(out), 4, 6)
    assert kept.endswith("final-step-0000004-2") and _sha(os.path.join(kept, "model.safetensors")) == sha
    assert sorted(os.listdir(kept)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not (out / "model.safetensors").exists() and os.listdir(out / "final-step-0000004") == []
    rec = json.loads((out / "run.json").read_text())
    assert "finished" not in rec and rec["history"][0]["from_step"] == 4 and rec["history"][0]["to_step"] == 6
    assert read_state(str(out), found).kind == "in progress"


def test_case1_6_7_one_process_end_to_end(toy, tmp_path):
    """The user's .final.tmp/ (6: kept), SIGTERM just after the final save (7: exit 0, one line; --resume a no-op),
    --resume with fewer steps (1: refused, the model and its metrics unchanged)."""
    out = tmp_path / "run"
    (out / ".final.tmp").mkdir(parents=True)
    (out / ".final.tmp" / "notes.txt").write_text("mine")
    rc, lines, log = _train(toy, out, "--max-train-steps", "2", crash="sigterm:final")
    assert rc == 0 and lines == [f"train.py: SIGTERM received after the final save: the model in {out} is complete "
                                 "(step 2); exiting 0 (--resume on it does nothing)"], (rc, lines, log[-3000:])
    assert (out / ".final.tmp" / "notes.txt").read_text() == "mine"
    assert not [n for n in os.listdir(out) if n.startswith(".final-tmp-")]
    sha = _sha(out / "model.safetensors")
    rc, lines, _ = _train(toy, out, "--max-train-steps", "2", "--resume")
    assert rc == 0 and len(lines) == 1 and "finished at step 2 and its model is complete" in lines[0], lines
    rc, lines, _ = _train(toy, out, "--max-train-steps", "1", "--resume")
    assert rc == 2 and len(lines) == 1 and "--max-train-steps 1 is before that" in lines[0], lines
    assert _sha(out / "model.safetensors") == sha and len((out / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow  # one more run; every rank's agreement on a failed write is checked on 2 ranks below
def test_case5_read_only_mid_run_is_one_line_and_74(toy, tmp_path):
    out = tmp_path / "run"
    rc, lines, log = _train(toy, out, "--max-train-steps", "4", crash="readonly:3")
    assert rc == 74 and len(lines) == 1, (rc, lines, log[-3000:])
    assert lines[0].startswith(f"train.py: error: rank 0: cannot write the metrics log {out}/metrics.jsonl: "
                               "Read-only file system") and "then rerun with --resume" in lines[0], lines


@pytest.mark.slow  # two more runs; the plan is checked in process above
def test_case1_continue_a_finished_run_from_its_final_step(toy, tmp_path):
    """--resume to more steps: continues from the final step's checkpoint (the losses of an unbroken run), the finished
    model kept in final-step-N/."""
    out, ref = tmp_path / "run", tmp_path / "ref"
    assert _train(toy, out, "--max-train-steps", "4")[0] == 0
    sha = _sha(out / "model.safetensors")
    rc, _, log = _train(toy, out, "--max-train-steps", "6", "--resume")
    assert rc == 0 and "resumed from" in log and "step-0000004" in log, log[-3000:]
    assert _sha(out / "final-step-0000004" / "model.safetensors") == sha
    assert _train(toy, ref, "--max-train-steps", "6")[0] == 0
    loss = lambda d: [json.loads(ln)["loss"] for ln in open(d / "metrics.jsonl")]  # noqa: E731
    assert loss(out) == loss(ref)


# ------------------------------------------------------------------------------- 2. the data is what it was
def _open(tmp_path, data, *extra):
    from transformers import LlamaConfig

    from easy_context_train.args import parse_args
    from easy_context_train.session import open_run
    from tests.test_nothing_lost import _Acc
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=384)
    args = parse_args(["--model", "m", "--dataset", "d", "--output-dir", str(tmp_path / "out"), *extra])
    acc = _Acc(1)
    lock, run_id = open_run(args, acc, cfg, data)
    lock.release()
    return acc


def test_case2_a_replaced_dataset_is_refused_on_resume(tmp_path):
    import datasets

    from easy_context_train.data import data_identity, load_any_dataset
    from easy_context_train.errors import UsageError
    from easy_context_train.run_dir import read_run
    rows = [[i % 300 + j for j in range(9)] for i in range(40)]
    path = str(tmp_path / "data")
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(path)
    first = data_identity(load_any_dataset(path))
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "copy"))
    assert data_identity(load_any_dataset(str(tmp_path / "copy"))) == first  # the same rows: the same identity
    _open(tmp_path, first)
    ck = tmp_path / "out" / "checkpoints" / "step-0000002"
    ck.mkdir(parents=True)
    (ck / "train_state.json").write_text(json.dumps({"step": 2, "run_id": read_run(str(tmp_path / "out"))["run_id"]}))
    changed = data_identity(datasets.Dataset.from_dict({"input_ids": rows[:30]}))  # prepare_data --overwrite
    with pytest.raises(UsageError, match=r"the data at --dataset 'd' is not the data run \w+ .* was trained on "
                                         r"\(recorded 40 rows, 360 tokens.*now 30 rows, 270 tokens.*--accept-changed "
                                         r"dataset"):
        _open(tmp_path, changed, "--resume")
    acc = _open(tmp_path, changed, "--resume", "--accept-changed", "dataset")
    assert acc.printed[0].startswith("--resume --accept-changed: --dataset's rows 40 rows") and "-> 30 rows" in \
        acc.printed[0]
    rec = read_run(str(tmp_path / "out"))
    assert rec["identity"]["data"] == changed and rec["history"][-1]["changed"]["data"] == [first, changed]
    _open(tmp_path, changed, "--resume")  # now the recorded data


# ------------------------------------------------------------------------------- 3. nothing to learn
def test_case3_all_masked_labels_are_refused_mostly_masked_warn(tmp_path, capsys):
    import datasets

    from easy_context_train.data import load_any_dataset, validate_packed
    from easy_context_train.errors import UsageError
    ids = [list(range(9)), list(range(10, 19))]
    path = str(tmp_path / "masked")
    datasets.Dataset.from_dict({"input_ids": ids, "labels": [[-100] * 9] * 2}).save_to_disk(path)
    with pytest.raises(UsageError, match=r"every target of the 'labels' column is -100 .* nothing to learn .* chat "
                                         "template that never marks an assistant turn"):
        validate_packed(load_any_dataset(path), path, 8, 384, "m")
    some = str(tmp_path / "some")  # 2 trainable targets of 16 (index 0 is never a target)
    datasets.Dataset.from_dict({"input_ids": ids, "labels": [[5] * 3 + [-100] * 6, [-100] * 9]}).save_to_disk(some)
    capsys.readouterr()
    validate_packed(load_any_dataset(some), some, 8, 384, "m")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "only 12.5% of the targets are trainable (2 of 16" in out[0], out


# ------------------------------------------------------------------------------- 4 and 8. the user's config, strictly
@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size"])
def test_case4_8_a_config_missing_width_heads_or_vocab_is_one_line(field, toy, tmp_path, capsys):
    from easy_context.__main__ import main
    from easy_context_train.errors import UsageError
    from easy_context_train.modeling import load_config
    cfg = json.load(open(os.path.join(toy["model"], "config.json")))
    cfg.pop(field)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["check", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config.json has no {field!r}" in err[0] and "transformers would use its default" in \
        err[0], err
    with pytest.raises(UsageError, match=f"--model '{tmp_path}': config.json has no '{field}'"):
        load_config(str(tmp_path), None)  # train.py's reading, before any weights


# ------------------------------------------------------------------------------- 5. a failed write on any rank
def _metrics_write_fails(rank, world, out):
    import torch

    from easy_context_train.faults import Guard
    from easy_context_train.metrics import JsonlLog
    from easy_context_train.preempt import Preemption
    from easy_context_train.writes import WriteError
    os.environ["EASY_CONTEXT_CRASH"] = "readonly:2:0"
    log = JsonlLog(os.path.join(out, "metrics.jsonl"), rank == 0)
    guard = object.__new__(Guard)  # what stop_requested uses of it
    guard.args, guard.watchdog, guard.preemption = SimpleNamespace(max_train_steps=10), None, Preemption()
    guard.accelerator = SimpleNamespace(device=torch.device("cpu"))
    log.write({"step": 1, "loss": 1.0})
    assert guard.stop_requested(1, log.failed) is False
    log.write({"step": 2, "loss": 1.0})  # the file system turned read-only: rank 0's append fails
    with pytest.raises(WriteError) as e:  # every rank learns it in the step's one all-reduce: none waits for rank 0
        guard.stop_requested(2, log.failed)
    assert e.value.code == 74 and e.value.local == (rank == 0)
    if rank == 0:
        assert str(e.value).startswith(f"cannot write the metrics log {out}/metrics.jsonl: Read-only file system")
    guard.preemption.restore()


def test_case5_a_failed_metrics_write_stops_every_rank_with_74(tmp_path):
    from tests.harness import run_ranks
    run_ranks(_metrics_write_fails, world_size=2, args=(str(tmp_path),), timeout=120, collective_timeout=30)


# ------------------------------------------------------------------------------- 6. private temp dirs
def test_case6_the_final_save_never_touches_a_users_temp_dir(tmp_path):
    from easy_context_train import checkpoint as ckpt
    from easy_context_train.writes import MARK
    out = tmp_path / "out"
    (out / ".final.tmp").mkdir(parents=True)
    (out / ".final.tmp" / "notes.txt").write_text("mine")
    (out / ".final-tmp-mine").mkdir()  # the new prefix, but not made by this package (no mark): kept too
    stale = out / ".final-tmp-abc123"  # a killed final save's: removed at the next start
    stale.mkdir()
    (stale / MARK).write_text("1")
    ckpt.remove_stale_temps(str(out))
    assert not stale.exists() and (out / ".final-tmp-mine").is_dir()
    acc = SimpleNamespace(is_main_process=True)

    def write(tmp):
        assert os.path.basename(tmp).startswith(".final-tmp-") and os.path.dirname(tmp) == str(out)
        (open(os.path.join(tmp, "config.json"), "w")).write("{}")
    ckpt.write_final(acc, str(out), write, last="config.json")
    assert (out / ".final.tmp" / "notes.txt").read_text() == "mine" and (out / "config.json").exists()
    assert sorted(os.listdir(out)) == [".final-tmp-mine", ".final.tmp", "config.json"]


# ------------------------------------------------------------------------------- 9 and 10. plan's inputs
@pytest.mark.parametrize("flags,needle", [
    (["--nodes", "1000000000"], "--nodes must be >= 1 and <= 1048576, got 1000000000"),
    (["--gpus", "4096", "--nodes", "4096"], "--gpus x --nodes must be at most 1048576 GPUs, got 4096 x 4096 = "
                                            "16777216"),
    (["--gpu-mem", "1e300"], "--gpu-mem must be a positive number of GiB up to 1048576, got 1e+300"),
    (["--host-mem", "1e300"], "--host-mem must be a positive number of GiB up to 1073741824, got 1e+300"),
])
def test_case9_10_plan_absurd_inputs_are_one_line(flags, needle, capsys):
    from easy_context.__main__ import main
    t0 = time.monotonic()
    assert main(["plan", "--model", "llama-2-7b", "--seq-length", "65536", "--gpus", "8", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"python -m easy_context plan: error: {needle}"]
    assert time.monotonic() - t0 < 10


def test_case9_plan_searches_divisors_not_every_integer(capsys):
    from easy_context.__main__ import main
    from easy_context.tools.plan.search import divisors
    assert divisors(1) == [1] and divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1 << 20)[-2:] == [1 << 19, 1 << 20]
    t0 = time.monotonic()
    assert main(["plan", "--model", "llama-2-7b", "--seq-length", "65536", "--gpus", "8", "--nodes", "65536"]) == 0
    assert "recommended" in capsys.readouterr().out and time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------- 11. prepare_data, disk full
def test_case11_prepare_data_disk_full_is_one_line_74_nothing_partial(toy, tmp_path, monkeypatch, capsys):
    import datasets

    import prepare_data
    real = datasets.Dataset.save_to_disk

    def fills_up(self, path, *a, **k):  # part of the dataset is written, then the disk is full
        real(self, path, *a, **k)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, "data-00000-of-00001.arrow"))
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", fills_up)
    for extra in ([], ["--document-masking"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            prepare_data.main(["--dataset", toy["corpus"], "--tokenizer", toy["model"], "--seq-length", "64",
                               "--output", str(tmp_path / "ds"), "--num-proc", "1", *extra])
        log = capsys.readouterr().err.replace("\r", "\n")
        err = [ln for ln in log.splitlines() if "error" in ln.lower()]
        assert e.value.code == 74 and len(err) == 1 and "Traceback" not in log, (e.value.code, log[-2000:])
        assert err[0].startswith(f"prepare_data.py: error: cannot write the dataset {tmp_path}/ds: No space left on "
                                 "device") and "free space (or raise the quota), then rerun" in err[0], err
        assert os.listdir(tmp_path) == []  # nothing partial: no OUTPUT, no scratch directory


# ------------------------------------------------------------------------------- 3 (train.py): the first window
@pytest.mark.slow  # one more run; the dataset-level refusal is checked in process above
def test_case3_a_first_window_without_trainable_labels_refuses_to_start(toy, tmp_path):
    import datasets
    from torch.utils.data import DistributedSampler
    rows = datasets.load_from_disk(toy["data_128"]).select(range(4))
    ids = list(rows["input_ids"])
    labels = [list(r) for r in ids[:1]] + [[-100] * len(r) for r in ids[1:]]  # one row of four can be learned
    data = str(tmp_path / "data")
    datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}).save_to_disk(data)
    seed = next(s for s in range(50) if next(iter(DistributedSampler(range(4), 1, 0, shuffle=True, seed=s))) != 0)
    rc, lines, log = _train(toy, tmp_path / "o", "--max-train-steps", "2", "--batch-size", "1", "--seed", str(seed),
                            data=data)  # the loader's order (easy_context/data.py): the first row has no label
    assert rc == 2 and len(lines) == 2, (rc, lines, log[-2000:])
    assert "only 25.0% of the targets are trainable" in lines[0] and "the first step's 1 rows have no trainable " \
        "label" in lines[1], lines
