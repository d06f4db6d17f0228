"""Faults a long run meets (#32): preemption, a dead or hung rank, a full disk, out of memory.

train.py on 2 CPU gloo ranks under ``accelerate launch`` (plain Accelerate/DDP: none of these faults depends on
DeepSpeed, and it starts faster). Launches: an unbroken run, then one chain (SIGTERM reaching rank 1 only ->
checkpoint + exit 75; --resume with rank 1 out of memory -> its one line, rank 0 follows; --resume to the end),
whose stitched loss curve and final weights must equal the unbroken run's bit for bit; and one run whose rank 1 is
SIGSTOPped. After each launch no worker of it may be left (psutil). The disk-full case is a patched writer on 2
spawned gloo ranks (the agreement between ranks) plus the in-process writer (message, nothing half-written).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import run_ranks
from tests.test_train import ROOT, _env, free_port, losses

psutil = pytest.importorskip("psutil")
TRAIN = ["--parallel_mode", "zigzag_ring_attn", "--seq-length", "128", "--max-train-steps", "5",
         "--gradient-accumulate-every", "2", "--learning-rate", "3e-3", "--warmup-steps", "2", "--rope-theta", "20000"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from easy_context_train.toy import build_all
    base = tmp_path_factory.mktemp("toy")
    return build_all(str(base), seq_lengths=(128,), n_docs=120)


def _start(toy, out, *extra, env=None):
    """accelerate launch (plain Accelerate, 2 CPU processes over gloo) train.py; returns the Popen."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), os.path.join(ROOT, "train.py"), "--model", toy["model"],
           "--dataset", toy["data_128"], "--output-dir", str(out), *TRAIN, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(ACCELERATE_USE_CPU="true", **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(toy, out, *extra, env=None):
    p = _start(toy, out, *extra, env=env)
    log = p.communicate(timeout=300)[0]
    _no_orphans(out)
    return p.returncode, log


def _no_orphans(out):
    """No process of this run (its --output-dir is in every worker's command line) is left."""
    time.sleep(0.5)
    left = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if str(out) in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.Error:
            pass
    for proc in left:  # do not leak them into the next test either
        proc.kill()
    assert not left, f"workers left behind: {[p.pid for p in left]}"


def _errors(log: str) -> list[str]:
    return [ln[ln.index("train.py: "):] for ln in log.splitlines() if "train.py: error" in ln
            or "train.py: preempted" in ln]


def _weights(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "model.safetensors"))


@pytest.mark.slow  # 4 launches; the stopped-rank launch below is the default run's end-to-end representative
def test_sigterm_and_oom_then_resume_equal_an_unbroken_run(toy, tmp_path):
    ref = tmp_path / "ref"
    rc, log = _run(toy, ref)
    assert rc == 0, log[-4000:]
    out = tmp_path / "run"
    flags = ["--checkpoint-every", "2", "--collective-timeout", "60s"]
    # 1. SIGTERM reaches rank 1 only, after step 3: every rank finishes step 3, checkpoint 3, exit 75
    rc, log = _run(toy, out, *flags, env={"EASY_CONTEXT_CRASH": "sigterm:3:1"})
    assert rc != 0 and log.count("exitcode  : 75") == 2, log[-4000:]
    lines = _errors(log)
    assert len(lines) == 1 and "preempted (SIGTERM received) after step 3" in lines[0], lines
    assert sorted(os.listdir(out / "checkpoints")) == ["step-0000002", "step-0000003"]
    # 2. --resume; rank 1 runs out of memory in step 4: one line (length, options, plan's suggestion), exit 3;
    #    rank 0 loses its peer and leaves quietly (exit 4)
    rc, log = _run(toy, out, *flags, "--resume", env={"EASY_CONTEXT_CRASH": "oom:4:1"})
    lines = _errors(log)
    assert rc != 0 and "exitcode  : 3" in log and "exitcode  : 4" in log, log[-4000:]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: rank 1: out of GPU memory at step 4 "), lines
    for part in ("--seq-length 128", "--parallel_mode zigzag_ring_attn", "sp 2 x dp 1", "--checkpointing layer",
                 "no --chunked-loss", "plan suggests --seq-length 128", "python -m easy_context plan --model"):
        assert part in lines[0], (part, lines[0])
    assert "train.py\", line" not in log and "OutOfMemoryError" not in log, log[-4000:]  # no worker traceback
    # 3. --resume to the end: the stitched curve and the final weights are the unbroken run's, bit for bit
    rc, log = _run(toy, out, *flags, "--resume")
    assert rc == 0 and "resumed from" in log and "step-0000003" in log, log[-4000:]
    assert losses(out) == losses(ref), (losses(out), losses(ref))
    a, b = _weights(ref), _weights(out)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_stopped_rank_stops_the_run_within_the_timeout_naming_it(toy, tmp_path):
    out = tmp_path / "stop"
    # 4 s: the watchdog checks every 0.5 s (timeout / 10, at least 0.5) and calls a rank silent after 3 of them, so
    # rank 1 is silent well before it fires; a normal 150-step run of these flags does not fire even at 1 s (measured
    # 2026-12-06); torch's own backstop would speak at 4 + 10 s with another message, which fails the checks below
    timeout = 4
    p = _start(toy, out, "--max-train-steps", "1000", "--no-save-model", "--collective-timeout", f"{timeout}s")
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            assert p.poll() is None, p.communicate()[0][-4000:]
            time.sleep(0.2)
        workers = {int(c.environ()["RANK"]): c for c in psutil.Process(p.pid).children(recursive=True)
                   if "train.py" in " ".join(c.cmdline()) and "RANK" in c.environ()}
        assert sorted(workers) == [0, 1]
        workers[1].send_signal(signal.SIGSTOP)  # mid-run: rank 0 waits in a ring step / all-reduce for it
        stopped = time.monotonic()
        log = p.communicate(timeout=timeout + 60)[0]
        elapsed = time.monotonic() - stopped
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0 and "exitcode  : 4" in log, log[-4000:]
    assert elapsed < timeout + 15, elapsed  # the watchdog's timeout, then the launcher's teardown
    lines = _errors(log)
    assert len(lines) == 1, lines
    assert f"no progress for {timeout}s (--collective-timeout)" in lines[0] and "rank 1 (pid" in lines[0], lines
    assert "is stopped (SIGSTOP; killed now)" in lines[0], lines
    assert any(ph in lines[0] for ph in ("ring step", "loss all-reduce", "preemption-flag all-reduce")), lines
    _no_orphans(out)


