"""The contiguous cut (ulysses_attn; dist_flash_attn adds the packed-row dispatch): rank r holds chunk r of W."""
from .sharding import contiguous_shard, contiguous_unshard


def signature(world_size: int, **_) -> tuple:
    return ("contiguous", world_size)


def seq_multiple(world_size: int, **_) -> int:
    return world_size


def shard(x, rank, world_size, dim=1, **_):
    return contiguous_shard(x, rank, world_size, dim)


def unshard(shards, dim=1, **_):
    return contiguous_unshard(shards, dim)
