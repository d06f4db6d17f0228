"""Zigzag layout: 2W equal chunks, rank r holds chunks r and 2W-1-r (balanced causal work).

Packed rows (``positions=`` with a restart at 0) use the finer k-pair form of the same rule (sharding.py:
2Wk chunks, rank r holds the mirrored pairs {i, 2Wk-1-i : i mod W == r}); k = ``zigzag_pairs(L, W)``, 1 for
every row without restarts. ``pairs=`` forces k (tests, benchmarks).

With ``dispatch=`` a table (or ``"auto"``: planned from the global ``positions=``) packed rows are dealt in
cost-balanced chunks instead (dispatch/plan.py); ``pairs=`` and EASY_CONTEXT_PACKED_LAYOUT=pairs keep the k-pair form.
"""
from ..dispatch.plan import resolve
from ..sharding import layout_pairs, pairs_shard, pairs_unshard


def signature(world_size: int, **_) -> tuple:
    """Canonical cut (see api.layout_signature): zigzag over W ranks is USP with ring W x ulysses 1."""
    return ("contiguous", 1) if world_size == 1 else ("zigzag", world_size, 1)


def seq_multiple(world_size: int, **_) -> int:
    return 2 * world_size


def pairs_of(length: int, world_size: int, positions=None, pairs=None) -> int:
    return pairs if pairs is not None else layout_pairs(positions, length, world_size)


def dispatch_of(world_size, positions=None, pairs=None, dispatch=None, window=None, **_):
    """The dispatch table of packed rows over the W ring ranks (None: the fixed zigzag / k-pair layout)."""
    return resolve(world_size, positions, pairs, dispatch, window)


def shard(x, rank, world_size, dim=1, positions=None, pairs=None, dispatch=None, window=None, **_):
    d = dispatch_of(world_size, positions, pairs, dispatch, window)
    if d is not None:
        return d.shard(x, rank, dim)
    return pairs_shard(x, rank, world_size, pairs_of(x.shape[dim], world_size, positions, pairs), dim)


def unshard(shards, dim=1, positions=None, pairs=None, dispatch=None, window=None, **_):
    d = dispatch_of(len(shards), positions, pairs, dispatch, window)
    if d is not None:
        return d.unshard(shards, dim)
    length = sum(s.shape[dim] for s in shards)
    return pairs_unshard(shards, pairs_of(length, len(shards), positions, pairs), dim)
