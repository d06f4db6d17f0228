"""The dispatch table of packed rows (``Dispatch``): which chunks of a packed row each sequence-parallel rank holds,
and the checks on its one route to the attention.

The table is a pure function of the global position ids (and W, window), planned by dispatch/plan.py. The attention only
sees *local* position ids, from which the table cannot be rebuilt (chunks of equal documents look alike), so it has
one explicit route, like ``cu_seqlens`` in flash-attn's varlen API: ``prepare_seq_parallel_inputs(...,
dispatch="auto")`` (and ``ParallelLayout.prepare_inputs``, which train.py and the Trainer integration use) return it
in ``prepared.model_kwargs`` = ``{DISPATCH_KWARG: table}``; the caller passes those to the model, transformers hands
its kwargs down to the attention (hf/attention.py), and the position all-gather there proves that every rank holds
the same table (``digest``) and that it was planned for these positions (``fingerprint``). Nothing rides on
tensors and nothing is looked up by value, so copies, ``.to(device)``, gradient accumulation and models that
rebuild their position ids cannot lose or swap it. A table that does not cover every token once cannot be built
(``Dispatch`` validates itself).

This module imports nothing else of easy_context: the geometry (packing.py), the kernels and the attention check a
table without depending on the solver that plans it.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import torch

DISPATCH_KWARG = "sp_dispatch"  # the model kwarg the table travels in, down to the attention
AUTO = "auto"  # dispatch="auto": plan a table for packed rows (else the fixed layout)
LAYOUT_ENV = "EASY_CONTEXT_PACKED_LAYOUT"


class DispatchError(ValueError):
    pass


def packed_layout() -> str:
    """``EASY_CONTEXT_PACKED_LAYOUT``: "dispatch" (default, dispatch/plan.py) or "pairs" (sharding.py's k-pair zigzag)."""
    raw = os.environ.get(LAYOUT_ENV) or "dispatch"
    if raw not in ("dispatch", "pairs"):
        raise ValueError(f"{LAYOUT_ENV}={raw!r} must be 'dispatch' (cost-balanced chunks, the default) or 'pairs' "
                         "(the fixed k-pair zigzag of packed rows)")
    return raw


@dataclass(frozen=True)
class Dispatch:
    """``owners[r]``: global chunk ids held by rank r, in local (increasing) order; chunk g is the rows
    ``[cuts[g], cuts[g + 1])`` (``cuts=()``: C equal chunks). Every rank holds the same number of tokens."""
    length: int
    owners: tuple[tuple[int, ...], ...]
    fingerprint: str = ""  # of the global positions it was planned for ("" = any): checked by the attention
    cuts: tuple[int, ...] = ()
    _rows: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        w = len(self.owners)
        flat = sorted(i for own in self.owners for i in own)
        n = len(flat)
        if w < 1 or any(not o for o in self.owners):
            raise DispatchError(f"dispatch must give each of its {w} ranks at least one chunk; got {self.owners}")
        if flat != list(range(n)):
            raise DispatchError(f"dispatch must hold every chunk 0..{n - 1} exactly once; got {self.owners}")
        cuts = tuple(int(c) for c in self.cuts)
        if not cuts:
            if self.length % n:
                raise DispatchError(f"dispatch of {n} chunks cannot cut a row of {self.length} tokens evenly")
            cuts = tuple(range(0, self.length + 1, self.length // n))
        if len(cuts) != n + 1 or cuts[0] != 0 or cuts[-1] != self.length or \
                any(a >= b for a, b in zip(cuts[:-1], cuts[1:])):
            raise DispatchError(f"dispatch cuts must rise strictly from 0 to {self.length} in {n + 1} steps; got "
                                f"{cuts[:8]}{'...' if len(cuts) > 8 else ''}")
        object.__setattr__(self, "cuts", cuts)
        sizes = [sum(cuts[g + 1] - cuts[g] for g in own) for own in self.owners]
        if len(set(sizes)) != 1:
            raise DispatchError(f"dispatch must give every one of its {w} ranks the same number of tokens; got "
                                f"{sizes}")
        if any(list(o) != sorted(o) for o in self.owners) or 0 not in self.owners[0]:
            raise DispatchError("dispatch: each rank's chunks are in increasing order and rank 0 holds chunk 0")

    @property
    def world(self) -> int:
        return len(self.owners)

    @property
    def chunks(self) -> int:
        return len(self.cuts) - 1

    @property
    def per_rank(self) -> int:
        """Most chunks a rank holds (the equal-chunk solver's m)."""
        return max(len(o) for o in self.owners)

    def span(self, g: int) -> tuple[int, int]:
        return self.cuts[g], self.cuts[g + 1]

    def rows(self, rank: int) -> torch.Tensor:
        """Global token indices of ``rank``'s local rows, in local order (cached; never modified)."""
        hit = self._rows.get(rank)
        if hit is None:
            hit = self._rows[rank] = torch.cat([torch.arange(*self.span(g)) for g in self.owners[rank]])
        return hit

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        if x.shape[dim] != self.length:
            raise DispatchError(f"dispatch is for rows of {self.length} tokens; got {x.shape[dim]} along dim {dim}")
        return x.index_select(dim, self.rows(rank).to(x.device))

    def unshard(self, shards, dim: int = 1) -> torch.Tensor:
        shards = list(shards)
        if len(shards) != self.world:
            raise DispatchError(f"dispatch over {self.world} ranks got {len(shards)} shards")
        cat = torch.cat(shards, dim=dim)
        order = torch.cat([self.rows(r) for r in range(self.world)])
        inv = torch.empty_like(order)
        inv[order] = torch.arange(len(order))
        return cat.index_select(dim, inv.to(cat.device))

    def digest(self) -> int:
        """A 62-bit fingerprint of the table (compared across ranks in the position all-gather)."""
        h = self.length * 1000003 + self.world + int(self.fingerprint[:12] or "0", 16)
        for own in self.owners:
            for g in own:
                h = (h * 1000003 + g + 1) % (1 << 62)
        for c in self.cuts:
            h = (h * 1000003 + c) % (1 << 62)
        return h or 1


def _key(positions: torch.Tensor) -> bytes:
    pos = positions.detach().to("cpu", torch.long).reshape(-1, positions.shape[-1])
    return bytes(pos.numpy().tobytes())


def fingerprint(positions: torch.Tensor) -> str:
    """A short hash of global positions (B, L): the attention checks that the table it was handed was planned for
    the positions it gathers (a table of another batch of the same length would cut the sequence wrongly)."""
    return _hash(_key(positions))


def check_fingerprint(dispatch: "Dispatch", positions: torch.Tensor, what: str) -> None:
    if dispatch.fingerprint and dispatch.fingerprint != fingerprint(positions):
        raise DispatchError(f"{what}: the dispatch table the model call carries was planned for other position ids "
                            "(another micro-batch?): pass the model_kwargs prepare_seq_parallel_inputs returned "
                            "with these very inputs")


def _hash(key: bytes) -> str:
    return hashlib.blake2b(key, digest_size=8).hexdigest()


def table_of(kwargs: dict, mode) -> "Dispatch | None":
    """The table a model call carries (``kwargs[DISPATCH_KWARG]``), checked; None when it carries none."""
    table = kwargs.get(DISPATCH_KWARG)
    if table is None:
        return None
    if not isinstance(table, Dispatch):
        raise DispatchError(f"{DISPATCH_KWARG}= must be the easy_context Dispatch that prepare_seq_parallel_inputs "
                            f"returned in prepared.model_kwargs; got {type(table).__name__}")
    if not mode.dispatches:
        raise DispatchError(f"{mode.name} does not dispatch packed rows, but the model call carries a dispatch table "
                            f"({DISPATCH_KWARG}=): the inputs were prepared for another mode")
    return table


def check_world(dispatch: Dispatch, world: int, length: int, what: str) -> None:
    if dispatch.world != world or dispatch.length != length:
        raise DispatchError(f"{what}: the inputs were dispatched over {dispatch.world} ranks for rows of "
                            f"{dispatch.length} tokens, but attention runs on {world} ranks with {length} tokens; "
                            "prepare the inputs with the same mode and degrees as the patch")


__all__ = ["Dispatch", "DispatchError", "DISPATCH_KWARG", "AUTO", "LAYOUT_ENV", "packed_layout", "fingerprint",
           "check_fingerprint", "check_world", "table_of"]
