"""Sequence layouts shared by the modes: contiguous and zigzag split / merge along one dim.

zigzag (W ranks): the sequence is cut into 2W equal chunks; rank r holds chunks r and 2W-1-r, so every
rank does the same causal work. contiguous: rank r holds chunk r of W.
"""
from __future__ import annotations

import os

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


# ----------------------------------------------------------------------------------------------
# packed rows: zigzag with k mirrored pairs per rank
# ----------------------------------------------------------------------------------------------
# One causal stream does equal work on every zigzag rank, but packed documents do not: a rank's work is the sum
# over its q tokens of their position inside their document + 1, and with 2W coarse chunks one long document can
# land mostly on one rank. Cutting finer and dealing mirrored pairs round-robin averages that out
# (bench/bench_packed.py --count; docs/packed-documents.md), at the price of more, smaller kernel calls:
# PAIRS_MIN_CHUNK below picks k by wall time. The idea of finer load-balancing splits is Striped Attention's
# (Brandon et al. 2023) and that of Megatron-LM / Transformer Engine's THD load balancing (2·cp chunks, mirrored);
# this k-pair form is ours.
#
# The layout must be data-independent: the attention rebuilds it from the gathered *local* position ids alone
# (``model(local_ids, position_ids=local_pos)`` takes no other argument), so k is a function of (L, W) only and
# "packed" a test that reads the same on the global positions and on the rank-order concatenation of the shards.

PAIRS_MAX = 16
# Smallest chunk of the fine layout, chosen by wall time, not by balance. Every extra chunk pair adds dense pieces
# (kernel launches + LSE merges) to every ring step, so balance only pays when a rank's work is large. Timed on one
# H200 at 128K, 256K and 512K (bench/bench_packed.py, 2026-12-03; the sweep of k is in docs/packed-documents.md),
# the k giving chunks of 8K tokens was the fastest or close to it at every length, so chunks of at least 8K tokens.
# EASY_CONTEXT_PAIRS_MIN_CHUNK overrides it (the same value on every rank: the sharding and the attention must
# agree; the tests use 256 to reach k > 1 on short rows).
PAIRS_MIN_CHUNK = 8192
PAIRS_ENV = "EASY_CONTEXT_PAIRS_MIN_CHUNK"


def pairs_min_chunk() -> int:
    """The smallest fine-layout chunk in effect: ``EASY_CONTEXT_PAIRS_MIN_CHUNK`` if set, else PAIRS_MIN_CHUNK."""
    raw = os.environ.get(PAIRS_ENV)
    if raw is None or raw == "":
        return PAIRS_MIN_CHUNK
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{PAIRS_ENV}={raw!r} must be a positive integer (tokens per chunk of the packed layout)")
    return int(raw)


def packed_rows(positions: torch.Tensor | None) -> bool:
    """Does any row restart at 0 after its first token (packed documents)? One answer for the whole batch.

    Identical on the global ``(B, L)`` positions and on the rank-order concatenation of the local shards of any
    zigzag / k-pair / USP layout: rank 0's first local token is global token 0 in all of them, so the set of
    indices other than 0 is the same set of tokens. A row whose first position is not 0 and never restarts is
    one (continued) document: not packed."""
    if positions is None:
        return False
    return bool((positions.reshape(-1, positions.shape[-1])[:, 1:] == 0).any())


def zigzag_pairs(length: int, world_size: int, min_chunk: int | None = None, max_pairs: int = PAIRS_MAX) -> int:
    """k for packed rows: the largest power of two <= ``max_pairs`` with ``length % (2 W k) == 0`` and chunks of
    at least ``min_chunk`` tokens (default ``pairs_min_chunk()``); 1 (plain zigzag) when none is larger.
    Data-independent on purpose: the attention must rebuild the layout from the gathered local position ids,
    knowing only (L, W)."""
    k = 1
    if world_size <= 1:
        return k  # one rank holds the whole row in order whatever k is
    min_chunk = pairs_min_chunk() if min_chunk is None else min_chunk
    while 2 * k <= max_pairs and length % (4 * world_size * k) == 0 and length // (4 * world_size * k) >= min_chunk:
        k *= 2
    return k


def layout_pairs(positions: torch.Tensor | None, length: int, world_size: int, **kw) -> int:
    """k of the layout a batch with these ``positions`` (global or rank-order gathered) uses: 1 unless packed."""
    return zigzag_pairs(length, world_size, **kw) if packed_rows(positions) else 1


def pair_chunks(rank: int, world_size: int, pairs: int) -> list[int]:
    """Global chunk ids (of n = 2 W k) held by ``rank``, in local (increasing global) order: {i, n-1-i : i < n/2,
    i mod W == rank}. k = 1 is zigzag's (rank, 2W-1-rank)."""
    n = 2 * world_size * pairs
    own = [i for i in range(rank, n // 2, world_size)]
    return sorted(own + [n - 1 - i for i in own])


def pairs_shard(x: torch.Tensor, rank: int, world_size: int, pairs: int = 1, dim: int = 1) -> torch.Tensor:
    if pairs == 1:
        return zigzag_shard(x, rank, world_size, dim)
    n = 2 * world_size * pairs
    check_divisible(x.shape[dim], n, f"packed rows over {world_size} ranks with {pairs} mirrored pairs each "
                                     f"(2 x {world_size} x {pairs} = {n} equal chunks)")
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[i] for i in pair_chunks(rank, world_size, pairs)], dim=dim)


def pairs_unshard(shards: list[torch.Tensor], pairs: int = 1, dim: int = 1) -> torch.Tensor:
    if pairs == 1:
        return zigzag_unshard(shards, dim)
    w = len(shards)
    order: list = [None] * (2 * w * pairs)
    for r, s in enumerate(shards):
        for g, part in zip(pair_chunks(r, w, pairs), s.chunk(2 * pairs, dim=dim)):
            order[g] = part
    return torch.cat(order, dim=dim)


def pairs_indices(length: int, rank: int, world_size: int, pairs: int = 1) -> torch.Tensor:
    """Global token indices of ``rank``'s local rows, in local order."""
    return pairs_shard(torch.arange(length), rank, world_size, pairs, dim=0)
