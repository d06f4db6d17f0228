"""One gloo process on this machine: what every CPU rank (``check``, the tests' harness) sets up, and
the parent's side: where ranks start, a free port for the group, stopping the ranks."""
from __future__ import annotations

import contextlib
import datetime
import os
import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the ranks' MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_context(preload: list[str]):
    """Ranks forked from a forkserver that imported ``preload`` once per process (fork would copy the parent's torch
    threads; spawn pays every import per rank); spawn where there is none. Hand ``gloo_process`` the caller's env."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    ctx.set_forkserver_preload(preload)  # read when the server starts; a spawn context ignores it
    return ctx


def stop_ranks(procs) -> None:
    """Kill the spawned rank processes still running, then reap every one (5 s each at most)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


@contextlib.contextmanager
def gloo_process(rank: int, world_size: int, port: int, collective_timeout: float, env: dict):
    """``env`` (the caller's: a forked rank has the server's) plus torchrun's, one thread (W ranks share the cores), a
    gloo group for the block; always torn down."""
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        from easy_context.rendezvous import init_process_group  # the store on 127.0.0.1, not every interface
        init_process_group("gloo", rank, world_size, datetime.timedelta(seconds=collective_timeout))
        yield
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
