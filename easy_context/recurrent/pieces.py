"""Where this rank's tokens sit in the global sequence: the pieces of the chain, from the local position ids.

Every layout (zigzag, its packed k-pair form, contiguous, USP's ring x Ulysses) cuts the global sequence into
runs of consecutive tokens held by the ranks; a recurrent layer must visit those runs in global order. Rather
than re-deriving each layout, every rank tags its local tokens with ids ``global_rank * S + offset + 1`` and
gathers them beside the position ids through ``packing.gather_positions`` (the same un-cut the attention uses,
one all-gather per forward; the ids are never 0, so the packed-layout test reads only the position rows). The
gathered id row, read in global order, names the owner and local offset of every global token: maximal runs of
one owner and consecutive offsets are the pieces.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    owner: int    # global rank holding these tokens
    offset: int   # first local index on that rank
    length: int
    start: int = 0  # first global index


@dataclass
class Plan:
    me: int                       # this process's global rank
    pieces: tuple[Piece, ...]     # the whole sequence, in global order
    resets: torch.Tensor | None   # (B, S_local) bool: local tokens that begin a document (position 0), or None

    @property
    def single(self) -> bool:
        return all(p.owner == self.me for p in self.pieces)

    def cut_at(self, index: int) -> "Plan":
        """The same plan with a piece boundary at global ``index`` (so the state there can be read)."""
        out = []
        for p in self.pieces:
            k = index - p.start
            if 0 < k < p.length:
                out += [Piece(p.owner, p.offset, k, p.start), Piece(p.owner, p.offset + k, p.length - k, index)]
            else:
                out.append(p)
        return Plan(self.me, tuple(out), self.resets)

    def tiled(self, tiles: int, chunk: int = 64) -> "Plan":
        """The same plan cut into ``tiles`` runs of equal length (a multiple of ``chunk`` tokens, the kernels', where
        a run is longer than that)."""
        total = sum(p.length for p in self.pieces)
        step = -(-total // tiles)
        step = step if step < chunk else -(-step // chunk) * chunk
        plan = self
        for index in range(step, total, step):
            plan = plan.cut_at(index)
        return plan


def _me() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _resets(position_ids: torch.Tensor | None, length: int) -> torch.Tensor | None:
    if position_ids is None:
        return None
    starts = position_ids == 0
    return starts if bool(starts.any()) else None


def build_plan(mode, groups: dict, position_ids: torch.Tensor | None, batch: int, length: int,
               dispatch=None, require_table: bool = False) -> Plan:
    """The chain's plan for a local input of ``length`` tokens (position ids (B, length) or None; ``dispatch``: the
    packed rows' table the model call carries, the attention's cut)."""
    import torch.distributed as dist

    from ..packing import gather_positions
    me = _me()
    rows = None if position_ids is None else (1 if position_ids.dim() == 1 else position_ids.shape[0])
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids is not None and position_ids.shape[0] == 1 and batch > 1:
        position_ids = position_ids.expand(batch, -1)
    resets = _resets(position_ids, length)
    if not (dist.is_available() and dist.is_initialized()) or not mode.is_parallel:
        return Plan(me, (Piece(me, 0, length, 0),), resets)
    if position_ids is None:
        raise ValueError(f"{mode.name}: the recurrent layers need position_ids (from prepare_seq_parallel_inputs) "
                         "to know where this rank's tokens lie in the sequence; pass position_ids= to the model")
    ids = (me * length + torch.arange(length, device=position_ids.device) + 1).unsqueeze(0)
    glob = gather_positions(mode, torch.cat([position_ids.to(ids.dtype), ids], 0), groups, dispatch,
                            check_rows=rows, require_table=require_table)
    gid = (glob[-1] - 1).cpu()
    owner, off = (gid // length).tolist(), (gid % length).tolist()
    pieces, start = [], 0
    for j in range(1, len(owner) + 1):
        if j == len(owner) or owner[j] != owner[j - 1] or off[j] != off[j - 1] + 1:
            pieces.append(Piece(owner[start], off[start], j - start, start))
            start = j
    return Plan(me, tuple(pieces), resets)
