"""Short-convolution layers (lfm2's Lfm2ShortConv) under sequence parallelism without the serial chain.

Such a layer carries no recurrent state: what crosses a piece boundary is only the conv window, the last K-1 conv
inputs (B * x) before the piece, and those are a function of the previous pieces' own tokens. So every rank runs
in_proj once on all its tokens, publishes each piece's tail (exchange.conv_tail: zero before the piece's last
document start), composes each piece's window (exchange.compose_windows), runs the depthwise causal conv per piece
with it (mamba2.causal_conv: a tap across a document start reads zero), and out_proj once on all its tokens.
One submodule call each per rank whatever its pieces (DeepSpeed ZeRO-3's gathers pair up: zero3.py); one
exchange of B x channels x (K-1) values per piece, forward and backward."""
from __future__ import annotations

import torch

from .exchange import anchor, compose_windows, conv_tail, forward_matches, publish, serial_requested
from .mamba2 import causal_conv, segment_ids

_KNOWN: dict = {}


def supports(layer) -> bool:
    """Does the installed forward compute in_proj -> (B, C, x) channels first -> C * conv(B * x) -> out_proj, the
    conv read from ``layer.conv`` (transformers 5.24's Lfm2ShortConv)? If not, the serial chain runs."""
    return forward_matches(type(layer), _KNOWN, lambda src: all(n in src for n in (
        "self.in_proj(hidden_states).transpose(-1, -2)", ".chunk(3, dim=-2)", "B * x", "self.conv.weight",
        "C * hidden_states", "self.out_proj(")))


def run_plan(adapter, plan, layer, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's output for this rank's tokens, exact for the global sequence; None (serial chain) when
    ``serial_requested`` or the installed layer is not the one written for."""
    if serial_requested(layer) or not supports(layer):
        return None
    pieces, me = plan.pieces, plan.me
    mine = sorted((i for i, p in enumerate(pieces) if p.owner == me), key=lambda i: pieces[i].offset)
    conv = layer.conv
    width = conv.kernel_size[0] - 1
    gate_b, gate_c, xs = layer.in_proj(x).transpose(-1, -2).chunk(3, dim=-2)
    bx = gate_b * xs  # (B, channels, T): the conv input

    def resets(i):
        p = pieces[i]
        return None if plan.resets is None else plan.resets[:, p.offset:p.offset + p.length]

    def local(i):
        p = pieces[i]
        return bx[..., p.offset:p.offset + p.length]

    like = (torch.empty(x.shape[0], bx.shape[1], width, dtype=bx.dtype, device=x.device),
            torch.empty(x.shape[0], dtype=torch.float32, device=x.device))
    tails = publish(plan, like, {i: conv_tail(local(i), resets(i), width) for i in mine})
    windows = compose_windows(plan, tails, width)
    outs = []
    for i in mine:
        seg = segment_ids(resets(i), x.shape[0], pieces[i].length, x.device)
        out, _ = causal_conv(local(i).transpose(1, 2), windows[i].transpose(1, 2), conv.weight.squeeze(1), conv.bias,
                             None, seg)
        outs.append(out)
    y = gate_c * torch.cat(outs, dim=1).transpose(1, 2)
    return anchor(layer.out_proj(y.transpose(-1, -2).contiguous()), plan, tails)


__all__ = ["run_plan", "supports"]
