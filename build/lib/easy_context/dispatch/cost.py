"""What a deal of a packed row costs: per-token attention work and the fitted per-rank time model.

Work is counted in score elements (one q x k product; causal halved): a q token attends to its index in its
document + 1 keys, capped by a sliding window when one is given (``token_costs``). A rank's predicted fwd+bwd time
adds, in the same unit, a cost per kernel piece, per launch by kind, per ring pass and per dispatch step
(``TimeModel``); ms = elements x ``MS_PER_ELEM``. The constants are plan_constants.json's "dispatch" entries (unit
and source of each there, the fits and their errors in docs/packed_dispatch.md): ``bench/packed_fit.py`` re-fits
them from ``bench/bench_packed.py``'s per-rank times.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..cost_model.constants import load_constants


@dataclass
class TimeModel:
    """The fitted constants, in score elements unless named otherwise. ``MODEL`` is the one instance, read by the
    solvers at call time (bench/packed_calibrate.py swaps a fit in for one experiment and restores it)."""
    MS_PER_ELEM: float          # ms per score element
    PIECE_TIME: float           # per kernel piece (its rows' merge)
    DENSE_TIME: float           # per dense launch
    VARLEN_TIME: float          # per varlen launch
    STEP_TIME_PER_TOKEN: float  # per local token per full-size ring pass (the fixed ring: one a step; dispatch: one)
    TOKEN_TIME: float           # per local token (the linear work): equal on every rank
    STEP_TIME: float            # per dispatch step beyond the first
    PIECE_COST: float           # the equal-chunk solver's (solver="chunks") cost of one extra dense kernel piece
    TOKEN_COST: float           # its linear per-token part: equal on every rank, so it never moves the deal

    @classmethod
    def load(cls, data: dict | None = None) -> "TimeModel":
        entries = (data or load_constants())["dispatch"]
        return cls(**{f.name: float(entries[f.name]["value"]) for f in fields(cls)})


MODEL = TimeModel.load()
NAMES = tuple(f.name for f in fields(TimeModel))  # easy_context.dispatch.<NAME> reads MODEL.<NAME>


def per_token_time(tokens: int) -> float:
    """The part of every rank's predicted time that grows with its ``tokens`` only (one full-size pass, the linear
    work), in score elements: equal on every rank, so options leave it out and max/mean counts it in."""
    return (MODEL.STEP_TIME_PER_TOKEN + MODEL.TOKEN_TIME) * tokens


def token_costs(positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(L,) float64: per global token, the keys it attends to (index in its document + 1, window-capped), summed over
    batch rows. Documents are runs between restarts at 0 (a first document not starting at 0 counts from the row
    start, as the attention does)."""
    start = _doc_start(positions)
    keys = (torch.arange(start.shape[1]) - start + 1).double()
    if window is not None:
        keys = keys.clamp(max=window)
    return keys.sum(0)


def _doc_start(positions: torch.Tensor) -> torch.Tensor:
    """(B, L) index of each token's document start."""
    pos = positions.detach().to("cpu", torch.long).reshape(-1, positions.shape[-1])
    idx = torch.arange(pos.shape[1]).expand_as(pos)
    start = torch.where(pos == 0, idx, torch.zeros_like(idx))
    start[:, 0] = 0
    return torch.cummax(start, dim=1).values


def _stats(positions, window):
    """(token costs (L,), earliest document start over batch rows per token (L,)): what every candidate reuses."""
    return token_costs(positions, window), _doc_start(positions).min(0).values


def _arrays(positions, window, stats):
    """(prefix token cost (L+1,), restarts before each index (L+1,), document start (L,)) for Estimate."""
    tok, start = stats if stats is not None else _stats(positions, window)
    pos = positions.detach().to("cpu", torch.long).reshape(-1, positions.shape[-1])
    restart = (pos == 0).any(0).long()
    restart[0] = 0
    restarts = torch.cat([torch.zeros(1, dtype=torch.long), restart.cumsum(0)]).numpy()
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), tok.cumsum(0)]).numpy()
    return prefix, restarts, start.numpy()


__all__ = ["TimeModel", "MODEL", "NAMES", "per_token_time", "token_costs"]
