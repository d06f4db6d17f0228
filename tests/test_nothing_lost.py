"""Nothing lost, nothing silent (#47): the in-process half. Each test names the issue's item it covers; the
launches under the default ZeRO-3 config (items 3, 4, 5, 7) are in tests/test_faults.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def _one_line(fn, capsys, needle, code=2) -> str:
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == code, (e.value.code, err)
    assert len(err) == 1 and needle in err[0], err
    return err[0]


# ------------------------------------------------------------------------------- 1. prepare_data's neighbours
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from easy_context_train.toy import build_tokenizer, make_corpus
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(make_corpus(20), str(d))
    return str(d)


def test_1_prepare_data_leaves_users_tmp_and_old_alone(tok, tmp_path):
    import prepare_data
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"hello world number {i} and more"}) + "\n" for i in range(6)))
    out = tmp_path / "ds"
    for mine in ("ds.tmp", "ds.old", "ds.rows.arrow"):  # the user's, next to --output
        (tmp_path / mine).mkdir()
        (tmp_path / mine / "keep.txt").write_text(mine)

    def prep(*extra):
        prepare_data.main(["--dataset", str(data), "--tokenizer", tok, "--seq-length", "8", "--output", str(out),
                           "--num-proc", "1", *extra])
    prep()
    prep("--overwrite")
    prep("--overwrite", "--document-masking")  # the packed-rows writer (save_rows) too
    for mine in ("ds.tmp", "ds.old", "ds.rows.arrow"):
        assert (tmp_path / mine / "keep.txt").read_text() == mine
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "ds", "ds.old", "ds.rows.arrow", "ds.tmp"]
    assert os.path.exists(out / ".easy_context_dataset")


def test_1_a_killed_prepare_data_is_recovered_not_lost(tmp_path):
    """A run killed between moving the old dataset aside and renaming the new one: the next run puts it back."""
    import socket

    from easy_context_train.data import recover_scratch
    out = tmp_path / "ds"
    work = tmp_path / ".ds.prepare-abc123"
    (work / "old").mkdir(parents=True)
    (work / "old" / "data.arrow").write_text("rows")
    (work / "owner.json").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    alive = tmp_path / ".ds.prepare-live"  # a running prepare_data.py's: untouched
    alive.mkdir()
    (alive / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    recover_scratch(str(out))
    assert (out / "data.arrow").read_text() == "rows" and not work.exists() and alive.exists()


# ------------------------------------------------------------------------------- 2. a finished output dir
def test_2_fresh_run_into_a_finished_dir_is_refused(tmp_path):
    """What every recipe stage leaves: the final model, run.json, metrics.jsonl, no checkpoints/."""
    from types import SimpleNamespace

    from easy_context_train import run_dir
    from easy_context_train.errors import UsageError
    for name in ("config.json", "model.safetensors", "metrics.jsonl"):
        (tmp_path / name).write_text("{}\n")
    run_dir.atomic_write_json(str(tmp_path / "run.json"), {"run_id": "abc", "flags": {}})
    args = SimpleNamespace(resume=False, overwrite_output_dir=False, log_file=str(tmp_path / "metrics.jsonl"))
    with pytest.raises(UsageError, match=r"holds the outputs of run abc \(config.json, model.safetensors, "
                                         r"metrics.jsonl\); a fresh run would replace them.*--overwrite-output-dir"):
        run_dir.check_run(str(tmp_path), args, [])
    from easy_context_train.run_state import plan_resume  # --resume there: the finished run's state decides (#60)
    with pytest.raises(UsageError, match="holds the final model of run abc .* no record of its last step"):
        plan_resume(SimpleNamespace(**{**vars(args), "resume": True, "output_dir": str(tmp_path),
                                       "max_train_steps": 4}), [])
    run_dir.check_run(str(tmp_path), SimpleNamespace(**{**vars(args), "overwrite_output_dir": True}), [])
    other = tmp_path / "elsewhere"  # --log-file outside the output dir, holding another run's lines
    other.mkdir()
    (other / "log.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UsageError, match="log.jsonl"):
        run_dir.check_run(str(other / "new"), SimpleNamespace(**{**vars(args), "log_file": str(other / "log.jsonl")}),
                          [])
    run_dir.check_run(str(other / "new"), SimpleNamespace(**{**vars(args), "log_file": str(other / "l2.jsonl")}), [])


# ------------------------------------------------------------------------------- 3. a peer lost inside DeepSpeed
def test_3_gloo_errors_from_deepspeeds_collectives_are_recognised():
    """gloo raises a plain RuntimeError inside DeepSpeed's ZeRO-3 collectives (no phase of ours around them); the
    fault handler finds the call in the traceback (the launch itself: tests/test_faults.py, zero3 chain)."""
    from easy_context_train.faults import failed_collective
    ns: dict = {}
    exec(compile("def reduce_scatter_single():\n    raise RuntimeError('[/gloo/transport/tcp/pair.cc:537] Read error "
                 "[127.0.0.1]:40363: Connection reset by peer. This is typically caused by')",
                 "/site-packages/torch/distributed/distributed_c10d.py", "exec"), ns)
    exec(compile("def reduce_scatter_fn(f):\n    f()", "/site-packages/deepspeed/comm/comm.py", "exec"), ns)
    try:
        ns["reduce_scatter_fn"](ns["reduce_scatter_single"])
    except RuntimeError as e:
        assert failed_collective(e) == "DeepSpeed's reduce_scatter_single"
    try:
        raise RuntimeError("shape mismatch")  # a bug, not a lost peer: keeps its traceback
    except RuntimeError as e:
        assert failed_collective(e) is None


# ------------------------------------------------------------------------------- 4. --resume checks the flags
class _Acc:
    """What open_run uses of an Accelerator (one process standing for ``world``)."""
    def __init__(self, world=2):
        self.is_main_process, self.num_processes, self.printed = True, world, []

    def print(self, msg):
        self.printed.append(msg)

    def wait_for_everyone(self):
        pass


def _open(tmp_path, config, *extra, world=2):
    from easy_context_train.args import parse_args
    from easy_context_train.session import open_run
    args = parse_args(["--model", "m", "--dataset", "d", "--output-dir", str(tmp_path / "out"), "--seq-length", "128",
                       *extra])
    acc = _Acc(world)
    lock, run_id = open_run(args, acc, config)
    lock.release()
    return run_id, acc


def test_4_resume_refuses_changed_flags_and_another_model(tmp_path, capsys):
    import copy

    from transformers import LlamaConfig

    from easy_context.hf.config import set_rope_theta
    from easy_context_train.errors import UsageError
    from easy_context_train.run_dir import read_run
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=384)
    run_id, _ = _open(tmp_path, cfg)
    ck = tmp_path / "out" / "checkpoints" / "step-0000002"
    ck.mkdir(parents=True)
    (ck / "train_state.json").write_text(json.dumps({"step": 2, "run_id": run_id}))
    assert _open(tmp_path, cfg, "--resume")[0] == run_id  # the same flags: continues
    with pytest.raises(UsageError, match=r"was started with --seq-length 128 \(now 256\); rerun with the recorded "
                                         r"value\(s\), or pass --accept-changed seq-length "):
        _open(tmp_path, cfg, "--resume", "--seq-length", "256")
    hot = copy.deepcopy(cfg)
    set_rope_theta(hot, 20000.0)  # as load_config applies --rope-theta
    with pytest.raises(UsageError, match=r"--parallel_mode 'zigzag_ring_attn' \(now 'ulysses_attn'\), --rope-theta "
                                         r"10000 \(now 20000\).*--accept-changed parallel-mode,rope-theta"):
        _open(tmp_path, hot, "--resume", "--parallel_mode", "ulysses_attn", "--rope-theta", "20000")
    other = LlamaConfig(**{**cfg.to_dict(), "hidden_size": 32, "intermediate_size": 64})
    with pytest.raises(UsageError, match=r"hold a different model \(llama, 2 layers, hidden 64, 4 heads \(2 kv\), "
                                         r"vocab 384\) than --model 'm' \(llama, 2 layers, hidden 32.*cannot be loaded"):
        _open(tmp_path, other, "--resume", "--accept-changed", "model")
    with pytest.raises(UsageError, match="written by 2 processes and this launch has 4"):
        _open(tmp_path, cfg, "--resume", world=4)
    with pytest.raises(UsageError, match="LoRA rank 8"):
        _open(tmp_path, cfg, "--resume", "--lora-rank", "8")
    _, acc = _open(tmp_path, cfg, "--resume", "--seq-length", "256", "--accept-changed", "seq-length")  # a new stage
    assert acc.printed == ["--resume --accept-changed: --seq-length 128 -> 256 (recorded in run.json)"]
    rec = read_run(str(tmp_path / "out"))
    assert rec["identity"]["seq_length"] == 256 and rec["history"][0]["changed"] == {"seq_length": [128, 256]}
    _open(tmp_path, cfg, "--resume", "--seq-length", "256")  # now the recorded value
    with pytest.raises(SystemExit):
        _open(tmp_path, cfg, "--resume", "--accept-changed", "max-train-steps")
    assert "--accept-changed: unknown name(s) max_train_steps" in capsys.readouterr().err


# ------------------------------------------------------------------------------- 5. disk full in the final save
class _RankAcc:
    def __init__(self, rank):
        import torch
        self.is_main_process, self.device = rank == 0, torch.device("cpu")


def _final_save_fails(rank, world, out):
    """Rank 0's write hits a real OS limit (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) mid-file."""
    import resource
    import signal

    from easy_context_train import checkpoint as ckpt

    def write(tmp):
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
                f.write(b"w" * 10000)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with pytest.raises(ckpt.FinalSaveError) as e:  # every rank raises (none waits at a barrier), exit 74 on each
        ckpt.write_final(_RankAcc(rank), out, write, last="config.json", need=10000)
    assert e.value.code == 74 and e.value.local == (rank == 0)
    if rank == 0:
        msg = str(e.value)
        assert msg.startswith(f"cannot write the final model to {out} after step 0: File too large "
                              f"({out}/.final-tmp-"), msg
        assert "free of" in msg and "the model takes 9.8 KiB); nothing of it was kept and no checkpoint exists: " \
            "raise the file-size limit (ulimit -f)" in msg and "--overwrite-output-dir" in msg, msg
    import torch.distributed as dist
    dist.barrier()
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]  # no temp dir, no half model

    def bug(tmp):
        raise AssertionError("not a write error")
    # a bug in the main process's write: its traceback stays, the others learn it and exit quietly (no hang)
    with pytest.raises(AssertionError if rank == 0 else ckpt.FinalSaveError):
        ckpt.write_final(_RankAcc(rank), out, bug, last="config.json")


