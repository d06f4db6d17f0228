"""Document resets for adapters whose layer has none: a reset-free ``run(layer, x, state)`` made to honour them."""
from __future__ import annotations

from typing import Callable

import torch


def run_with_resets(run: Callable, adapter, layer, x: torch.Tensor, state: tuple, resets):
    """``run(layer, x, state) -> (out, state)`` without resets, turned into one that honours ``resets``: the
    chunk is cut at every document start and the state is zeroed there (``adapter.zero_state``). Rows with different
    cuts run one by one (a reset in row b must not zero row b' != b)."""
    if resets is None or not bool(resets.any()):
        return run(layer, x, state)
    if not bool((resets == resets[:1]).all()):  # rows differ: each row on its own
        outs, finals = [], []
        for b in range(x.shape[0]):
            o, f = run_with_resets(run, adapter, layer, x[b:b + 1], tuple(s[b:b + 1] for s in state),
                                   resets[b:b + 1])
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 0), tuple(torch.cat(parts, 0) for parts in zip(*finals))
    cuts = resets[0].nonzero().flatten().tolist()
    bounds = ([0] if cuts[0] != 0 else []) + cuts + [x.shape[1]]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if s in cuts:
            state = adapter.zero_state(layer, x.shape[0], x.dtype, x.device)
        o, state = run(layer, x[:, s:e], state)
        outs.append(o)
    return torch.cat(outs, 1), state


__all__ = ["run_with_resets"]
