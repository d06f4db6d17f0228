"""Output paths every CLI checks before heavy work (train.py, prepare_data.py, the evals): fail with the flag's
name while nothing is lost yet. No heavy imports."""
from __future__ import annotations

import os

from .errors import UsageError


def check_writable_dir(path: str, flag: str = "--output-dir") -> None:
    """``path`` is (or can be created as) a writable directory; else a UsageError naming the flag. Tried, not
    inferred from permission bits: a file is created (and removed) in ``path`` or its nearest existing parent, so
    read-only and pseudo file systems (/proc, /sys) and root's view of them are caught too."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a file, not a directory; pass a directory path")
    probe_dir = path
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(os.path.abspath(probe_dir))
    why = "it is not a directory" if not os.path.isdir(probe_dir) else _cannot_create(probe_dir)
    if why:
        raise UsageError(f"{flag} {path!r} is not writable ({probe_dir!r} does not allow creating files: {why}); "
                         "choose a directory you can write to")


def _cannot_create(directory: str) -> str | None:
    """None when a file can be created in ``directory`` (a probe, removed at once), else the OS's reason."""
    import tempfile
    try:
        fd, probe = tempfile.mkstemp(prefix=".easy_context-probe-", dir=directory)
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    os.remove(probe)
    return None


def check_writable_file(path: str, flag: str) -> None:
    """An output file path whose directory exists or can be created, that is not a directory, and that (if it
    exists) can be opened for appending (nothing is written)."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory; pass a file path")
    if os.path.exists(path):
        try:
            open(path, "a").close()
        except OSError as e:
            raise UsageError(f"{flag} {path!r} is not writable ({e.strerror}); choose another path") from None
    check_writable_dir(os.path.dirname(os.path.abspath(path)), flag + " (its directory)")


# ------------------------------------------------------------------------------------------ identity


__all__ = ["check_writable_dir", "check_writable_file"]
