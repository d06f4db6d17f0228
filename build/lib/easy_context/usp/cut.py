"""USP layout (ring degree R x ulysses degree U = sp size W).

sp rank s = ring_rank * U + ulysses_rank (Ulysses groups are runs of consecutive ranks, so the
all-to-all stays inside a node). The sequence is first split zigzag over the R ring ranks (ring rank r
holds chunks r and 2R-1-r of 2R), then that local sequence is split contiguously over the U Ulysses
ranks. The Ulysses all-to-all gathers exactly the ring rank's zigzag-local sequence back. Packed rows
(``positions=`` with a restart at 0) split over the ring in the k-pair form of zigzag (sharding.py, k =
``zigzag_pairs(L, R)``), then contiguously over the Ulysses ranks as before.
"""
import torch

from ..dispatch.plan import resolve
from ..sharding import check_divisible, contiguous_shard, pairs_shard, pairs_unshard
from ..zigzag_ring_attn.cut import pairs_of


def _degrees(world_size: int, ring_degree: int | None):
    r = world_size if ring_degree is None else int(ring_degree)
    if r < 1 or world_size % r != 0:
        raise ValueError(f"usp_attn: ring_degree ({ring_degree}) must divide the sequence-parallel size "
                         f"({world_size}): ring_degree x ulysses_degree = {world_size}")
    return r, world_size // r


def signature(world_size: int, ring_degree: int | None = None, **_) -> tuple:
    """Canonical cut (see api.layout_signature): a ring of 1 is a plain contiguous split over the Ulysses ranks."""
    r, u = _degrees(world_size, ring_degree)
    return ("contiguous", u) if r == 1 else ("zigzag", r, u)


def seq_multiple(world_size: int, ring_degree: int | None = None, **_) -> int:
    r, u = _degrees(world_size, ring_degree)
    return 2 * r * u


def dispatch_of(world_size, ring_degree=None, positions=None, pairs=None, dispatch=None, window=None, **_):
    """The dispatch of packed rows over the R ring ranks (dispatch/plan.py), or None (zigzag / k-pair)."""
    return resolve(_degrees(world_size, ring_degree)[0], positions, pairs, dispatch, window)


def shard(x, rank, world_size, dim=1, ring_degree=None, positions=None, pairs=None, dispatch=None, window=None, **_):
    r, u = _degrees(world_size, ring_degree)
    check_divisible(x.shape[dim], 2 * r * u, f"usp_attn with ring {r} x ulysses {u} (2 x {r} x {u})")
    d = dispatch_of(world_size, ring_degree, positions, pairs, dispatch, window)
    if d is not None:
        local = d.shard(x, rank // u, dim)
    else:
        local = pairs_shard(x, rank // u, r, pairs_of(x.shape[dim], r, positions, pairs), dim)
    return contiguous_shard(local, rank % u, u, dim)


def unshard(shards, dim=1, ring_degree=None, positions=None, pairs=None, dispatch=None, window=None, **_):
    r, u = _degrees(len(shards), ring_degree)
    per_ring = [torch.cat(list(shards[i * u:(i + 1) * u]), dim=dim) for i in range(r)]
    d = dispatch_of(len(shards), ring_degree, positions, pairs, dispatch, window)
    if d is not None:
        return d.unshard(per_ring, dim)
    length = sum(s.shape[dim] for s in per_ring)
    return pairs_unshard(per_ring, pairs_of(length, r, positions, pairs), dim)


def gather_positions(local: torch.Tensor, groups: dict, gather, dispatch=None) -> torch.Tensor:
    """packing.gather_positions for USP: the Ulysses pieces form the ring rank's zigzag-local sequence (all-gather
    in the Ulysses group), then the ring ranks' sequences undo the dispatch / zigzag / k-pair cut. ``gather(t,
    group)`` -> the list of every group member's ``t``."""
    from ..packing import unshard_gathered
    from .attention import resolve_groups
    ring_group, r, u, uly_group = resolve_groups(groups.get("ring_group"), groups.get("ulysses_group"))
    local = torch.cat(gather(local, uly_group), dim=1) if u > 1 else local
    if r == 1:
        return local
    from ..zigzag_ring_attn.mode import ZigzagRingMode
    return unshard_gathered(ZigzagRingMode(), gather(local, ring_group), dispatch)  # the ring's cut