def test_5_disk_full_in_the_final_save_is_one_error_on_every_rank(tmp_path):
    from tests.harness import run_ranks
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    run_ranks(_final_save_fails, world_size=2, args=(str(tmp_path),), timeout=120, collective_timeout=30)


# ------------------------------------------------------------------------------- 6. ids outside the vocabulary
def test_6_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    import datasets

    from easy_context_train.data import load_any_dataset, validate_packed
    from easy_context_train.errors import UsageError
    ok = [list(range(9)), list(range(10, 19))]
    for rows, needle in (([ok[0], [5, 6, 999999, 7, 8, 9, 1, 2, 3]], r"row 1: token id 999999 at index 2 is outside the "
                                                                    r"vocabulary of --model m \(vocab_size 384: ids 0..383\)"),
                         ([[-5] + ok[0][1:], ok[1]], r"row 0: token id -5 at index 0")):
        path = tmp_path / f"d{len(needle)}"
        datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(path))
        with pytest.raises(UsageError, match=needle):
            validate_packed(load_any_dataset(str(path)), str(path), 8, 384, "m")
    labels = tmp_path / "labels"
    datasets.Dataset.from_dict({"input_ids": ok, "labels": [[-100] * 9, [1] * 8 + [384]]}).save_to_disk(str(labels))
    with pytest.raises(UsageError, match=r"row 1: label \(a token id or -100\) 384 at index 8"):
        validate_packed(load_any_dataset(str(labels)), str(labels), 8, 384, "m")
    validate_packed(load_any_dataset(str(labels)), str(labels), 8, 385, "m")  # -100 is not an id: fine


