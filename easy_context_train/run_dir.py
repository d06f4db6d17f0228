"""What a run owns in its output directory: its identity, a lock, and checkpoints it can trust.

* ``run.json`` (written when a run starts fresh): the run id and a fingerprint of the flags. Checkpoints carry
  the run id; ``--resume`` continues only this directory's run, pruning only deletes this run's checkpoints,
  and a fresh run into a directory holding another run's checkpoints, final model or metrics is refused
  (``--overwrite-output-dir`` deletes / replaces them, ``--resume`` continues the checkpoints).
* ``run.lock`` (O_EXCL): one run per output directory. A lock whose process is dead (same host) is stale and
  taken over with a warning; a live one is an error naming its pid and host.
* Workers exit when their launcher dies (``exit_with_parent``: Linux PR_SET_PDEATHSIG), so a killed
  ``accelerate launch`` never leaves ranks training into the directory.
* ``manifest.json`` in every checkpoint: size of every file and the sha256 of the small ones; a checkpoint
  that does not match (truncated shard, empty train_state.json) is skipped with a warning naming the file and
  the previous good one is used.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
import warnings

from easy_context.paths import check_writable_dir, check_writable_file  # noqa: F401 (shared with the evals)
from .errors import UsageError

RUN_FILE, LOCK_FILE, MANIFEST = "run.json", "run.lock", "manifest.json"
_HASH_LIMIT = 64 << 20  # files up to this size are hashed; larger ones (weight/optimizer shards) checked by size


def fingerprint(args) -> dict:
    """The flags that define what a run trains (not how long or where it logs)."""
    keys = ("model", "dataset", "seq_length", "learning_rate", "seed", "rope_theta", "parallel_mode",
            "ring_degree", "sp_size", "batch_size", "gradient_accumulate_every", "lr_schedule", "warmup_steps")
    return {k: getattr(args, k, None) for k in keys}


def read_run(output_dir: str) -> dict | None:
    try:
        with open(os.path.join(output_dir, RUN_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


FINAL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "adapter_model.safetensors", "adapter_config.json")  # what a finished run leaves (save_outputs)


def finished_outputs(output_dir: str, log_file: str | None = None) -> list[str]:
    """The files of a finished (or at least logged) run a fresh start would replace: the final model, a
    non-empty metrics log."""
    found = [n for n in FINAL_FILES if os.path.isfile(os.path.join(output_dir, n))]
    log = log_file or os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(log) and os.path.getsize(log) > 0:
        found.append(log if os.path.dirname(os.path.abspath(log)) != os.path.abspath(output_dir)
                     else os.path.basename(log))
    return found


def check_run(output_dir: str, args, checkpoints: list) -> None:
    """Refuse to mix runs or to replace a finished one (read-only: every rank calls it and fails alike, before any
    collective)."""
    prev = read_run(output_dir)
    who = f"run {prev['run_id']}" if prev else "an earlier run"
    if getattr(args, "overwrite_output_dir", False):
        return
    if checkpoints and not args.resume:
        steps = ", ".join(str(s) for s, _ in checkpoints[-3:])
        raise UsageError(f"--output-dir {output_dir!r} holds checkpoints of {who} (steps {steps}); pass "
                         "--resume to continue it, --overwrite-output-dir to delete them and start over, "
                         "or choose another --output-dir")
    done = finished_outputs(output_dir, getattr(args, "log_file", None))
    if done and not args.resume:
        raise UsageError(f"--output-dir {output_dir!r} holds the outputs of {who} ({', '.join(done)}); a fresh run "
                         "would replace them: choose another --output-dir, or pass --overwrite-output-dir to replace "
                         "them")
    # --resume into a finished run: run_state.plan_resume (a no-op, refused, or continued from its final step)


def check_collisions(output_dir: str, checkpoints: list) -> None:
    """``--resume``: another run's checkpoint at a step after this run's latest would be in the way of a later save
    (never written over: ``save_checkpoint``); refuse now, not days into the run. Read-only, every rank."""
    prev = read_run(output_dir)
    run_id = prev["run_id"] if prev else "legacy"
    owners = [(s, p, run_of(p)) for s, p in checkpoints]
    mine = [s for s, _, o in owners if owned_by(o, run_id)]
    ahead = [(p, o) for s, p, o in owners if not owned_by(o, run_id) and s > max(mine, default=0)]
    if ahead:
        names = ", ".join(f"{os.path.basename(p)} ({'run ' + o if o else 'no run id'})" for p, o in ahead[:3])
        raise UsageError(f"--resume: {os.path.join(output_dir, 'checkpoints')} holds checkpoints of another run at "
                         f"steps this run (run {run_id}) will reach: {names}; they are never written over, so move "
                         "them out of the directory (or choose another --output-dir)")


def begin_run(output_dir: str, args, checkpoints: list, identity: dict | None = None,
              changes: dict | None = None) -> None:
    """Main process, after ``check_run``: when resuming keep the run id (and record this launch's identity, accepted
    changes in ``history``: ``run_flags``), else write a new ``run.json``."""
    prev = read_run(output_dir)
    if args.resume and prev is not None:
        if identity is not None:
            from .run_flags import updated_record
            atomic_write_json(os.path.join(output_dir, RUN_FILE), updated_record(prev, identity, changes or {}))
        return
    run_id = "legacy" if args.resume and checkpoints else uuid.uuid4().hex[:12]  # pre-run.json dirs are adopted
    rec = {"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "flags": fingerprint(args)}
    atomic_write_json(os.path.join(output_dir, RUN_FILE), rec if identity is None else {**rec, "identity": identity})


def atomic_write_json(path: str, obj) -> None:
    """Through the guarded writer's private temp file (``writes.atomic_json``): an OSError is the run's WriteError."""
    from .writes import atomic_json, guarded
    with guarded("run.json" if os.path.basename(path) == RUN_FILE else "a file of the run", path):
        atomic_json(path, obj)


# ------------------------------------------------------------------------------------------ lock
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _job_id() -> str:
    """Identity of this launch, equal on all its ranks of this host: the launcher's pid (torchrun / accelerate
    workers are its children) and rendezvous port; a process started without a launcher is its own job."""
    if "LOCAL_RANK" in os.environ:
        return f"{socket.gethostname()}:{os.getppid()}:{os.environ.get('MASTER_PORT', '')}"
    return f"{socket.gethostname()}:{os.getpid()}"


class RunLock:
    """``OUTPUT_DIR/run.lock`` held by the main process for the whole run."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.held = False

    def check(self) -> None:
        """Read-only (every rank): fail alike when another live run holds the directory."""
        try:
            with open(self.path) as f:
                other = json.load(f)
        except (OSError, ValueError):
            return
        if other.get("job") == _job_id() and other.get("pid") != os.getpid():
            return  # the main process of our own launch got there first
        if other.get("host") == socket.gethostname() and isinstance(other.get("pid"), int) and \
                _pid_alive(other["pid"]):
            raise UsageError(f"--output-dir {os.path.dirname(self.path)!r} is in use by another run (pid "
                             f"{other['pid']} on {other['host']}); wait for it, or choose another --output-dir")

    def acquire(self) -> "RunLock":
        import atexit
        atexit.register(self.release)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "job": _job_id(), "started": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    with open(self.path) as f:
                        other = json.load(f)
                except (OSError, ValueError):
                    other = {}
                same_host = other.get("host") == me["host"]
                if same_host and isinstance(other.get("pid"), int) and _pid_alive(other["pid"]):
                    raise UsageError(f"--output-dir {os.path.dirname(self.path)!r} is in use by another run (pid "
                                     f"{other['pid']} on {other['host']}); wait for it, or choose another --output-dir"
                                     ) from None
                if not same_host and other.get("host"):
                    raise UsageError(f"--output-dir {os.path.dirname(self.path)!r} is locked by a run on host "
                                     f"{other['host']} (pid {other.get('pid')}); if that run is dead, delete "
                                     f"{self.path}") from None
                warnings.warn(f"taking over the stale lock {self.path} of a dead run (pid {other.get('pid')})",
                              RuntimeWarning, stacklevel=2)
                os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise UsageError(f"cannot lock {self.path}")

    def release(self) -> None:
        if self.held:
            try:
                os.remove(self.path)
            except OSError:
                pass
            self.held = False