# ------------------------------------------------------------------------------- disk full during a save
class _Acc:
    """The parts of an Accelerator save_checkpoint uses; ``full`` makes this rank's writer fail like a full disk."""
    def __init__(self, rank=0, world=1, full=False):
        import torch
        self.is_main_process, self.num_processes, self.device, self.full = rank == 0, world, torch.device("cpu"), full

    def save_state(self, path):
        import torch.distributed as dist
        name = f"shard-{dist.get_rank() if dist.is_initialized() else 0}.bin"
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"w" * 5000 if not self.full else b"w" * 100)
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, name))

    def wait_for_everyone(self):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()


def _save_twice(rank, world, out):
    from easy_context_train import checkpoint as ckpt
    from easy_context_train import run_dir
    ckpt.save_checkpoint(_Acc(rank, world), out, 1, run_id="r")
    with pytest.raises(ckpt.CheckpointWriteError) as e:  # rank 1's disk fills: every rank raises, none hangs
        ckpt.save_checkpoint(_Acc(rank, world, full=rank == 1), out, 2, run_id="r")
    assert e.value.local == (rank == 1)
    if rank == 1:
        assert "No space left on device" in str(e.value) and "step-0000001 is intact" in str(e.value)
    import torch.distributed as dist
    dist.barrier()
    found = ckpt.list_checkpoints(out)
    assert [s for s, _ in found] == [1] and not os.path.exists(os.path.join(out, "checkpoints", ".tmp-step-0000002"))
    assert run_dir.latest_good_checkpoint(found, "r", print) == found[0][1]  # loadable: the manifest verifies


def test_full_disk_on_one_rank_keeps_the_previous_checkpoint(tmp_path):
    run_ranks(_save_twice, world_size=2, args=(str(tmp_path),), timeout=120, collective_timeout=30)


def test_full_disk_message_names_path_space_and_fix(tmp_path):
    from easy_context_train import checkpoint as ckpt
    ckpt.save_checkpoint(_Acc(), str(tmp_path), 1, run_id="r")
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        ckpt.save_checkpoint(_Acc(full=True), str(tmp_path), 2, run_id="r")
    msg = str(e.value)
    assert f"cannot write checkpoint {tmp_path}/checkpoints/step-0000002: No space left on device" in msg, msg
    assert "free of" in msg and "the last checkpoint took" in msg and "Free space" in msg and "--resume" in msg
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-0000001"]
    assert json.load(open(tmp_path / "checkpoints" / "step-0000001" / "train_state.json"))["step"] == 1


