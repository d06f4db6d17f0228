"""``python -m easy_context faults``: every fault and bad input of docs/faults.md, tried on this machine.

    python -m easy_context faults            # the quick subset: bad inputs, output dirs, resume checks (~2 min)
    python -m easy_context faults --full     # + the faults of a running job under DeepSpeed ZeRO-3 (~6 more min)

Each case runs what a user runs (``train.py``, ``prepare_data.py``, ``python -m easy_context plan``; ``--full``:
``python -m easy_context launch --config_file accelerate_configs/cpu.yaml train.py``, 2 CPU gloo ranks) on a tiny
local Llama and corpus (``easy_context_train/toy.py``, no downloads) and prints one markdown row: the case, the line the user
sees, the exit status (under a launcher: every worker's), and whether that is what docs/faults.md promises. Faults of
a running job are injected with ``EASY_CONTEXT_CRASH`` (docs/faults.md, "Testing hooks") or signals. Exit status 0
when every case behaved as documented, 1 otherwise. Needs the repository checkout (train.py next to the package).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from easy_context.registry import PLAIN_MODE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo (train.py)
TRAIN = ["--parallel_mode", PLAIN_MODE, "--seq-length", "128", "--gradient-accumulate-every", "1",
         "--learning-rate", "3e-3", "--warmup-steps", "2", "--rope-theta", "20000", "--collective-timeout", "60s"]


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("EASY_CONTEXT_CRASH", None)
    env.update(extra)
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bench:
    def __init__(self, work: str):
        from .toy import build_all, build_model
        self.work = work
        self.toy = build_all(os.path.join(work, "toy"), seq_lengths=(128,), n_docs=120)
        self.other = os.path.join(work, "other-model")
        build_model(self.other, vocab_size=384, hidden=32)  # another architecture, the same vocabulary
        self.rows: list[tuple] = []

    # ---------------------------------------------------------------------------------------- running
    def run(self, cmd: list[str], env=None, timeout=600, during=None, preexec=None) -> tuple[int, str]:
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(**(env or {})), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, preexec_fn=preexec)
        if during:
            during(p)
        try:
            log = p.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            log = p.communicate()[0] + "\n(killed by the bench: no exit within the time limit)"
        return p.returncode, log

    def train(self, out, *extra, env=None, launch=False, model=None, during=None, data=None):
        args = ["--model", model or self.toy["model"], "--dataset", data or self.toy["data_128"], "--output-dir", out,
                *TRAIN, *extra]
        if launch:
            cmd = [sys.executable, "-m", "easy_context", "launch", "--config_file",
                   os.path.join(ROOT, "accelerate_configs", "cpu.yaml"), "--main_process_port", str(_port()),
                   os.path.join(ROOT, "train.py"), *args]
        else:
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args]
        return self.run(cmd, env=env, during=during)

    def record(self, case: str, rc: int, log: str, expect: str, note: str = "", ok: bool = True) -> None:
        """One row. ``expect``: the exit status, or every worker's under a launcher ("-9, 4": a killed rank and the
        one that reported it; "5 or -15, 5": the launcher may stop a rank with SIGTERM before it exits on its own).
        A worker traceback, or more than one error line, is never as documented."""
        lines = [ln[ln.index(p):] for ln in log.replace("\r", "\n").splitlines()
                 for p in ("train.py: ", "prepare_data.py: ", "python -m easy_context plan: ",
                           "python -m easy_context check: ")
                 if p in ln and ("error" in ln or "preempted" in ln)]
        workers = sorted(set(int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", log)))
        status = ", ".join(map(str, workers)) if workers else str(rc)
        tracebacks = sum(1 for ln in log.splitlines() if ln.startswith("[rank") and "Traceback" in ln) if workers \
            else log.count("Traceback (most recent call last)")
        what = (lines[0] if lines else note or "(no error line)") + (f" [{tracebacks} worker traceback(s)]"
                                                                    if tracebacks else "")
        good = ok and status in expect.split(" or ") and not tracebacks and len(lines) <= 1
        self.rows.append((case, what + (f" [{len(lines)} error lines]" if len(lines) > 1 else ""), status, expect,
                          "yes" if good else "NO"))
        print(f"{'ok' if good else 'NO'} {case}: {status} {what[:160]}", flush=True)

    # ---------------------------------------------------------------------------------------- the cases
    def quick(self) -> None:
        w = self.work
        # prepare_data next to a user's OUTPUT.tmp / OUTPUT.old
        ds = os.path.join(w, "ds")
        for mine in (ds + ".tmp", ds + ".old"):
            os.makedirs(mine)
            open(os.path.join(mine, "notes.txt"), "w").write("mine")
        prep = [sys.executable, os.path.join(ROOT, "prepare_data.py"), "--dataset", self.toy["corpus"],
                "--tokenizer", self.toy["model"], "--seq-length", "64", "--output", ds, "--num-proc", "1"]
        self.run(prep)
        rc, log = self.run(prep + ["--overwrite"])
        kept = all(os.path.exists(os.path.join(m, "notes.txt")) for m in (ds + ".tmp", ds + ".old"))
        self.record("prepare_data.py --overwrite next to the user's OUTPUT.tmp/ and OUTPUT.old/", rc, log, "0",
                    "dataset replaced; OUTPUT.tmp/ and OUTPUT.old/ " + ("kept" if kept else "DELETED"), ok=kept)
        rc, log = self.run([sys.executable, "-m", "easy_context", "plan", "--model", "llama-2-7b", "--seq-length",
                            "65536", "--gpus", "8", "--doc-median", "0"])
        self.record("plan --doc-median 0 (or < 0, nan, inf)", rc, log, "2")
        rc, log = self.train(os.path.join(w, "o-log"), "--log-file", "/proc/no/metrics.jsonl")
        self.record("--log-file not writable", rc, log, "2")
        import datasets
        datasets.disable_progress_bars()
        bad = os.path.join(w, "bad-ids")
        datasets.Dataset.from_dict({"input_ids": [[1] * 129, [5, 999999] + [1] * 127]}).save_to_disk(bad)
        rc, log = self.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", self.toy["model"], "--dataset",
                            bad, "--output-dir", os.path.join(w, "o-ids"), *TRAIN, "--max-train-steps", "1"])
        self.record("token id outside the vocabulary in the data (999999)", rc, log, "2")
        # a short run (one process), then what a user may try on its directory
        run = os.path.join(w, "run")
        os.makedirs(os.path.join(run, ".final.tmp"))  # the user's own (#60: the final save's temp dir is private)
        open(os.path.join(run, ".final.tmp", "notes.txt"), "w").write("mine")
        rc, log = self.train(run, "--max-train-steps", "4", "--checkpoint-every", "2",
                             env={"EASY_CONTEXT_CRASH": "sigterm:final"})
        kept = os.path.exists(os.path.join(run, ".final.tmp", "notes.txt"))
        self.record("a short run (baseline: checkpoints at steps 2 and 4, final model); SIGTERM just after the final "
                    "save; the user's OUTPUT/.final.tmp/", rc, log, "0", _said(log) + "; .final.tmp/ " +
                    ("kept" if kept else "DELETED"), ok=kept and "is complete" in log)
        model = os.path.join(run, "model.safetensors")
        sha = _sha(model)
        rc, log = self.train(run, "--max-train-steps", "4", "--resume")
        self.record("--resume into that finished run (a scheduler's requeue)", rc, log, "0", _said(log),
                    ok="nothing to resume" in log)
        rc, log = self.train(run, "--max-train-steps", "3", "--resume")
        self.record("--resume into a finished run with a lower --max-train-steps", rc, log, "2",
                    ok=_sha(model) == sha)
        done = os.path.join(w, "finished")
        shutil.copytree(run, done, ignore=shutil.ignore_patterns("checkpoints"))  # what every recipe stage leaves
        rc, log = self.train(done, "--max-train-steps", "4")
        self.record("fresh run into a finished output dir (model, run.json, metrics; no checkpoints/)", rc, log, "2")
        rc, log = self.train(run, "--max-train-steps", "6", "--resume", "--seq-length", "64")
        self.record("--resume with another --seq-length", rc, log, "2")
        rc, log = self.train(run, "--max-train-steps", "6", "--resume", model=self.other)
        self.record("--resume with a model of another architecture", rc, log, "2")
        foreign = os.path.join(run, "checkpoints", "step-0000005")
        shutil.copytree(os.path.join(run, "checkpoints", "step-0000004"), foreign)
        state = os.path.join(foreign, "train_state.json")
        json.dump({**json.load(open(state)), "run_id": "someone-else", "step": 5}, open(state, "w"))
        rc, log = self.train(run, "--max-train-steps", "6", "--resume")
        self.record("--resume where another run's checkpoint sits at a step this run will reach", rc, log, "2",
                    ok=_sha(model) == sha)
        shutil.rmtree(foreign)
        self.second_probe(prep)
        # a lock left by a run killed while DeepSpeed compiled its ops
        ext = os.path.join(w, "torch_extensions")
        for op in ("deepspeed_shm_comm", "cpu_adam"):
            os.makedirs(os.path.join(ext, op))
            lock = os.path.join(ext, op, "lock")
            open(lock, "w").close()
            os.utime(lock, (time.time() - 3600, time.time() - 3600))
        rc, log = self.train(os.path.join(w, "o-lock"), "--max-train-steps", "1", "--build-lock-timeout", "60s",
                             launch=True, env={"TORCH_EXTENSIONS_DIR": ext})
        self.record("a stale torch_extensions lock (a run killed mid op build), ZeRO-3 launch", rc, log,
                    "5 or -15, 5")

    def second_probe(self, prep: list[str]) -> None:
        """The cases of issue #60 that one process shows (the ZeRO-3 launches: ``full``)."""
        import datasets
        w = self.work
        data = os.path.join(w, "data-x")
        shutil.copytree(self.toy["data_128"], data)
        rc, log = self.train(os.path.join(w, "r-data"), "--max-train-steps", "4", "--checkpoint-every", "2",
                             env={"EASY_CONTEXT_CRASH": "step:2"}, data=data)
        rows = datasets.load_from_disk(data).select(range(40)).flatten_indices()
        rows.save_to_disk(data + ".new")
        shutil.rmtree(data)
        os.replace(data + ".new", data)  # what prepare_data --overwrite into the same path does
        rc, log = self.train(os.path.join(w, "r-data"), "--max-train-steps", "4", "--checkpoint-every", "2", "--resume",
                             data=data)
        self.record("--resume after the dataset at --dataset was replaced (fewer rows)", rc, log, "2")
        masked = os.path.join(w, "masked")
        ids = datasets.load_from_disk(self.toy["data_128"]).select(range(4))["input_ids"]
        datasets.Dataset.from_dict({"input_ids": ids, "labels": [[-100] * len(r) for r in ids]}).save_to_disk(masked)
        rc, log = self.train(os.path.join(w, "o-masked"), "--max-train-steps", "1", data=masked)
        self.record("a dataset whose labels are all -100 (a chat template without assistant markers)", rc, log, "2")
        for field, tool in (("hidden_size", "check"), ("num_attention_heads", "train")):
            cfg_dir = os.path.join(w, f"no-{field}")
            shutil.copytree(self.toy["model"], cfg_dir)
            cfg = json.load(open(os.path.join(cfg_dir, "config.json")))
            cfg.pop(field)
            json.dump(cfg, open(os.path.join(cfg_dir, "config.json"), "w"))
            if tool == "check":
                rc, log = self.run([sys.executable, "-m", "easy_context", "check", "--model", cfg_dir])
            else:
                rc, log = self.train(os.path.join(w, "o-heads"), "--max-train-steps", "1", model=cfg_dir)
            self.record(f"{'check --model' if tool == 'check' else 'train.py --model'}: config.json without {field}",
                        rc, log, "2", _said(log, "error"))
        for flag, val in (("--nodes", "1000000000"), ("--gpu-mem", "1e300")):
            rc, log = self.run([sys.executable, "-m", "easy_context", "plan", "--model", "llama-2-7b", "--seq-length",
                                "65536", "--gpus", "8", flag, val], timeout=120)
            self.record(f"plan {flag} {val}", rc, log, "2")
        out = os.path.join(w, "ds-full")
        rc, log = self.run(prep[:-3] + [out, "--num-proc", "1"], preexec=_small_files)
        left = [n for n in os.listdir(w) if n.startswith(("ds-full", ".ds-full"))]
        self.record("prepare_data.py on a disk that fills mid-write (a 16 KiB file-size limit)", rc, log, "74",
                    ok=not left)
        rc, log = self.train(os.path.join(w, "o-ro"), "--max-train-steps", "4", env={"EASY_CONTEXT_CRASH": "readonly:3"})
        self.record("the output file system turns read-only mid-run (the metrics append)", rc, log, "74")

    def full(self) -> None:
        w = self.work

        def z3(name, *extra, env=None, during=None):
            return self.train(os.path.join(w, name), "--max-train-steps", "14", "--checkpoint-every", "5", *extra,
                              env=env, launch=True, during=during)
        rc, log = z3("z-ref")
        ref = _losses(os.path.join(w, "z-ref"))
        self.record("ZeRO-3 run, 14 steps (baseline)", rc, log, "0", "trained, saved")
        rc, log = z3("z-term", env={"EASY_CONTEXT_CRASH": "sigterm:7:1"})
        self.record("SIGTERM reaches rank 1 only (preemption)", rc, log, "75")
        rc, log = z3("z-term", "--resume", env={"EASY_CONTEXT_CRASH": "layer:12:1"})
        self.record("rank 1 killed mid-step (rank 0 inside DeepSpeed's collectives)", rc, log, "-9, 4")
        rc, log = z3("z-term", "--resume", env={"EASY_CONTEXT_CRASH": "oom:11:1"})
        self.record("out of memory on rank 1", rc, log, "3, 4")
        rc, log = z3("z-term", "--resume", env={"EASY_CONTEXT_CRASH": "disk_full:final"})
        self.record("disk full during the final model save", rc, log, "74")
        rc, log = z3("z-term", "--resume")
        same = _losses(os.path.join(w, "z-term")) == ref
        self.record("--resume to the end after all of the above", rc, log, "0",
                    f"losses equal to the unbroken run's, bit for bit: {'yes' if same else 'NO'}", ok=same)
        rc, log = z3("z-disk", env={"EASY_CONTEXT_CRASH": "disk_full:10:1"})
        self.record("disk full on rank 1 during checkpoint 10", rc, log, "74")
        stop = os.path.join(w, "z-stop")
        rc, log = z3("z-stop", "--max-train-steps", "1000", "--collective-timeout", "8s", "--no-save-model",
                     during=lambda p: _stop_rank_1(p, stop))
        self.record("rank 1 SIGSTOPped (hung), --collective-timeout 8s", rc, log, "-9, 4")
        rc, log = z3("z-ro", env={"EASY_CONTEXT_CRASH": "readonly:7"})
        self.record("the output file system turns read-only mid-run (rank 0's metrics append), ZeRO-3", rc, log, "74")
        rc, log = z3("z-fin", env={"EASY_CONTEXT_CRASH": "sigterm:final"})
        self.record("SIGTERM reaches both ranks just after the final save, ZeRO-3", rc, log, "0", _said(log),
                    ok="is complete" in log)

    def table(self) -> str:
        head = ["| # | fault or bad input | what the user sees | exit status | expected | as documented |",
                "|---|---|---|---|---|---|"]
        return "\n".join(head + [f"| {i} | {c} | `{w}` | {s} | {e} | {ok} |".replace("``", "")
                                 for i, (c, w, s, e, ok) in enumerate(self.rows, 1)])