# ------------------------------------------------------------------------------- 8. colliding step numbers
class _SaveAcc:
    is_main_process = True

    def __init__(self, fill=b"w"):
        self.fill = fill

    def save_state(self, path):
        with open(os.path.join(path, "model.bin"), "wb") as f:
            f.write(self.fill * 5000)

    def wait_for_everyone(self):
        pass


def test_8_another_runs_checkpoint_of_the_same_step_is_never_replaced(tmp_path):
    from easy_context_train import checkpoint as ckpt
    from easy_context_train import run_dir
    from easy_context_train.errors import UsageError
    out = str(tmp_path / "out")
    ckpt.save_checkpoint(_SaveAcc(b"o"), out, 10, keep=5, run_id="old")
    ckpt.save_checkpoint(_SaveAcc(b"n"), out, 4, keep=5, run_id="new")
    with pytest.raises(ckpt.CheckpointWriteError, match=r"step-0000010: that step's checkpoint belongs to run old, "
                                                        r"not to this run \(new\); it was not replaced") as e:
        ckpt.save_checkpoint(_SaveAcc(b"n"), out, 10, keep=5, run_id="new")
    assert e.value.code == 74
    found = ckpt.list_checkpoints(out)
    assert [s for s, _ in found] == [4, 10] and run_dir.run_of(found[1][1]) == "old"
    assert open(os.path.join(found[1][1], "model.bin"), "rb").read(1) == b"o" and not run_dir.verify_checkpoint(
        found[1][1])
    ckpt.save_checkpoint(_SaveAcc(b"n"), out, 4, keep=5, run_id="new")  # its own step: re-saved
    run_dir.atomic_write_json(os.path.join(out, "run.json"), {"run_id": "new"})
    with pytest.raises(UsageError, match=r"holds checkpoints of another run at steps this run \(run new\) will "
                                         r"reach: step-0000010 \(run old\)"):  # --resume: refused at the start
        run_dir.check_collisions(out, found)
    run_dir.check_collisions(out, found[:1])