# ------------------------------------------------------------------------------- fast unit tests
def test_collective_timeout_flag_and_backstop():
    from easy_context_train.args import duration
    from easy_context_train.watchdog import backstop_timeout, heartbeat_interval
    assert [duration(x) for x in ("90", "90s", "10m", "1.5h")] == [90, 90, 600, 5400]
    assert backstop_timeout(600) == 660 and backstop_timeout(8) == 18  # torch's timeout comes after ours
    assert heartbeat_interval(8) == 0.8 and heartbeat_interval(3600) == 10


def test_oom_message_without_a_gpu(tmp_path):
    from types import SimpleNamespace

    from easy_context_train.faults import oom_message
    args = SimpleNamespace(model="llama-2-7b", seq_length=262144, parallel_mode="zigzag_ring_attn", sp_size=None,
                           batch_size=1, checkpointing="layer", chunked_loss=False, tiled_mlp=True, ring_degree=None,
                           gradient_accumulate_every=4)
    os.environ.update(WORLD_SIZE="8", LOCAL_WORLD_SIZE="8")
    try:
        msg = oom_message(args, 6)
    finally:
        del os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"]
    assert msg.startswith("out of GPU memory at step 7 (--seq-length 262144, --parallel_mode zigzag_ring_attn, "
                          "sp 8 x dp 1"), msg
    assert "plan suggests --seq-length 262144" in msg and "--gpus 8" in msg, msg


def test_watchdog_names_the_silent_rank(monkeypatch):
    """The report logic on a real TCPStore (in process): a dead peer, a peer that explained itself, a desync."""
    import datetime
    import socket

    import torch.distributed as dist

    from easy_context_train.watchdog import Watchdog
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5))  # noqa: F841
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dog = Watchdog(0, 2, 10.0)
    dog.close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    beat = {"t": time.time() - 30, "phase": "all-to-all", "step": 6, "pid": int(dead.stdout),
            "host": socket.gethostname()}
    dog.store.set(dog.keys("hb", 1), json.dumps(beat))
    line, _ = dog.describe("no progress")
    assert line.startswith("no progress (rank 0 in "), line
    assert f"rank 1 (pid {beat['pid']} on {beat['host']}) is gone" in line, line
    assert "last heard 30s ago in all-to-all of step 7" in line, line
    dog.store.set(dog.keys("hb", 1), json.dumps({**beat, "t": time.time(), "pid": os.getpid()}))  # alive, elsewhere
    line, _ = dog.describe("no progress")
    assert "every rank is alive but they wait in different collectives" in line and "rank 1 in all-to-all" in line
    dog.store.set(dog.keys("exit", 1), "out of memory")  # it printed its own line: this rank stays quiet
    assert dog.describe("no progress") == (None, True)


# ------------------------------------------------------------------------------- #47 under the default ZeRO-3 config
Z3 = ["--parallel_mode", "data_parallel", "--seq-length", "128", "--max-train-steps", "14",
      "--gradient-accumulate-every", "1", "--learning-rate", "3e-3", "--warmup-steps", "2", "--rope-theta", "20000",
      "--checkpoint-every", "5", "--keep-checkpoints", "3", "--collective-timeout", "60s"]


def _start_z3(toy, out, *extra, env=None, model=None):
    """`python -m easy_context launch` (accelerate launch, the rendezvous on loopback) with accelerate_configs/cpu.yaml:
    DeepSpeed ZeRO-3 on 2 CPU gloo ranks."""
    port = free_port()
    cmd = [sys.executable, "-m", "easy_context", "launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", "cpu.yaml"), "--main_process_port", str(port),
           os.path.join(ROOT, "train.py"), "--model", model or toy["model"], "--dataset", toy["data_128"],
           "--output-dir", str(out), *Z3, *extra]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    return p, port


def _run_z3(toy, out, *extra, env=None, model=None):
    p, _ = _start_z3(toy, out, *extra, env=env, model=model)
    log = p.communicate(timeout=400)[0]
    _no_orphans(out)
    return p.returncode, log


def _worker_tracebacks(log: str) -> list[str]:
    """Traceback lines of the workers ([rankN]: ...), not the launcher's own ChildFailedError summary."""
    return [ln for ln in log.replace("\r", "\n").splitlines() if ln.startswith("[rank") or "pair.cc" in ln]