from easy_context.dispatch.ahead import signal_on_parent_death  # noqa: E402  (one copy, in the library)


def exit_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (the launcher) dies; exit now if it already has."""
    import signal
    if os.environ.get("LOCAL_RANK") is None:  # not started by a launcher
        return
    if signal_on_parent_death(signal.SIGTERM) and os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(143)


# ------------------------------------------------------------------------------------------ manifests
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt_dir: str) -> None:
    files = {}
    for root, _, names in os.walk(ckpt_dir):
        for n in names:
            if n in (MANIFEST, ".easy_context_tmp"):  # writes.MARK: the temp dir's own mark, removed when published
                continue
            p = os.path.join(root, n)
            size = os.path.getsize(p)
            files[os.path.relpath(p, ckpt_dir)] = {"size": size, **({"sha256": _sha256(p)} if size <= _HASH_LIMIT else {})}
    from .writes import atomic_json  # unguarded: the checkpoint's own agreement turns its OSError into 74 on every rank
    atomic_json(os.path.join(ckpt_dir, MANIFEST), {"files": files})


def verify_checkpoint(ckpt_dir: str) -> str | None:
    """None when the checkpoint matches its manifest, else what is wrong (which file)."""
    mpath = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(mpath) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        files = {}  # written by an older version: only train_state.json can be checked
    except (OSError, ValueError, KeyError):
        return f"{mpath} is unreadable"
    for rel, meta in files.items():
        p = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(p):
            return f"{p} is missing"
        if os.path.getsize(p) != meta["size"]:
            return f"{p} has {os.path.getsize(p)} bytes, {meta['size']} were written"
        if "sha256" in meta and _sha256(p) != meta["sha256"]:
            return f"{p} does not match its checksum"
    try:
        with open(os.path.join(ckpt_dir, "train_state.json")) as f:
            json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return f"{os.path.join(ckpt_dir, 'train_state.json')} is unreadable"
    return None


def run_of(ckpt_dir: str) -> str | None:
    try:
        with open(os.path.join(ckpt_dir, "train_state.json")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError):
        return None


def latest_good_checkpoint(checkpoints: list, run_id: str, warn=print) -> str | None:
    """Newest checkpoint of ``run_id`` (legacy ones without an id count as this run's) that verifies."""
    for step, path in reversed(checkpoints):
        owner = run_of(path)
        if owner is not None and run_id != "legacy" and owner != run_id:
            continue
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        warn(f"warning: checkpoint step {step} is damaged ({problem}); falling back to the previous one")
    return None


def owned_by(owner: str | None, run_id: str | None) -> bool:
    """Whether a checkpoint whose train_state.json names ``owner`` is this run's (older ones name none: only a run
    adopted as "legacy" owns those)."""
    return owner == run_id or owner is None and run_id in (None, "legacy")