def _said(log: str, word: str = "") -> str:
    """The tool's own line (a note, not an error) for the table."""
    lines = [ln[ln.index(p):] for ln in log.replace("\r", "\n").splitlines()
             for p in ("train.py: ", "python -m easy_context check: ") if p in ln and word in ln]
    return lines[-1] if lines else "(no line)"


def _sha(path: str) -> str:
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _small_files() -> None:
    """preexec: writes past 16 KiB fail (EFBIG), as on a disk that fills mid-write."""
    import resource
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _losses(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(ln)["loss"] for ln in f]


def _stop_rank_1(p, out: str) -> None:
    """SIGSTOP rank 1 once training runs (its metrics appear)."""
    import psutil
    metrics, deadline = os.path.join(out, "metrics.jsonl"), time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if os.path.exists(metrics) and os.path.getsize(metrics):
            try:
                for c in psutil.Process(p.pid).children(recursive=True):
                    if "train.py" in " ".join(c.cmdline()) and c.environ().get("RANK") == "1":
                        c.suspend()
                        return
            except psutil.Error:
                pass
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m easy_context faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="also the faults of a running ZeRO-3 job (2 gloo ranks)")
    p.add_argument("--keep", default=None, help="work in this directory and keep it (default: a temp dir, removed)")
    args = p.parse_args(argv)
    if not os.path.exists(os.path.join(ROOT, "train.py")):
        print(f"python -m easy_context faults: error: needs the repository checkout (no train.py in {ROOT})",
              file=sys.stderr)
        return 2
    work = args.keep or tempfile.mkdtemp(prefix="easy_context-faults-")
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    try:
        bench = Bench(work)
        bench.quick()
        if args.full:
            bench.full()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    import platform

    import torch
    print(f"\n{bench.table()}\n\n{platform.node()}: {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s")
    return 0 if all(r[-1] == "yes" for r in bench.rows) else 1


__all__ = ["main"]
