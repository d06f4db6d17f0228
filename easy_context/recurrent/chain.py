"""The exact sequence-parallel recurrent layer: a chain over the pieces of the global sequence, in order.

Forward: the rank holding piece i receives the state after piece i-1 (from its owner, or keeps it when it owns
that piece too), runs ``adapter.run_chunk`` on its tokens, and sends the state after piece i to the owner of
piece i+1. Backward runs the same chain in reverse: the owner of piece i receives d(state after piece i),
recomputes the piece with autograd (the forward keeps only the layer input and the incoming states, like
activation checkpointing), gets d(input), d(parameters) and d(state before piece i), and sends the last to the
owner of piece i-1. Every rank walks the same global piece list, so sends and receives pair up in order with
plain blocking point-to-point calls; no rank waits on itself.

Cost: the pieces run one after another, so one recurrent layer takes the time of the whole sequence on one rank
(W pieces' work in turn) plus, per piece boundary between ranks, one state message (conv window + recurrent
state: for gated DeltaNet B x (conv_dim x (K-1) + H_v x d_k x d_v) floats, independent of the sequence length).
Recomputation adds one forward of the layer in backward. Exact: each piece computes what one process computes
for those tokens given the true incoming state (the adapter's rule), and document starts zero the state.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .pieces import Plan
from .zero3 import full_zeros, gather_direct, is_partitioned, whole_layer, whole_layer_for_grads

def _send(tensors, like, dst):
    for t, ref in zip(tensors, like):  # in the receiver's dtype: the buffers are sized from zero_state
        dist.send(t.detach().to(ref.dtype).contiguous(), dst=dst)


def _recv(like, src):
    out = []
    for t in like:
        buf = torch.empty_like(t)
        dist.recv(buf, src=src)
        out.append(buf)
    return tuple(out)


def _zeros(adapter, layer, x):
    return tuple(adapter.zero_state(layer, x.shape[0], x.dtype, x.device))


def _resets(plan: Plan, p):
    return None if plan.resets is None else plan.resets[:, p.offset:p.offset + p.length]


def chain_forward(plan: Plan, adapter, layer, x: torch.Tensor, capture: dict | None = None):
    """(output (B, S, ...), {piece index: incoming state}) for this rank's pieces; no autograd graph kept
    unless the caller enables it. ``capture``: {global index: None} -> filled with the state before that token
    where this rank computed it (the plan must have a piece boundary there, ``Plan.cut_at``)."""
    pieces, me = plan.pieces, plan.me
    outs, states_in = {}, {}
    state = None
    for i, p in enumerate(pieces):
        if p.owner != me:
            continue
        if i == 0:
            state = _zeros(adapter, layer, x)
        elif pieces[i - 1].owner != me:
            state = _recv(_zeros(adapter, layer, x), pieces[i - 1].owner)
        states_in[i] = state
        out, state = adapter.run_chunk(layer, x[:, p.offset:p.offset + p.length], state, _resets(plan, p))
        state = tuple(state)
        if capture is not None and p.start + p.length in capture:
            capture[p.start + p.length] = state
        outs[p.offset] = out
        if i + 1 < len(pieces) and pieces[i + 1].owner != me:
            _send(state, states_in[i], pieces[i + 1].owner)
    return torch.cat([outs[k] for k in sorted(outs)], dim=1), states_in


class _Chain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, adapter, layer, x, *params):
        out, states_in = chain_forward(plan, adapter, layer, x)
        order = sorted(states_in)
        ctx.plan, ctx.adapter, ctx.layer, ctx.order = plan, adapter, layer, order
        dev = x.device.type  # the recompute runs under the forward's autocast (as torch.utils.checkpoint does)
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.n_state = len(states_in[order[0]]) if order else 0
        ctx.save_for_backward(x, *[t for i in order for t in states_in[i]])
        return out

    @staticmethod
    def backward(ctx, d_out):
        # unpack first: under activation checkpointing this is where every rank recomputes the layer (and runs its
        # forward chain) at the same point of its backward, before any message of this backward is sent
        x, *flat = ctx.saved_tensors
        plan, adapter, layer, me = ctx.plan, ctx.adapter, ctx.layer, ctx.plan.me
        k = ctx.n_state
        states_in = {i: tuple(flat[j * k:(j + 1) * k]) for j, i in enumerate(ctx.order)}
        params = [p for p in layer.parameters() if p.requires_grad]
        d_x = torch.zeros_like(x)
        d_params = [None] * len(params)
        dev, on, dtype = ctx.autocast
        with whole_layer_for_grads(layer, params), torch.autocast(dev, dtype=dtype, enabled=on):  # ZeRO-3 (zero3.py)
            _backward_chain(plan, adapter, layer, x, d_out, states_in, params, d_x, d_params, k)
            if is_partitioned(layer):  # every rank fires every parameter's gradient hook, in one order
                d_params = [g if g is not None else full_zeros(p) for g, p in zip(d_params, params)]
        return (None, None, None, d_x if x.requires_grad else None, *d_params)


def _backward_chain(plan, adapter, layer, x, d_out, states_in, params, d_x, d_params, k):
    pieces, me = plan.pieces, plan.me
    d_state = None
    for i in range(len(pieces) - 1, -1, -1):
        p = pieces[i]
        if p.owner != me:
            continue
        if i + 1 < len(pieces) and pieces[i + 1].owner != me:
            d_state = _recv(_zeros(adapter, layer, x), pieces[i + 1].owner)
        elif i + 1 == len(pieces):
            d_state = None
        sl = slice(p.offset, p.offset + p.length)
        with torch.enable_grad():
            xp = x[:, sl].detach().requires_grad_(x.requires_grad)
            s_in = tuple(s.detach().requires_grad_() for s in states_in[i])
            out, s_out = adapter.run_chunk(layer, xp, s_in, _resets(plan, p))
            outs, grads = [out], [d_out[:, sl]]
            if d_state is not None:
                for s, g in zip(s_out, d_state):
                    if s.requires_grad:
                        outs.append(s)
                        grads.append(g.to(s.dtype))
            inputs = [xp, *s_in, *params] if x.requires_grad else [*s_in, *params]
            got = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
        if x.requires_grad:
            d_x[:, sl] = got[0] if got[0] is not None else 0
            got = got[1:]
        d_s_in = tuple(g if g is not None else torch.zeros_like(s) for g, s in zip(got[:k], s_in))
        for j, g in enumerate(got[k:]):
            if g is not None:
                d_params[j] = g if d_params[j] is None else d_params[j] + g
        d_state = d_s_in
        if i > 0 and pieces[i - 1].owner != me:
            _send(d_s_in, s_in, pieces[i - 1].owner)


def run_layer(plan: Plan, adapter, layer, x: torch.Tensor, tiles: int = 1) -> torch.Tensor:
    """The layer's output for this rank's tokens, exact for the global sequence (forward and backward). ``tiles``
    (configure_memory's recurrent_tiles): one process runs the layer as the chain over that many tiles of its
    sequence, the backward recomputing one tile at a time (the layer's working set of one tile at the peak)."""
    gather_direct(layer)  # ZeRO-3: conv weights read outside the conv's forward (zero3.py)
    params = [p for p in layer.parameters() if p.requires_grad]
    fast = getattr(adapter, "run_plan", None)  # an adapter with its own parallel path (Mamba-2: mamba2_parallel.py)
    out = fast(plan, layer, x) if fast is not None and not plan.single else None
    if out is not None:
        return out
    if plan.single and tiles > 1:  # every tile this rank's (no messages); the chain's recompute keeps one tile
        plan = plan.tiled(tiles)
    elif plan.single:  # one process (data_parallel resets, an sp mode on one rank): plain autograd, ZeRO-3 too
        return chain_forward(plan, adapter, layer, x)[0]
    with whole_layer(layer):  # ZeRO-3 across ranks: the layer's parameters gathered once for the chain (zero3.py)
        if not torch.is_grad_enabled() or not (x.requires_grad or params):  # no backward: the forward chain only
            return chain_forward(plan, adapter, layer, x)[0]
        return _Chain.apply(plan, adapter, layer, x, *params)
