"""The multi-rank harness itself: ranks run, failures name their rank, hangs fail fast."""
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks


def _allreduce_body(rank, world_size):
    import os
    assert int(os.environ["RANK"]) == rank and int(os.environ["WORLD_SIZE"]) == world_size
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # the others block here until the harness kills them


def _hang_body(rank, world_size):
    if rank == 0:
        time.sleep(600)
    dist.barrier()


# 4 ranks is slow-only: every 4-rank test of the default run goes through the same harness
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_run_collectives(world_size):
    run_ranks(_allreduce_body, world_size)


def test_failing_rank_is_reported():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*boom from rank one"):
        run_ranks(_fail_on_rank_one, 2, timeout=60)


def test_hang_times_out():
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, AssertionError)):
        run_ranks(_hang_body, 2, timeout=4, collective_timeout=60)
    assert time.monotonic() - t0 < 33
