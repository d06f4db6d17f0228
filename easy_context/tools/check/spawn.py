"""Run the cases on gloo ranks (``rank.py`` is what each rank runs) and collect their results."""
from __future__ import annotations

import os
import queue
import time

from ..gloo import free_port, rank_context, stop_ranks
from .case import Case


def run_cases(cases: list[Case], world: int, timeout: float = 600.0, collective_timeout: float = 120.0) -> list[dict]:
    """Run every case on ``world`` gloo ranks started once (the imports are paid once per call).

    Returns, per case, ``{"info": rank 0's model/RoPE summary | None, "results": [sp-rank-0 payload per dp
    group], "error": (rank, traceback) | None}``.
    A rank that dies, or ranks still running at ``timeout``, fail every case they had not finished.
    """
    from .rank import rank_entry
    ctx = rank_context(["torch", "torch.distributed", "transformers", "easy_context.tools.check.rank"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_entry, args=(r, world, port, cases, results, collective_timeout, dict(os.environ)),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = [{"info": None, "results": [], "error": None} for _ in cases]
    done: set[int] = set()
    fatal = None
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world and fatal is None:
            try:
                rank, i, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if dead:
                    time.sleep(1.0)  # its last message may still be in flight
                    if results.empty():
                        fatal = (dead[0], f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                elif time.monotonic() > deadline:
                    fatal = (-1, f"ranks did not finish within {timeout:.0f}s (deadlock?)")
                continue
            if i is None:
                if status == "done":
                    done.add(rank)
                else:
                    fatal = (rank, payload)
            elif status == "info":
                out[i]["info"] = payload
            elif status == "error":
                if out[i]["error"] is None or rank < out[i]["error"][0]:
                    out[i]["error"] = (rank, payload)
            elif payload is not None:
                out[i]["results"].append(payload)
    finally:
        stop_ranks(procs)
    if fatal is not None:
        for o in out:
            if o["error"] is None and not o["results"]:
                o["error"] = fatal
    return out
