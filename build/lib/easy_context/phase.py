"""Which collective this process is in, for the fault watchdog (``easy_context_train/watchdog.py``).

``with phase("ring step"):`` around a blocking communication call records its name and counts an event on
entry and exit. The watchdog reads two things: the last phase entered (named in its report: "ring step",
"all-to-all", "loss all-reduce", "checkpoint", ...) and whether the event count moved in the last
``--collective-timeout`` seconds (no progress = a peer is stopped, hung or dead). It costs two attribute writes
and a clock read per call, nothing when no watchdog runs. Per-process state, not a process group.
"""
from __future__ import annotations

import contextlib
import time


class Tracker:
    def __init__(self):
        self.current: str | None = None  # the phase the main thread is in now (None: between phases)
        self.last: str | None = None     # the last phase entered (named when the process is stuck after it)
        self.step = 0                    # the optimizer step being run (set by train.py's fault guard)
        self.events = 0                  # entries + exits: the watchdog's progress counter
        self.changed = time.monotonic()
        self.failed: str | None = None   # the phase an exception last left (a failed collective)


TRACKER = Tracker()


def tick(*_) -> None:
    """Progress without a collective (a forward hook on every decoder layer): long compute between collectives
    (data_parallel's forward + backward, a layer's MLP) is not mistaken for a hang."""
    TRACKER.changed = time.monotonic()


@contextlib.contextmanager
def phase(name: str):
    t = TRACKER
    outer, t.current, t.last = t.current, name, name
    t.events += 1
    t.changed = time.monotonic()
    try:
        yield
    except BaseException:
        t.failed = name
        raise
    finally:
        t.current = outer
        t.events += 1
        t.changed = time.monotonic()
