"""Resumable checkpoints, written atomically.

A checkpoint is ``OUTPUT_DIR/checkpoints/step-XXXXXXX``. Every rank writes its shards into
``.tmp-step-XXXXXXX``; after a barrier the main process renames it, so a ``step-*`` directory is
always complete and a kill mid-write leaves only a ``.tmp-*`` directory (removed at the next start)
next to the previous, intact checkpoint. Multi-node runs need the output dir on a shared file system.

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

_STEP = re.compile(r"^step-(\d+)$")


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
    root = ckpt_root(output_dir)
    if os.path.isdir(root):
        for n in os.listdir(root):
            if n.startswith(".tmp-"):
                shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_dir(final: str, is_main: bool = True, barrier=lambda: None):
    """Yield a temp dir next to ``final``; on clean exit, (barrier, then) rename it to ``final``.

    If the body raises or the process dies, ``final`` is untouched (a previous version stays valid).
    """
    parent, name = os.path.split(final.rstrip("/"))
    tmp = os.path.join(parent, f".tmp-{name}")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    yield tmp
    barrier()
    if is_main:
        old = None
        if os.path.exists(final):  # re-saving the same step: move the old one aside first
            old = os.path.join(parent, f".tmp-old-{name}")
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(parent)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    barrier()


def replace_dir_contents(src: str, dst: str, last: str | None = None) -> None:
    """Move every file of ``src`` into ``dst`` with atomic per-file renames, ``last`` moved last."""
    os.makedirs(dst, exist_ok=True)
    names = sorted(os.listdir(src), key=lambda n: n == last)
    for n in names:
        target = os.path.join(dst, n)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(os.path.join(src, n), target)
    os.rmdir(src)
    _fsync_dir(dst)


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int = 2, extra: dict | None = None,
                    run_id: str | None = None) -> str:
    """Save, then keep the newest ``keep`` checkpoints *of this run* (other runs' are never touched)."""
    from .run_dir import run_of, write_manifest
    final = os.path.join(ckpt_root(output_dir), f"step-{step:07d}")
    if accelerator.is_main_process:
        os.makedirs(ckpt_root(output_dir), exist_ok=True)
    with atomic_dir(final, accelerator.is_main_process, accelerator.wait_for_everyone) as tmp:
        accelerator.save_state(tmp)
        crash_point("checkpoint", step)  # fault injection for the tests: die mid-write
        accelerator.wait_for_everyone()  # every rank's shards are written before the manifest lists them
        if accelerator.is_main_process:
            with open(os.path.join(tmp, "train_state.json"), "w") as f:
                json.dump({"step": step, "run_id": run_id, **(extra or {})}, f)
            write_manifest(tmp)  # sizes + checksums, checked by --resume
    if accelerator.is_main_process and keep > 0:
        mine = [p for _, p in list_checkpoints(output_dir) if run_of(p) in (run_id, None)]
        for path in mine[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def crash_point(where: str, step: int) -> None:
    """Test hook: SIGKILL this process at ``where`` of ``step`` when EASY_CONTEXT_CRASH=where:step."""
    if os.environ.get("EASY_CONTEXT_CRASH") == f"{where}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def load_checkpoint(accelerator, path: str) -> dict:
    """Restore model/optimizer/scheduler/RNG from ``path``; returns train_state.json (``step``, ``data``)."""
    accelerator.load_state(path)
    with open(os.path.join(path, "train_state.json")) as f:
        return json.load(f)
