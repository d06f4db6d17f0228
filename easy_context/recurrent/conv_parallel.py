"""Short-convolution layers (lfm2's Lfm2ShortConv) under sequence parallelism without the serial chain.

Such a layer carries no recurrent state: what crosses a piece boundary is only the conv window, the last K-1 conv
inputs before the piece, and those are a function of the previous pieces' own tokens. So every rank computes its
pieces' tails at once — the layer's own forward (cache_adapter.py) on each piece's last K-1 tokens from an empty
window, whose outgoing window is exactly those inputs (zero before a document start) — publishes them, composes
each piece's window (exchange.compose_windows) and runs the piece through the layer's forward with it. One
exchange of B x channels x (K-1) values per piece, forward and backward; K-1 extra tokens of work per piece."""
from __future__ import annotations

import torch

from .exchange import anchor, compose_windows, publish, serial_requested


def run_plan(adapter, plan, layer, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's output for this rank's tokens, exact for the global sequence; None (serial chain) when
    ``serial_requested``."""
    if serial_requested(layer):
        return None
    pieces, me = plan.pieces, plan.me
    mine = [i for i, p in enumerate(pieces) if p.owner == me]
    zero = adapter.zero_state(layer, x.shape[0], x.dtype, x.device)
    width = zero[0].shape[-1]

    def resets(i, lo, hi):
        return None if plan.resets is None else plan.resets[:, lo:hi]

    tails = {}
    for i in mine:
        p = pieces[i]
        lo = p.offset + max(0, p.length - width)
        _, (window,) = adapter.run_chunk(layer, x[:, lo:p.offset + p.length], zero, resets(i, lo, p.offset + p.length))
        r = resets(i, p.offset, p.offset + p.length)
        passes = torch.ones(x.shape[0], device=x.device) if r is None else (~r.any(-1)).float().expand(x.shape[0])
        tails[i] = (window, passes.contiguous())
    tails = publish(plan, (zero[0], torch.empty(x.shape[0], dtype=torch.float32, device=x.device)), tails)
    windows = compose_windows(plan, tails, width)
    outs = {}
    for i in mine:
        p = pieces[i]
        outs[p.offset] = adapter.run_chunk(layer, x[:, p.offset:p.offset + p.length], (windows[i],),
                                           resets(i, p.offset, p.offset + p.length))[0]
    return anchor(torch.cat([outs[k] for k in sorted(outs)], dim=1), plan, tails)


__all__ = ["run_plan"]
