"""Start-up watchdog for the JIT build of DeepSpeed's ops (CPU Adam, the shm comm op, ...).

torch builds JIT extensions under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/<py>_<cpu|cuXXX>``)
holding ``<op>/lock`` (``torch.utils.file_baton.FileBaton``: created with O_EXCL, kept open by the builder, removed
when the build ends). A process killed mid-build leaves the file behind, and every later load of that op (every
launch: the lock is taken even to load a cached build) waits for it to disappear, silently, forever.

``watch_op_builds`` starts a daemon thread for the start-up (``stop``: when the training loop begins): when the main
thread waits on such a lock (``FileBaton.wait``) that is older than ``stale_after`` seconds and that no process of
this host holds open, the lock is named in one line with the fix, and the process exits ``EXIT_STALE_BUILD_LOCK``. A
lock a live build holds (here: an open descriptor; on another host sharing the directory: younger than
``stale_after``) is waited for, as torch does; a stale lock of an op this run does not load is left alone.
"""
from __future__ import annotations

import glob
import os
import threading
import time

EXIT_STALE_BUILD_LOCK = 5
_watch: list = []


def holders(path: str) -> list[int]:
    """Pids of this host's processes with ``path`` open (from /proc/*/fd; what this user may read)."""
    real, found = os.path.realpath(path), []
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            for fd in os.listdir(fd_dir):
                if os.readlink(os.path.join(fd_dir, fd)) == real:
                    found.append(int(fd_dir.split("/")[2]))
                    break
        except OSError:  # the process ended, or is not ours to read
            continue
    return found


def stale_age(path: str, stale_after: float) -> float | None:
    """The age of lock ``path`` when it is older than ``stale_after`` and no process of this host holds it, else None."""
    try:
        age = time.time() - os.path.getmtime(path)
    except OSError:
        return None
    return age if age > stale_after and not holders(path) else None


def waited_lock(thread_id: int | None) -> str | None:
    """The lock file a thread is waiting for in ``torch.utils.file_baton.FileBaton.wait`` (None: it is not)."""
    import sys
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("file_baton.py"):
            return getattr(frame.f_locals.get("self"), "lock_file_path", None)
        frame = frame.f_back
    return None


def message(locks: list[tuple[str, float]], stale_after: float) -> str:
    paths = " ".join(p for p, _ in locks)
    age = max(a for _, a in locks)
    return (f"the JIT build of DeepSpeed's ops waits for the lock {paths}, left {_ago(age)} ago by a build that no "
            f"process holds any more (a run killed while compiling); every launch would wait for it forever. Remove "
            f"it: rm {paths}, then rerun (an unfinished build is redone; --build-lock-timeout {stale_after:g}s set "
            "this limit)")


def _ago(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 else \
        f"{seconds:.0f} s"


class BuildLockWatch:
    def __init__(self, stale_after: float, prog: str = "train.py", interval: float | None = None):
        self.stale_after, self.prog = stale_after, prog
        self.interval = interval or min(10.0, max(0.2, stale_after / 10))
        self.main = threading.main_thread().ident
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="easy_context-build-lock-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            path = waited_lock(self.main)
            if path is None:
                continue
            age = stale_age(path, self.stale_after)
            if age is not None and not self._stop.is_set():
                self.fire([(path, age)])

    def fire(self, locks) -> None:
        from .leave import _leave
        # one line per host (its cache): the first of its ranks to get here prints, every rank exits (the launcher
        # may stop the others first)
        line = message(locks, self.stale_after) if first_reporter() else None
        _leave(None, "stale build lock", line, EXIT_STALE_BUILD_LOCK)

    def stop(self) -> None:
        self._stop.set()


def first_reporter() -> bool:
    """Whether this rank is the first of its host to report (``errors.first_to_report``, one key per host: the lock
    is in that host's cache)."""
    import socket

    from easy_context.errors import first_to_report
    return first_to_report(f"build-lock/{socket.gethostname()}")


def watch_op_builds(stale_after: float, prog: str = "train.py", interval: float | None = None) -> BuildLockWatch:
    """Start the watch (once per process); ``stop()`` ends it."""
    if not _watch:
        _watch.append(BuildLockWatch(stale_after, prog, interval))
    return _watch[0]


def stop() -> None:
    for w in _watch:
        w.stop()
    _watch.clear()


__all__ = ["EXIT_STALE_BUILD_LOCK", "watch_op_builds", "stop", "stale_age", "holders", "waited_lock"]
