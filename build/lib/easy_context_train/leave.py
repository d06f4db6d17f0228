"""How a train.py rank leaves on a fault: one line, the peers told why, the run lock released, the exit status,
and no interpreter teardown (where gloo aborts when a peer is gone). Shared by faults.py and op_build.py."""
from __future__ import annotations

import atexit
import os
import sys

PROG = "train.py"


def _leave(dog, reason: str, line: str | None, code: int) -> None:
    """Print ``line`` (if any), tell the peers why, release the run lock, exit ``code`` without gloo's abort."""
    if dog is not None:
        dog.record_exit(reason)
        dog.close()
    if line:
        print(f"{PROG}: error: {' '.join(line.split())}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
        atexit._run_exitfuncs()  # the output dir's lock, trackers; then skip the interpreter's teardown, where
    finally:                     # gloo aborts when a peer is gone
        os._exit(code)
