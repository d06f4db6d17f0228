"""toy_ring's cut: contiguous, rank r holds chunk r of W (its own copy, so the test shows a package brings its cut)."""
import torch


def signature(world_size: int, **_) -> tuple:
    return ("contiguous", world_size)  # cuts like easy_context.contiguous: the same canonical signature


def seq_multiple(world_size: int, **_) -> int:
    return world_size


def shard(x, rank, world_size, dim=1, **_):
    if x.shape[dim] % world_size:
        raise ValueError(f"toy_ring: length {x.shape[dim]} must be a multiple of {world_size}")
    return x.chunk(world_size, dim=dim)[rank]


def unshard(shards, dim=1, **_):
    return torch.cat(list(shards), dim=dim)
