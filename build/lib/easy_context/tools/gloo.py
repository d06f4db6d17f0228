"""One gloo process on this machine: what every spawned CPU rank (``check``, the tests' harness) sets up, and
the parent's side: a free port for the group, stopping the ranks."""
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


def stop_ranks(procs) -> None:
    """Kill the spawned rank processes still running, then reap every one (5 s each at most)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


@contextlib.contextmanager
def gloo_process(rank: int, world_size: int, port: int, collective_timeout: float):
    """torchrun's environment, one thread (W ranks share the cores), a gloo group for the block; always torn down."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
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
