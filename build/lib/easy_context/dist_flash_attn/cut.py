"""Contiguous layout: rank r holds chunk r of W. With ``dispatch=`` (a table, or "auto" for packed rows) the rows
are dealt in cost-balanced chunks instead (dispatch/plan.py; the attention then runs dispatch/ring.py instead of the
LightSeq schedule)."""
from ..contiguous import seq_multiple, signature  # noqa: F401  (the contiguous cut's)
from ..dispatch.plan import resolve
from ..sharding import contiguous_shard, contiguous_unshard


def dispatch_of(world_size, positions=None, pairs=None, dispatch=None, window=None, **_):
    # pairs= (the k-pair form of zigzag) means "a fixed layout" here: contiguous
    return resolve(world_size, positions, pairs, dispatch, window)


def shard(x, rank, world_size, dim=1, positions=None, pairs=None, dispatch=None, window=None, **_):
    d = dispatch_of(world_size, positions, pairs, dispatch, window)
    return contiguous_shard(x, rank, world_size, dim) if d is None else d.shard(x, rank, dim)


def unshard(shards, dim=1, positions=None, pairs=None, dispatch=None, window=None, **_):
    d = dispatch_of(len(shards), positions, pairs, dispatch, window)
    return contiguous_unshard(shards, dim) if d is None else d.unshard(shards, dim)
