"""Mamba-2 mixers under sequence parallelism without the serial chain: every rank runs its pieces at once.

The serial chain (chain.py) runs the pieces of the global sequence one after another, so one recurrent layer
takes the time of the whole sequence. A Mamba-2 mixer does not need that (the scheme of issue #30):

1. The conv window of a piece is made of the previous pieces' *inputs* (the last ``K - 1`` in_proj rows), known
   without running anything: every rank sends its pieces' tails (rows before a document start zeroed) to every
   other rank, and each piece assembles its window from the pieces before it.
2. The SSM is affine in its initial state: h_t = exp(sum_{k<=t} a_k) h_init + (the run from zero). Each piece runs
   from a zero state and publishes its final state F_j and its transition exp(sum a) (0 in a row where the piece
   holds a document start). Every rank composes the true incoming state S_i = F_{i-1} + T_{i-1} S_{i-1} for its
   pieces, and adds C_t · S_i · exp(cumsum a)_t to the outputs of the tokens before the piece's first document
   start — before the gated norm and out_proj, which are per token.

Two exchanges of a few KB per piece (B x (K-1) x conv channels; B x heads x head_dim x d_state + B x heads); the
backward of each exchange returns the gradients to the pieces' owners. Exact (same float math as run_chunk up to
the order of the state sums). Plain autograd otherwise: the scan's activations are kept like the layer's own.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from .exchange import anchor, publish, serial_requested
from .mamba2 import _gated_norm, _in_proj, causal_conv, segment_ids, ssd_scan


SERIAL_ENV = "EASY_CONTEXT_MAMBA2_SERIAL"
log = logging.getLogger(__name__)
_SAID: set = set()


def run_plan(plan, layer, x: torch.Tensor) -> torch.Tensor | None:
    """The mixer's output for this rank's tokens (b, S_local, d), exact for the global sequence. None (the caller
    then runs the serial chain) with ``EASY_CONTEXT_MAMBA2_SERIAL=1`` or ``EASY_CONTEXT_RECURRENT_SERIAL=1``
    (comparisons). in_proj, norm and out_proj run once on all local tokens, whatever pieces this rank holds (so
    DeepSpeed ZeRO-3's per-module gathers pair up across ranks: zero3.py)."""
    if os.environ.get(SERIAL_ENV) == "1" or serial_requested(layer):
        return None
    if x.device.type not in _SAID:  # once per device type, like the gated DeltaNet backend line
        _SAID.add(x.device.type)
        log.warning("Mamba-2: torch SSD scan (mamba2.ssd_scan); no kernel: mamba-ssm publishes no wheel")
    me, pieces = plan.me, plan.pieces
    mine = [i for i, p in enumerate(pieces) if p.owner == me]
    b, K, dtype = x.shape[0], layer.conv_kernel_size, x.dtype
    H, P, N = layer.num_heads, layer.head_dim, layer.ssm_state_size
    gate_all, xBC_all, dt_all = _in_proj(layer, x).split([layer.intermediate_size, layer.conv_dim, layer.num_heads],
                                                         dim=-1)
    parts, tails = {}, {}
    for i in mine:
        p = pieces[i]
        resets = None if plan.resets is None else plan.resets[:, p.offset:p.offset + p.length]
        seg = segment_ids(resets, b, p.length, x.device)
        xBC = xBC_all[:, p.offset:p.offset + p.length]
        parts[i] = (xBC, dt_all[:, p.offset:p.offset + p.length], seg)
        # tail: this piece's last K-1 inputs, right-aligned, zero before its last document start
        tail = F.pad(xBC[:, -(K - 1):], (0, 0, max(0, K - 1 - p.length), 0))
        keep = torch.ones(b, K - 1, dtype=torch.bool, device=x.device)
        passes = torch.ones(b, dtype=torch.float32, device=x.device)
        if seg is not None:
            seg_t = F.pad(seg, (max(0, K - 1 - p.length), 0), value=-1)[:, -(K - 1):].expand(b, -1)
            keep = seg_t == seg[:, -1:].expand(b, -1)
            passes = (seg[:, -1] == 0).float().expand(b).contiguous()  # the state before the piece gets through
        tails[i] = (tail * keep.unsqueeze(-1).to(tail.dtype), passes)
    like = (torch.empty(b, K - 1, layer.conv_dim, dtype=xBC_all.dtype, device=x.device),
            torch.empty(b, dtype=torch.float32, device=x.device))
    tails = publish(plan, like, tails)

    outs, summary, local_out = {}, {}, {}
    A = -torch.exp(layer.A_log.float())
    for i in mine:
        xBC, dt, seg = parts[i]
        window = _window(pieces, tails, i, K, like[0])
        xBC, _ = causal_conv(xBC, window, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.activation, seg)
        L = xBC.shape[1]
        gn = layer.n_groups * N
        xs, B, C = xBC.split([layer.intermediate_size, gn, gn], dim=-1)
        dt = F.softplus(dt + layer.dt_bias.to(dt.dtype))
        lo, hi = layer.time_step_limit
        dt = torch.clamp(dt, min=lo, max=hi)
        rep = H // layer.n_groups
        B = B.reshape(b, L, layer.n_groups, -1).float().repeat_interleave(rep, dim=2)
        C = C.reshape(b, L, layer.n_groups, -1).float().repeat_interleave(rep, dim=2)
        zero = torch.zeros(b, H, P, N, dtype=torch.float32, device=x.device)
        y0, final0 = ssd_scan(xs.reshape(b, L, H, P).float(), dt, A, B, C, layer.D, layer.chunk_size, zero, seg)
        acum = (A * dt.float()).cumsum(1)  # (b, L, h): log decay from the piece start through token t
        reach = torch.exp(acum)
        if seg is not None:
            reach = reach * (seg == 0).unsqueeze(-1).to(reach.dtype)  # tokens before the first document start
        passes = tails[i][1]
        summary[i] = (final0, torch.exp(acum[:, -1]) * passes[:, None])
        local_out[i] = (y0, C, reach)
    like2 = (torch.empty(b, H, P, N, dtype=torch.float32, device=x.device),
             torch.empty(b, H, dtype=torch.float32, device=x.device))
    summary = publish(plan, like2, summary)

    state = torch.zeros(b, H, P, N, dtype=torch.float32, device=x.device)
    starts = []
    for i in range(len(pieces)):  # the state entering each piece: S_i = F_{i-1} + T_{i-1} S_{i-1}
        starts.append(state)
        final0, trans = summary[i]
        state = final0 + trans[..., None, None] * state
    for i in mine:
        y0, C, reach = local_out[i]
        y = y0 + torch.einsum("blhn,bhpn->blhp", C, starts[i]) * reach[..., None]
        outs[pieces[i].offset] = y.reshape(b, y.shape[1], -1)
    y = torch.cat([outs[k] for k in sorted(outs)], dim=1)
    return anchor(layer.out_proj(_gated_norm(layer, y, gate_all).to(dtype)), plan, tails, summary)


def _window(pieces, tails, i, K, like):
    """The K-1 conv inputs before piece i: the previous pieces' tails, right to left, until K-1 rows are filled
    or a piece with a document start (its tail already zero before that start) ends the walk."""
    rows, need = [], K - 1
    alive = torch.ones(like.shape[0], 1, 1, dtype=like.dtype, device=like.device)
    for j in range(i - 1, -1, -1):
        if need == 0:
            break
        tail, passes = tails[j]
        take = min(pieces[j].length, need)
        rows.insert(0, tail[:, K - 1 - take:] * alive)
        need -= take
        alive = alive * passes.to(like.dtype)[:, None, None]
    if need:
        rows.insert(0, torch.zeros(like.shape[0], need, like.shape[2], dtype=like.dtype, device=like.device))
    return torch.cat(rows, dim=1)


__all__ = ["SERIAL_ENV", "run_plan"]