# ------------------------------------------------------------------------------- 9. every path checked first
def test_9_unwritable_log_file_is_one_line_before_anything_loads(tmp_path, capsys):
    from easy_context_train.args import parse_args
    out = str(tmp_path / "out")
    f = tmp_path / "a_file"
    f.write_text("x")
    for log, needle in (("/proc/no/metrics.jsonl", "--log-file (its directory) '/proc/no' is not writable ('/proc' "
                                                   "does not allow creating files: No such file or directory)"),
                        (str(f / "metrics.jsonl"), "a_file' is a file, not a directory"),
                        (str(tmp_path), "--log-file " + repr(str(tmp_path)) + " is a directory")):
        _one_line(lambda: parse_args(["--output-dir", out, "--log-file", log]), capsys, needle)
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "checkpoints").write_text("x")
    _one_line(lambda: parse_args(["--output-dir", str(tmp_path / "o2")]), capsys, "is a file where the run writes a "
              "directory (checkpoints/): move it")
    (tmp_path / "o2" / "checkpoints").unlink()
    (tmp_path / "o2" / ".final.tmp").write_text("x")  # a user's: the final save's temp dir is private now (#60)
    parse_args(["--output-dir", str(tmp_path / "o2")])
    (tmp_path / "o2" / ".final.tmp").unlink()
    parse_args(["--output-dir", out, "--log-file", str(tmp_path / "logs" / "m.jsonl")])  # creatable: fine
    assert sorted(os.listdir(tmp_path)) == ["a_file", "o2"]  # the probes left nothing behind


