"""The layout one batch was cut in, and what ``prepare_seq_parallel_inputs`` returns.

The cut of a batch is not always a function of the mode alone: packed rows take the k-pair form of zigzag (its k
read off the positions) or a cost-balanced dispatch table planned from them. ``BatchLayout`` keeps what decided it
(mode, sp size, degrees, the global positions, the table), so its ``unshard`` is the exact inverse of the cut and
``model_kwargs`` the exact route of the table to the attention. ``SeqParallelInputs`` is the plain dict of the
public contract (``local_input_ids``, ``local_position_ids``, ``local_target_ids``) with both as attributes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchLayout:
    mode: object                 # the Mode
    world_size: int              # sp ranks
    degrees: dict                # the cut's kwargs besides the sp size (usp: ring_degree; window)
    positions: torch.Tensor      # the global (B, L) position ids the cut was decided on (CPU)
    dispatch: object = None      # dispatch.Dispatch of packed rows, None = the mode's fixed cut

    @property
    def model_kwargs(self) -> dict:
        """What the model call must carry besides ``position_ids`` for the attention to undo this cut."""
        from .dispatch.table import DISPATCH_KWARG
        return {} if self.dispatch is None else {DISPATCH_KWARG: self.dispatch}

    def _kw(self) -> dict:
        return dict(self.degrees, positions=self.positions, dispatch=self.dispatch)

    def shard(self, tensor: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s piece of another tensor of this batch (same rows, same cut)."""
        return self.mode.shard(tensor, rank, self.world_size, dim=dim, **self._kw())

    def unshard(self, shards, dim: int = 1) -> torch.Tensor:
        """Every rank's piece (rank order) -> the full tensor: the inverse of this batch's cut."""
        shards = list(shards)
        if len(shards) != self.world_size:
            raise ValueError(f"this batch was cut over {self.world_size} sp ranks; got {len(shards)} shards")
        return self.mode.unshard(shards, dim=dim, **self._kw())

    def describe(self) -> str:
        how = "dispatched (cost-balanced chunks)" if self.dispatch is not None else "fixed cut"
        extra = "".join(f", {k}={v}" for k, v in self.degrees.items() if v is not None)
        return f"{self.mode.name} on {self.world_size} sp ranks{extra}, {how}"


class SeqParallelInputs(dict):
    """``{"local_input_ids", "local_position_ids", "local_target_ids"}`` plus ``.layout`` (this batch's
    ``BatchLayout``: ``.unshard`` is the inverse of the cut) and ``.model_kwargs`` (pass them to the model)."""

    def __init__(self, tensors: dict, layout: BatchLayout):
        super().__init__(tensors)
        self.layout = layout

    @property
    def model_kwargs(self) -> dict:
        return self.layout.model_kwargs


__all__ = ["BatchLayout", "SeqParallelInputs"]
