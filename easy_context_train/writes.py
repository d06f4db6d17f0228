"""The one guarded writer of a run: every file train.py writes (metrics, run.json, the lock, checkpoints, the final
model) goes through here, so a failed write anywhere (disk full, quota, read-only remount, permissions) is the same
fault: ``WriteError``, exit 74, one line naming the path, the OS's reason, the free space and what to do.

* ``guarded(what, path)``: an ``OSError`` inside becomes a ``WriteError`` (local: this rank's own write failed).
* ``agree(accelerator, err)``: one all-reduce so every rank learns that some rank's write failed and all raise
  (the failing rank its line, the others quietly), none waits at a barrier for a rank that left.
* ``atomic_text`` / ``atomic_json``: write into a private temp file next to the target (``mkstemp``), then rename.
* ``private_dir(parent, prefix)``: a new temp directory (``mkdtemp``) marked as this package's, never a fixed name
  a user could own; ``remove_stale_dirs`` removes only marked ones (the caller holds the run lock).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile

WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EIO)
MARK = ".easy_context_tmp"  # inside every private temp directory this package makes (and only those are removed)


class WriteError(Exception):
    """A file of the run could not be written; ``local``: this rank's own write failed (it prints the reason)."""
    code = 74  # EX_IOERR

    def __init__(self, msg: str, local: bool = True):
        super().__init__(msg)
        self.local = local


def size_text(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def space(e: Exception, where: str) -> tuple[str, str, str]:
    """(the OS's reason, free space at ``where``, what to do) for a failed write."""
    try:
        du = shutil.disk_usage(where)
        free = f"{size_text(du.free)} free of {size_text(du.total)} there"
    except OSError:
        free = "free space unknown"
    why = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [type(e).__name__])[0]
    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e):
        fix = "Free space (or raise the quota)"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "Make the directory writable (a read-only remount: check the file system)"
    elif code == errno.EFBIG:
        fix = "Raise the file-size limit (ulimit -f) or use another file system"
    else:
        fix = "Check the file system"
    return why, free, fix


def _existing(path: str) -> str:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path or "."


def write_error(e: Exception, what: str, path: str, then: str = "then rerun with --resume") -> WriteError:
    why, free, fix = space(e, _existing(os.path.dirname(os.path.abspath(path))))
    target = getattr(e, "filename", None) or path
    return WriteError(f"cannot write {what} {path}: {why} ({target}; {free}); {fix[0].lower() + fix[1:]}, {then}")


@contextlib.contextmanager
def guarded(what: str, path: str, then: str = "then rerun with --resume"):
    """An OSError inside is this rank's ``WriteError`` about ``what`` at ``path``."""
    try:
        yield
    except OSError as e:
        raise write_error(e, what, path, then) from None


def agree_failed(accelerator, failed: bool) -> bool:
    """Whether any rank failed (one all-reduce), so every rank takes the same branch and none waits forever."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([float(failed)], device=getattr(accelerator, "device", "cpu"))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def agree(accelerator, err: BaseException | None) -> None:
    """Every rank calls it at the same point: if any rank's ``err`` is set, every rank raises (``err`` itself where
    it happened, a quiet ``WriteError`` elsewhere). One all-reduce when there are several processes."""
    if agree_failed(accelerator, err is not None):
        raise err if err is not None else WriteError("another rank could not write its file", local=False)


def atomic_text(path: str, text: str) -> None:
    """``text`` into ``path`` through a private temp file next to it (same file system: the rename is atomic)."""
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_json(path: str, obj) -> None:
    import json
    atomic_text(path, json.dumps(obj, indent=1))


def private_dir(parent: str, prefix: str) -> str:
    """A new directory in ``parent`` (``mkdtemp``: a name no one else holds) with this package's mark inside."""
    os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    with open(os.path.join(path, MARK), "w") as f:
        f.write(f"{os.getpid()}\n")
    return path


def shared_path(path: str | None) -> str:
    """The main process's ``path`` on every rank (a name made by ``private_dir`` there): one broadcast."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return path
    box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_private(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARK))


def remove_stale_dirs(parent: str, prefix: str) -> None:
    """Private temp dirs of a killed run (``prefix`` + this package's mark); a user's directory of the same prefix
    without the mark is left alone. The caller holds the output dir's run lock (no live run writes there)."""
    if not os.path.isdir(parent):
        return
    for n in os.listdir(parent):
        p = os.path.join(parent, n)
        if n.startswith(prefix) and os.path.isdir(p) and is_private(p):
            shutil.rmtree(p, ignore_errors=True)


__all__ = ["WriteError", "guarded", "agree", "write_error", "space", "size_text", "atomic_text", "atomic_json",
           "private_dir", "is_private", "remove_stale_dirs", "MARK", "agree_failed", "shared_path"]
