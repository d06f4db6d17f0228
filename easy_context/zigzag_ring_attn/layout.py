"""Zigzag layout: 2W equal chunks, rank r holds chunks r and 2W-1-r (balanced causal work)."""
from ..sharding import zigzag_shard, zigzag_unshard


def signature(world_size: int, **_) -> tuple:
    """Canonical cut (see api.layout_signature): zigzag over W ranks is USP with ring W x ulysses 1."""
    return ("contiguous", 1) if world_size == 1 else ("zigzag", world_size, 1)


def seq_multiple(world_size: int, **_) -> int:
    return 2 * world_size


def shard(x, rank, world_size, dim=1, **_):
    return zigzag_shard(x, rank, world_size, dim)


def unshard(shards, dim=1, **_):
    return zigzag_unshard(shards, dim)