@pytest.fixture(scope="module")
def zero3_chain(toy, tmp_path_factory):
    """One output dir through four launches under ZeRO-3 (each a case of #47); the tests below read the logs."""
    from easy_context_train.toy import build_model
    base = tmp_path_factory.mktemp("z3")
    out, other = base / "run", base / "other-model"
    build_model(str(other), vocab_size=384, hidden=32)  # another architecture, the same vocabulary
    chain = {"out": out}
    # 1. the whole run; the disk fills during the final model save (#5)
    chain["full"] = _run_z3(toy, out, env={"EASY_CONTEXT_CRASH": "disk_full:final"})
    chain["unbroken"] = losses(out)
    chain["left"] = sorted(os.listdir(out))
    # the run checkpoints its final step too (#60: a finished run can be continued from it); the cases below resume
    # from an earlier checkpoint, as a run stopped before its end would: drop the final step's
    final_ckpt = out / "checkpoints" / "step-0000014"
    chain["final_ckpt"] = final_ckpt.is_dir()
    shutil.rmtree(final_ckpt, ignore_errors=True)
    # 2. --resume with a model of another architecture: refused before it loads (#4)
    chain["other"] = _run_z3(toy, out, "--resume", model=str(other))
    # 3. --resume; rank 1 dies inside step 12 (its last layer's forward): rank 0 is inside DeepSpeed's collectives (#3);
    #    meanwhile the launcher's rendezvous store listens on 127.0.0.1 only (#11)
    p, port = _start_z3(toy, out, "--resume", env={"EASY_CONTEXT_CRASH": "layer:12:1"})
    listening = set()
    deadline = time.monotonic() + 120
    while not listening and p.poll() is None and time.monotonic() < deadline:
        try:
            listening = {c.laddr.ip for c in psutil.Process(p.pid).net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        except psutil.Error:
            pass
        time.sleep(0.2)
    chain["killed"] = (p.communicate(timeout=400)[0], p.returncode)
    _no_orphans(out)
    chain["listening"] = listening
    return chain


@pytest.mark.slow  # four ZeRO-3 launches (~115 s); in-process: test_nothing_lost.py
def test_zero3_final_save_full_disk_other_model_and_dead_rank_are_one_line_each(zero3_chain):
    """#5, #4, #3, #11 on accelerate_configs/cpu.yaml (DeepSpeed ZeRO-3, 2 gloo ranks)."""
    rc, log = zero3_chain["full"]
    lines = _errors(log)
    assert rc != 0 and log.count("exitcode  : 74") == 2 and not _worker_tracebacks(log), log[-4000:]
    assert len(lines) == 1 and lines[0].startswith(
        f"train.py: error: rank 0: cannot write the final model to {zero3_chain['out']} after step 14: No space left "
        "on device ("), lines
    assert f"the last checkpoint {zero3_chain['out']}/checkpoints/step-0000014 is intact" in lines[0], lines
    assert "no step is trained again" in lines[0] and zero3_chain["final_ckpt"], lines
    assert zero3_chain["left"] == ["checkpoints", "metrics.jsonl", "run.json"], zero3_chain["left"]  # no .final.tmp
    assert len(zero3_chain["unbroken"]) == 14

    rc, log = zero3_chain["other"]
    lines = _errors(log)
    assert rc != 0 and "exitcode  : 2" in log and not _worker_tracebacks(log), log[-4000:]
    assert len(lines) == 1 and "hold a different model (llama, 2 layers, hidden 64" in lines[0] \
        and "than --model" in lines[0] and "hidden 32" in lines[0], lines

    log, rc = zero3_chain["killed"]
    lines = _errors(log)
    assert rc != 0 and "exitcode  : 4" in log and "exitcode  : -9" in log, log[-4000:]
    assert not _worker_tracebacks(log), _worker_tracebacks(log)[:20]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: a peer was lost during DeepSpeed's "), lines
    assert "rank 1 (pid" in lines[0] and "is gone (its process exited)" in lines[0] and "--resume" in lines[0], lines
    assert zero3_chain["listening"] == {"127.0.0.1"}, zero3_chain["listening"]


@pytest.mark.slow  # four ZeRO-3 launches (~115 s); in-process: test_nothing_lost.py
def test_zero3_resume_is_bit_for_bit(toy, zero3_chain):
    """#7: --resume from step 10 (CPU Adam's state rebuilt) to the end: the stitched losses are the unbroken run's,
    bit for bit (before: 3.9081380 vs 3.9081378 at step 15 of a zigzag run resumed at 10)."""
    out = zero3_chain["out"]
    rc, log = _run_z3(toy, out, "--resume")
    assert rc == 0 and "resumed from" in log and "step-0000010" in log, log[-4000:]
    got, ref = losses(out), zero3_chain["unbroken"]
    assert got == ref, [(i + 1, a, b) for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    assert (out / "model.safetensors").exists() and not (out / ".final.tmp").exists()
