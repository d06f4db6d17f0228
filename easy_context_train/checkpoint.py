"""Resumable checkpoints, written atomically.

A checkpoint is ``OUTPUT_DIR/checkpoints/step-XXXXXXX``. Every rank writes its shards into a private temp
directory the main process made (``.tmp-step-XXXXXXX-*``, ``writes.private_dir``); after a barrier the main process
renames it, so a ``step-*`` directory is always complete and a kill mid-write leaves only a marked temp directory
(removed at the next start; a user's directory of a similar name is never touched) next to the previous, intact
checkpoint. Multi-node runs need the output dir on a shared file system.
A write that fails on any rank (disk full, quota, read-only) is agreed on by every rank: the temp dir is
removed, the previous checkpoint stays the latest, and ``CheckpointWriteError`` says which path, how much space
and what to do (train.py exits 74).

Contents: ``accelerator.save_state`` (model, optimizer, LR scheduler — inside the DeepSpeed engine
checkpoint under DeepSpeed — and every rank's Python/NumPy/torch RNG) plus ``train_state.json``
(optimizer step and the data loader's position).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal

from .run_dir import owned_by
from .writes import MARK, WriteError, is_private, private_dir, remove_stale_dirs
from .writes import agree_failed as _agree_failed
from .writes import size_text as _size
from .writes import space as _space

_STEP = re.compile(r"^step-(\d+)$")
_LEGACY_TMP = re.compile(r"^\.tmp-(old-)?step-\d{7}$")


def ckpt_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    root = ckpt_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := _STEP.match(n))]
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1][1] if ckpts else None


def remove_stale_temps(output_dir: str) -> None:
    """Temp directories of a killed run (checkpoints and the final model): only the ones this package made."""
    root = ckpt_root(output_dir)
    remove_stale_dirs(root, ".tmp-")
    remove_stale_dirs(output_dir, FINAL_PREFIX)
    for n in os.listdir(root) if os.path.isdir(root) else ():  # what versions before the private dirs left
        if _LEGACY_TMP.match(n):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir_contents(src: str, dst: str, last: str | None = None) -> None:
    """Move every file of ``src`` into ``dst`` with atomic per-file renames, ``last`` moved last."""
    os.makedirs(dst, exist_ok=True)
    names = sorted((n for n in os.listdir(src) if n != MARK), key=lambda n: n == last)
    for n in names:
        target = os.path.join(dst, n)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(os.path.join(src, n), target)
    shutil.rmtree(src)
    _fsync_dir(dst)


class CheckpointWriteError(WriteError):
    """A checkpoint could not be written (disk full, quota, read-only, permissions); the previous one is intact.
    ``local``: this rank's own write failed (it prints the reason); otherwise a peer's did."""


def _write_error(e: Exception, final: str, output_dir: str) -> str:
    """Which path, how much space, what to do."""
    target = getattr(e, "filename", None) or final
    why, space, fix = _space(e, ckpt_root(output_dir))
    prev = latest_checkpoint(output_dir)
    need = ""
    if prev:
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(prev) for f in fs)
        need = f", the last checkpoint took {_size(size)}"
    fix = fix + ", or lower --keep-checkpoints" if fix.startswith("Free") else fix
    kept = f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint exists"
    return (f"cannot write checkpoint {final}: {why} ({target}; {space}{need}); nothing was kept of it and "
            f"{kept}. {fix}, then rerun with --resume")


FINAL_PREFIX = ".final-tmp-"  # OUTPUT/.final-tmp-XXXXXXXX/ (mkdtemp): the final model until it is complete


class FinalSaveError(CheckpointWriteError):
    """The final model could not be written (train.py exits 74 too); nothing of it is left in the output dir."""


def write_final(accelerator, output_dir: str, write, last: str, need: int = 0) -> None:
    """The final model: ``write(tmp)`` on the main process into a private ``OUTPUT/.final-tmp-*`` (``mkdtemp``: never a
    directory of the user's), whose files are then moved into
    ``output_dir`` (``last`` last). Call it on every rank after the collectives that gather the weights: a write that
    fails (disk full, quota, read-only) is agreed on by one all-reduce, the temp dir is removed, and every rank raises
    ``FinalSaveError`` (the main process's says which path, the space, the last checkpoint and what to do)."""
    import torch.distributed as dist

    from easy_context.phase import TRACKER, phase
    tmp = os.path.join(output_dir, FINAL_PREFIX + "*")
    err = None
    if accelerator.is_main_process:
        try:
            tmp = private_dir(output_dir, FINAL_PREFIX)
            write(tmp)
            if injected("disk_full", "final"):  # fault injection for the tests: the disk fills mid-save
                import errno
                part = os.path.join(tmp, "model.safetensors")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), part)
            replace_dir_contents(tmp, output_dir, last=last)
        except dist.DistError:
            raise
        except Exception as e:  # noqa: BLE001 - OSError, torch's RuntimeError, safetensors' SafetensorError, a bug
            err = e
            if os.path.isdir(tmp) and is_private(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    with phase("final save"):
        failed = _agree_failed(accelerator, err is not None)  # every rank learns it: none waits at a barrier
    if not failed:
        return
    if err is not None and not isinstance(err, (OSError, RuntimeError)) and type(err).__name__ != "SafetensorError":
        raise err  # a bug, not a failed write: the main process keeps its traceback, the others exit 74 quietly
    if err is None:
        raise FinalSaveError("the main process could not write the final model", False)
    why, space, fix = _space(err, output_dir)
    prev, step = latest_checkpoint(output_dir), TRACKER.step
    model = f", the model takes {_size(need)}" if need else ""
    fix = fix[0].lower() + fix[1:]
    again = "no step is trained again" if prev and prev.endswith(f"step-{step:07d}") else \
        "the steps after it are trained again"
    then = (f"the last checkpoint {prev} is intact: {fix}, then rerun with --resume ({again})" if prev else f"no checkpoint exists: {fix}, then rerun with --overwrite-output-dir "
            "(--checkpoint-every N keeps one)")
    raise FinalSaveError(f"cannot write the final model to {output_dir} after step {step}: {why} "
                         f"({getattr(err, 'filename', None) or tmp}; {space}{model}); nothing of it was kept and "
                         f"{then}", True)


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int = 2, extra: dict | None = None,
                    run_id: str | None = None) -> str:
    """Save, then keep the newest ``keep`` checkpoints *of this run* (other runs' are never touched).

    Written into a private ``.tmp-step-*`` directory and renamed when every rank's part is on disk. A write that fails
    on any rank (disk full, quota, read-only) is agreed on by all ranks: the temp dir is removed, the previous
    checkpoint stays the latest, and every rank raises ``CheckpointWriteError``."""
    from easy_context.phase import phase
    from .run_dir import run_of, write_manifest
    from .writes import shared_path
    final = os.path.join(ckpt_root(output_dir), f"step-{step:07d}")
    parent, name = os.path.split(final)
    main = accelerator.is_main_process
    box = [None]  # the temp dir (made by the main process, its name shared with every rank)

    def attempt(fn) -> None:
        import torch.distributed as dist
        err = None
        try:
            fn()
        except dist.DistError:
            raise  # a peer is gone: not a write error (the fault guard names it)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            err = e
        with phase("checkpoint"):
            failed = _agree_failed(accelerator, err is not None)
        if failed:
            if main and box[0] and is_private(box[0]):
                shutil.rmtree(box[0], ignore_errors=True)
            raise CheckpointWriteError(_write_error(err, final, output_dir) if err else
                                       "another rank could not write its part of the checkpoint", err is not None)

    def start():
        if main:
            box[0] = private_dir(parent, f".tmp-{name}-")

    def shards():
        tmp = box[0]
        accelerator.save_state(tmp)
        if injected("disk_full", step):  # fault injection for the tests: the disk fills mid-write
            import errno
            with open(os.path.join(tmp, "partial.bin"), "wb") as f:
                f.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(tmp, "partial.bin"))
        crash_point("checkpoint", step)  # fault injection for the tests: die mid-write

    def state():
        if main:  # after every rank's shards are written (the agreement above), so the manifest lists them all
            with open(os.path.join(box[0], "train_state.json"), "w") as f:
                json.dump({"step": step, "run_id": run_id, **(extra or {})}, f)
            write_manifest(box[0])  # sizes + checksums, checked by --resume (the temp mark is not listed)

    def publish():
        if main:
            _publish(box[0], final, parent, name)

    owner = run_of(final) if os.path.isdir(final) else None
    if os.path.isdir(final) and not owned_by(owner, run_id):  # every rank sees it: all raise, before any collective
        raise CheckpointWriteError(
            f"cannot write checkpoint {final}: that step's checkpoint belongs to "
            f"{'run ' + owner if owner else 'an earlier run (no run id)'}, not to this run ({run_id}); it was not "
            f"replaced. Move it out of {parent}, then rerun with --resume", main)
    with phase("checkpoint"):
        attempt(start)
        box[0] = shared_path(box[0])
        attempt(shards)
        attempt(state)
        attempt(publish)  # a read-only remount shows here too: the same agreed 74
    if main and keep > 0:
        mine = [p for _, p in list_checkpoints(output_dir) if run_of(p) in (run_id, None)]
        for path in mine[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def injected(where: str, step: int) -> bool:
    """Test hook: EASY_CONTEXT_CRASH is ``where:step`` or ``where:step:rank`` (that global rank only)."""
    spec = os.environ.get("EASY_CONTEXT_CRASH", "").split(":")
    return spec[:2] == [where, str(step)] and (len(spec) < 3 or spec[2] == os.environ.get("RANK", "0"))


def crash_point(where: str, step: int) -> None:
    """Test hook: SIGKILL this process at ``where`` of ``step`` when EASY_CONTEXT_CRASH=where:step[:rank]."""
    if injected(where, step):
        os.kill(os.getpid(), signal.SIGKILL)


def load_checkpoint(accelerator, path: str) -> dict:
    """Restore model/optimizer/scheduler/RNG from ``path``; returns train_state.json (``step``, ``data``)."""
    from easy_context.phase import TRACKER
    accelerator.load_state(path)
    resync_cpu_adam(accelerator)  # DeepSpeed's CPU Adam: the same bias-correction bits as an unbroken run
    with open(os.path.join(path, "train_state.json")) as f:
        state = json.load(f)
    TRACKER.step = state["step"]  # the fault reports count steps from here
    return state


def resync_cpu_adam(accelerator) -> int:
    """Make DeepSpeed's CPU Adam continue bit for bit after a resume; returns the step replayed (0: nothing to do).

    Its C++ optimizer keeps beta1^t and beta2^t as float32 running products (one multiply per step,
    ``Adam_Optimizer::IncrementStep``); a fresh optimizer whose first step is t+1 computes ``pow(beta, t+1)`` instead,
    which differs in the last bit for some t (e.g. 10 with betas 0.9 / 0.95), so the bias corrections, then the
    weights and from a step or two later the loss, drifted (~1e-7) from an unbroken run. Replaying steps 1..t on a
    one-element dummy (the same C++ optimizer, ``adam_update``) rebuilds exactly the products an unbroken run holds."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return 0
    import torch
    done = 0
    for opt in getattr(accelerator, "_optimizers", []):
        for _ in range(4):  # AcceleratedOptimizer -> ZeRO optimizer -> CPU Adam
            if isinstance(opt, DeepSpeedCPUAdam) or opt is None:
                break
            opt = getattr(opt, "optimizer", None)
        if not isinstance(opt, DeepSpeedCPUAdam):
            continue
        steps = [int(st["step"]) for st in opt.state.values() if "step" in st]
        betas = {tuple(g["betas"]) for g in opt.param_groups}
        if not steps or len(betas) != 1:
            continue
        (beta1, beta2), g = betas.pop(), opt.param_groups[0]
        dummy = [torch.zeros(1) for _ in range(4)]  # params, grads, exp_avg, exp_avg_sq
        for t in range(1, max(steps) + 1):
            opt.ds_opt_adam.adam_update(opt.opt_id, t, g["lr"], beta1, beta2, g["eps"], g["weight_decay"],
                                        g["bias_correction"], *dummy)
        done = max(steps)
    return done


def _publish(tmp: str, final: str, parent: str, name: str) -> None:
    """The finished temp directory becomes ``final`` in one rename (an old one of the same step moved aside first, into
    a private directory)."""
    old = None
    if os.path.exists(final):  # re-saving the same step: move the old one aside first
        old = private_dir(parent, f".tmp-old-{name}-")
        os.replace(final, os.path.join(old, name))
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(tmp, MARK))  # the mark goes last: until here a kill leaves a temp dir the next start removes
    os.replace(tmp, final)
    _fsync_dir(parent)
    if old:
        shutil.rmtree(old, ignore_errors=True)
