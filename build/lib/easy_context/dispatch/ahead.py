"""Dispatch tables planned ahead in a helper process: while a step runs, one spawned process plans the next batches'
packed-row tables (dispatch/plan.py) with the very planner ``prepare_seq_parallel_inputs`` would run
(``mode.dispatch_of``: same code, same inputs, so every rank still derives the same table without a collective).
``HelperPlanner`` is what train.py's read-ahead (easy_context_train/plan_ahead.py) and the Trainer integration
(integrations/trainer.py) use; a helper that cannot start or dies falls back to planning in this process.
"""
from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor


def signal_on_parent_death(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG); False where unsupported."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)
    except (OSError, AttributeError):
        return False
    return True


def _helper_init() -> None:
    """In the helper: die with the rank that started it (Linux PR_SET_PDEATHSIG; a killed rank must not leave an
    orphan holding its log pipes open), and write nothing to the rank's stdout/stderr (errors come back through the
    future)."""
    import os
    import signal

    signal_on_parent_death(signal.SIGKILL)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def plan_table(mode_name: str, sp: int, layout_kw: dict, positions):
    """The dispatch table ``prepare_seq_parallel_inputs`` would plan for these global (B, L) positions (or None)."""
    from ..registry import get_mode
    return get_mode(mode_name).dispatch_of(sp, positions=positions, dispatch="auto", **layout_kw)


class HelperPlanner:
    """Dispatch tables of a layout planned in one spawned helper process: ``submit(pos)`` starts one (None when there
    is nothing to plan: rows without restarts, a layout that never dispatches, or no helper could start, in which case
    ``prepare_inputs`` plans it itself), ``result(job, pos)`` waits for it (planned here if the helper died)."""

    def __init__(self, layout):
        self.args = (layout.mode.name, layout.sp, dict(layout.layout_kw))
        self.on = layout.sp > 1 and layout.mode.dispatches and bool(layout.packed_dispatch)
        self._pool = None
        self.planned_here = 0           # tables this process had to plan itself (first step, or a lost helper)

    def wants(self, pos) -> bool:
        return self.on and _packed(pos)

    def plan_here(self, pos):
        self.planned_here += 1
        return plan_table(*self.args, pos)

    def submit(self, pos):
        if not self.wants(pos):
            return None
        try:
            if self._pool is None:  # spawn: a fork would copy the training process's threads and CUDA state
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                                                 initializer=_helper_init)
            return self._pool.submit(plan_table, *self.args, pos.cpu())
        except Exception:  # no helper process here (a sandbox, a broken pool): plan when it is needed
            self.close()
            return None

    def result(self, job, pos):
        if not hasattr(job, "result"):
            return job  # a table planned here, None when there is nothing to plan, or a failed submit
        try:
            return job.result()
        except Exception:  # a helper that died (memory, a signal): plan here, as prepare_seq_parallel_inputs would
            self.close()
            return self.plan_here(pos)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _packed(pos) -> bool:
    from ..sharding import packed_rows
    return packed_rows(pos)


__all__ = ["HelperPlanner", "plan_table", "signal_on_parent_death"]
