"""Sequence layouts shared by the modes: contiguous and zigzag split / merge along one dim.

zigzag (W ranks): the sequence is cut into 2W equal chunks; rank r holds chunks r and 2W-1-r, so every
rank does the same causal work. contiguous: rank r holds chunk r of W.
"""
from __future__ import annotations

import torch


def check_divisible(length: int, multiple: int, what: str) -> None:
    if length % multiple != 0:
        lo = length - length % multiple
        raise ValueError(
            f"sequence length {length} must be a multiple of {multiple} for {what}; "
            f"pad or cut it to {lo or multiple} or {lo + multiple}")


def contiguous_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    check_divisible(x.shape[dim], world_size, f"a contiguous split over {world_size} ranks")
    return x.chunk(world_size, dim=dim)[rank]


def contiguous_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    return torch.cat(list(shards), dim=dim)


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    check_divisible(x.shape[dim], 2 * world_size,
                    f"zigzag over {world_size} ranks (2 x world_size = {2 * world_size} equal chunks)")
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    w = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    order = [halves[r][0] for r in range(w)] + [halves[r][1] for r in reversed(range(w))]
    return torch.cat(order, dim=dim)
