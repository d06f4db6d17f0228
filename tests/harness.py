"""Run a function on N CPU ranks (gloo) from an ordinary pytest test.

    from tests.harness import run_ranks
    def _body(rank, world_size, n):          # module level, so a rank can import it
        ...assertions...
    def test_x():
        run_ranks(_body, world_size=4, args=(3,))

Each rank is a fresh process with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set and a gloo process
group (short collective timeout). A rank's exception comes back with its rank number and traceback;
the first failure or the overall ``timeout`` kills every rank, so a deadlock fails in ~2 minutes
instead of hanging CI.

Ranks are forked from one forkserver per pytest session that has imported torch, transformers' model
code and easy_context once (``_PRELOAD``): a spawned rank paid those imports (and pytest's, as the
re-imported main module) every time, 6.4 s of a trivial 2-rank call on 2 cores against 3.0 s forked
(2026-12-06). Nothing else is shared: the parent's state (monkeypatched attributes, registrations) is not
seen, as with spawn, and the parent's current environment is handed to every rank explicitly (a forked
rank would otherwise see the server's, from when it started). Put many cases in one body all the same.
"""
from __future__ import annotations

import os
import queue
import time
import traceback

from easy_context.tools.gloo import free_port, rank_context, stop_ranks


# imported once in the forkserver, before it forks any rank: what nearly every body imports
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_utils",
            "transformers.models.llama.modeling_llama", "easy_context", "easy_context.tools.gloo", "tests.harness"]


def _entry(fn, rank, world_size, port, args, kwargs, results, collective_timeout, env):
    from easy_context.tools.gloo import gloo_process
    reported = False
    try:
        with gloo_process(rank, world_size, port, collective_timeout, env):
            try:  # report before the group is torn down: peers may be blocked in a collective
                fn(rank, world_size, *args, **kwargs)
                results.put((rank, None))
            except BaseException:  # report everything, including assertion failures
                results.put((rank, traceback.format_exc()))
            reported = True
    except BaseException:  # the group itself failed to start
        if not reported:
            results.put((rank, traceback.format_exc()))


def run_ranks(fn, world_size: int, args: tuple = (), kwargs: dict | None = None,
              timeout: float = 120.0, collective_timeout: float = 60.0) -> None:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; raise on any failure."""
    ctx = rank_context(_PRELOAD)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True, args=(fn, r, world_size, port, args, kwargs or {}, results,
                                                           collective_timeout, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    errors: dict[int, str] = {}
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, err = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and not errors:
                    # a rank died without reporting (segfault, os._exit): give the queue a moment
                    time.sleep(1.0)
                    if results.empty():
                        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                        errors.update({i: f"rank {i} died with exit code {procs[i].exitcode}" for i in dead})
                        break
                continue
            done.add(rank)
            if err is not None:
                errors[rank] = err
                # other ranks are likely blocked in a collective with the failed one: collect what
                # arrives in a short grace period, then stop everyone.
                grace = time.monotonic() + 3.0
                while time.monotonic() < grace and len(done) < world_size:
                    try:
                        r2, e2 = results.get(timeout=0.2)
                        done.add(r2)
                        if e2 is not None:
                            errors[r2] = e2
                    except queue.Empty:
                        pass
                break
    finally:
        stop_ranks(procs)
    if errors:
        msg = "\n".join(f"--- rank {r} of {world_size} failed ---\n{e}" for r, e in sorted(errors.items()))
        raise AssertionError(msg)
    missing = sorted(set(range(world_size)) - done)
    if missing:
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                           "(deadlock or mismatched collectives?)")


def run_threads(world_size: int, fn_per_rank, tls) -> list:
    """Run ``fn_per_rank(r)`` on ``world_size`` threads (``tls.rank = r`` in each) and return the results.

    For single-device simulations of a ring (tests/sim_comm.py injects an in-process group into the modes).
    A failing thread is re-raised with its rank.
    """
    import threading

    results, errors = [None] * world_size, []

    def run(r):
        tls.rank = r
        try:
            results[r] = fn_per_rank(r)
        except BaseException as e:  # surfaced below with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise AssertionError(f"simulated rank {errors[0][0]} failed") from errors[0][1]
    return results
