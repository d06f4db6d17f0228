"""The next step's packed-row dispatch planned in a helper process while this step runs (issue #28).

Planning the cost-balanced dispatch of a packed row (dispatch/plan.py) is pure CPU work: ~0.2 s at 128K, ~0.3 s at 512K
on one core, on every rank, for every new batch, and inside ``prepare_seq_parallel_inputs`` it sits on the step's
critical path. ``PlannedBatches`` reads one optimizer step (``ahead`` micro-batches) ahead of the loop, hands their
global position ids to one spawned process that runs the very planner ``prepare_seq_parallel_inputs`` would
(``mode.dispatch_of``: same code, same inputs, so every rank still derives the same table without a collective),
and yields each micro-batch with its table, which ``prepare_inputs(..., dispatch=table)`` uses as given. The
attention still checks the table against the positions it gathers (fingerprint + digest), so a wrong table is an
error, never wrong gradients.

Reading ahead must not move the data position a checkpoint records: ``state_dict()`` is the loader's state right
after the last micro-batch *handed out*, snapshotted before the read-ahead, so a resumed run starts at the first
batch this run did not train on, as without planning ahead. Rows without restarts (nothing to plan) or modes that
never dispatch start no process; a helper that dies falls back to planning in this process. The helper
(``HelperPlanner``) is library code in easy_context/dispatch/ahead.py (the Trainer integration uses it too).
"""
from __future__ import annotations

import copy
from collections import deque

from easy_context.dispatch.ahead import HelperPlanner, plan_table  # noqa: F401 (library code, re-exported)
from .packed_data import batch_targets


class PlannedBatches:
    """Iterate ``(input_ids, position_ids, targets, dispatch)`` of ``loader``'s batches (``batch_targets``), each
    with its dispatch table planned ``ahead`` micro-batches early in a helper process (None when the rows are not
    packed or the layout never dispatches). ``state_dict()`` replaces ``loader.state_dict()`` for checkpoints."""

    def __init__(self, batches, loader, layout, ahead: int):
        self._it, self._loader = iter(batches), loader
        self._planner = HelperPlanner(layout)
        self._ahead = max(1, int(ahead))
        self._queue: deque = deque()   # (inputs, positions, targets, future or table, loader state after it)
        self._state = copy.deepcopy(loader.state_dict())

    @property
    def planned_here(self) -> int:
        return self._planner.planned_here

    def __iter__(self):
        return self

    def __next__(self):
        if not self._queue:
            self._read(first=True)       # the first step's tables are needed now: planned here
        if not self._queue:
            raise StopIteration
        inp, pos, tgt, job, state = self._queue.popleft()
        self._read()                      # keep `ahead` micro-batches in flight behind this one
        self._state = state
        return inp, pos, tgt, self._planner.result(job, pos)

    def state_dict(self) -> dict:
        """The loader's position after the last micro-batch handed out (not the ones read ahead)."""
        return copy.deepcopy(self._state)

    def close(self) -> None:
        self._planner.close()

    def _read(self, first: bool = False) -> None:
        while len(self._queue) < self._ahead:
            batch = next(self._it, None)
            if batch is None:
                return
            inp, pos, tgt = batch_targets(batch)
            state = self._loader.state_dict()  # a fresh dict each call (data.py, dp_balance.py)
            if first:
                job = self._planner.plan_here(pos) if self._planner.wants(pos) else None
            else:
                job = self._planner.submit(pos)
            self._queue.append((inp, pos, tgt, job, state))


__all__ = ["PlannedBatches", "HelperPlanner", "plan_table"]
