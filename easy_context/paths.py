"""Output paths every CLI checks before heavy work (train.py, prepare_data.py, the evals): fail with the flag's
name while nothing is lost yet. No heavy imports."""
from __future__ import annotations

import os

from .errors import UsageError


def check_writable_dir(path: str, flag: str = "--output-dir") -> None:
    """``path`` is (or can be created as) a writable directory; else a UsageError naming the flag."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a file, not a directory; pass a directory path")
    probe_dir = path
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(os.path.abspath(probe_dir))
    if not os.path.isdir(probe_dir) or not os.access(probe_dir, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path!r} is not writable ({probe_dir!r} does not allow creating files); "
                         "choose a directory you can write to")


def check_writable_file(path: str, flag: str) -> None:
    """An output file path whose directory exists or can be created, and that is not a directory."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory; pass a file path")
    check_writable_dir(os.path.dirname(os.path.abspath(path)), flag + " (its directory)")


# ------------------------------------------------------------------------------------------ identity


__all__ = ["check_writable_dir", "check_writable_file"]