# ------------------------------------------------------------------------------- 10. plan --doc-median
@pytest.mark.parametrize("flags,needle", [
    (["--doc-median", "0"], "--doc-median must be a positive number of tokens, got 0"),
    (["--doc-median", "-5"], "--doc-median must be a positive number of tokens, got -5"),
    (["--doc-median", "nan"], "--doc-median must be a positive number of tokens, got nan"),
    (["--doc-median", "inf"], "--doc-median must be a positive number of tokens, got inf"),
    (["--doc-median", "1000", "--doc-sigma", "nan"], "--doc-sigma must be a number >= 0 (the log-normal's sigma), got nan"),
])
def test_10_plan_bad_doc_median_is_one_line(flags, needle, capsys):
    from easy_context.__main__ import main
    assert main(["plan", "--model", "llama-2-7b", "--seq-length", "65536", "--gpus", "8", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m easy_context plan: error: {needle}"], err


def test_10_plan_doc_median_longer_than_the_row(capsys):
    from easy_context.__main__ import main
    assert main(["plan", "--model", "llama-2-7b", "--seq-length", "65536", "--gpus", "8", "--doc-median", "1e30"]) == 0
    assert "zigzag" in capsys.readouterr().out


# ------------------------------------------------------------------------------- 12. a stale op-build lock
_LOADER = """
import sys
if sys.argv[1] == "watch":
    from easy_context_train.op_build import watch_op_builds
    watch_op_builds(1.0, interval=0.2)
from deepspeed.ops.op_builder import CPUAdamBuilder
CPUAdamBuilder().load()  # waits on TORCH_EXTENSIONS_DIR/cpu_adam/lock as every DeepSpeed launch does
"""


def test_12_stale_op_build_lock_is_one_line_not_a_silent_hang(tmp_path):
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # left by a build killed an hour ago
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    holder = subprocess.Popen([sys.executable, "-c", f"import os, sys, time; fd = os.open({str(lock)!r}, os.O_RDONLY); "
                               "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"  # as a live build keeps it open
    p = subprocess.Popen([sys.executable, "-c", _LOADER, "watch"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(6)
        assert p.poll() is None, p.communicate()  # a lock a live process holds is waited for, as torch does
        holder.kill()
        out, err = p.communicate(timeout=60)
    finally:
        holder.kill()
        p.kill()
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert p.returncode == 5 and len(lines) == 1, (p.returncode, err[-3000:])
    assert lines[0].startswith(f"train.py: error: the JIT build of DeepSpeed's ops waits for the lock {lock}, left "
                               "1.0 h ago by a build that no process holds any more"), lines
    assert f"Remove it: rm {lock}, then rerun" in lines[0], lines


def test_12_lock_holders_are_found_in_proc(tmp_path):
    import threading

    from easy_context_train.op_build import holders, stale_age, waited_lock
    lock = tmp_path / "py311_cpu" / "op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    assert holders(str(lock)) == []
    with open(lock) as f:  # noqa: F841 - held open by this process
        assert holders(str(lock)) == [os.getpid()] and stale_age(str(lock), -1) is None
    assert stale_age(str(lock), -1) is not None and stale_age(str(lock), 60) is None
    assert waited_lock(threading.main_thread().ident) is None  # a stale lock nobody waits for is left alone


# ------------------------------------------------------------------------------- 11. rendezvous and heartbeats
def test_11_watchdog_never_signals_a_pid_only_a_heartbeat_names(monkeypatch):
    """Anything that reaches the store can write a heartbeat: a forged one naming a stopped process that is not a
    worker of this launch gets neither a SIGKILL nor a 'stopped' in the line."""
    import datetime
    import signal
    import socket

    import torch.distributed as dist

    from easy_context_train.watchdog import Watchdog
    from easy_context.tools.gloo import free_port
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5))  # noqa: F841
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dog = Watchdog(0, 2, 10.0)
    dog.close()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(victim.pid, signal.SIGSTOP)
        time.sleep(0.3)
        dog.store.set(dog.keys("hb", 1), json.dumps({"t": time.time() - 30, "phase": "all-to-all", "step": 3,
                                                     "pid": victim.pid, "host": socket.gethostname()}))
        dog.kill_stopped()
        time.sleep(0.3)
        assert victim.poll() is None, "the watchdog killed a process a heartbeat named"
        line, _ = dog.describe("no progress")
        assert f"rank 1 (pid {victim.pid} on {socket.gethostname()}) is not responding" in line, line
    finally:
        victim.kill()
        victim.wait()


def _listening(rank, world, port):
    import psutil
    if rank == 0:
        addrs = {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert addrs == {"127.0.0.1"}, addrs  # torch's own: {"::"} or {"0.0.0.0"}, every interface


def test_11_groups_this_package_sets_up_listen_on_loopback():
    from easy_context.tools.gloo import free_port
    from tests.harness import run_ranks
    import tests.harness as h
    port = free_port()
    real = h.free_port
    h.free_port = lambda: port  # the harness's port, known to the body
    try:
        run_ranks(_listening, world_size=2, args=(port,), timeout=60, collective_timeout=30)
    finally:
        h.free_port = real


def test_11_launcher_store_listens_on_loopback():
    """`python -m easy_context launch`'s agent store (torch elastic's static rendezvous, in that process)."""
    import datetime

    import psutil

    from easy_context.rendezvous import patch_launcher
    from easy_context.tools.gloo import free_port
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    assert patch_launcher()
    port = free_port()
    rdzv = StaticTCPRendezvous("127.0.0.1", port, 0, 1, "test", 10)
    info = rdzv.next_rendezvous()
    info.store.set("k", "v")
    addrs = {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert addrs == {"127.0.0.1"}, addrs
    import torch.distributed as dist
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    assert dist.PrefixStore("test", client).get("k") == b"v"  # the workers' view, unchanged


# ------------------------------------------------------------------------------- 7. DeepSpeed resume bit for bit
def _adam_run(steps, resume_at=None, resync=True):
    """DeepSpeedCPUAdam (what ZeRO-3 with CPU offload steps), optionally rebuilt from its state dict at a step."""
    import copy
    from types import SimpleNamespace

    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from easy_context_train.checkpoint import resync_cpu_adam
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096, generator=g))
    grads = [torch.randn(4096, generator=g) for _ in range(steps)]
    make = lambda q: DeepSpeedCPUAdam([q], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, adamw_mode=True)  # noqa
    opt = make(p)
    for i in range(steps):
        if i == resume_at:  # what --resume does: a new optimizer, its saved state loaded
            state, w = copy.deepcopy(opt.state_dict()), p.detach().clone()
            p = torch.nn.Parameter(w)
            opt = make(p)
            opt.load_state_dict(state)
            if resync:
                assert resync_cpu_adam(SimpleNamespace(_optimizers=[SimpleNamespace(optimizer=opt)])) == resume_at
        p.grad = grads[i]
        opt.step()
    return p.detach()


def test_7_deepspeed_cpu_adam_resumes_bit_for_bit(monkeypatch):
    # the venv's bin first, as the launches have it: DeepSpeed's JIT-built op is cached per build environment
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    unbroken = _adam_run(16)
    assert not bool((_adam_run(16, 10, resync=False) == unbroken).all())  # DeepSpeed alone: pow() vs running product
    assert bool((_adam_run(16, 10) == unbroken).all())


def test_usage_error_line_comes_from_the_first_rank_under_a_launcher(monkeypatch, capsys):
    """The launcher stops the other ranks when the first one exits: the line must come from whichever rank fails
    first, not from rank 0 only (which may be the one stopped before it printed: a silent exit 2)."""
    import datetime

    import torch.distributed as dist

    from easy_context.errors import fail
    from easy_context.tools.gloo import free_port
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5))  # noqa: F841
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, printed in (("1", True), ("0", False)):  # rank 1 gets there first
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit):
            fail("--log-file 'x' is a directory", "train.py")
        assert bool(capsys.readouterr().err) == printed, rank
