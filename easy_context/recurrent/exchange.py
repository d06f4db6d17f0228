"""What the parallel recurrent paths (mamba2_parallel.py, delta_parallel.py, conv_parallel.py) exchange: every
piece's small summary (conv tail, final state, transition) on every rank, autograd-aware, and the conv windows
composed from the tails. Shared so each path keeps only its layer's math.

Every rank publishes its pieces' tensors to every other owner (batched point-to-point); the backward sends the
gradients of the others' pieces back to their owners and sums those of its own, so plain autograd gives exact
gradients across ranks. ``anchor`` makes every rank run the backward of every exchange (the first piece's owner
does not read the others' tensors but still owes them their gradients)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

# "1": every recurrent layer runs the serial chain (chain.py) instead of its parallel path (comparisons, benches)
SERIAL_ENV = "EASY_CONTEXT_RECURRENT_SERIAL"


def serial_requested(layer) -> bool:
    """True when the parallel path must not run: ``EASY_CONTEXT_RECURRENT_SERIAL=1`` (comparisons, benches)."""
    return os.environ.get(SERIAL_ENV) == "1"


class _Publish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, like, *local):
        # like: the shapes/dtypes (tensors) of one piece's tuple; local: this rank's pieces' tuples, flat
        me, k = plan.me, len(like)
        mine = [i for i, p in enumerate(plan.pieces) if p.owner == me]
        peers = sorted({p.owner for p in plan.pieces} - {me})
        out = {i: tuple(t.clone() for t in local[j * k:(j + 1) * k]) for j, i in enumerate(mine)}
        ops, bufs = [], {}
        for r in peers:
            for i in mine:
                ops += [dist.P2POp(dist.isend, t.contiguous(), r) for t in out[i]]
            for i, p in enumerate(plan.pieces):
                if p.owner == r:
                    bufs[i] = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like)
                    ops += [dist.P2POp(dist.irecv, t, r) for t in bufs[i]]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        out.update(bufs)
        ctx.plan, ctx.k, ctx.mine, ctx.peers = plan, k, mine, peers
        return tuple(t for i in range(len(plan.pieces)) for t in out[i])

    @staticmethod
    def backward(ctx, *grads):
        plan, k, mine, peers = ctx.plan, ctx.k, ctx.mine, ctx.peers
        ref = {i: grads[i * k:(i + 1) * k] for i in range(len(plan.pieces))}
        ops, got = [], {}
        for r in peers:
            for i, p in enumerate(plan.pieces):
                if p.owner == r:
                    ops += [dist.P2POp(dist.isend, t.contiguous(), r) for t in ref[i]]
            for i in mine:
                got[(r, i)] = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in ref[i])
                ops += [dist.P2POp(dist.irecv, t, r) for t in got[(r, i)]]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        out = []
        for i in mine:
            total = [t.clone() for t in ref[i]]
            for r in peers:
                total = [a + b for a, b in zip(total, got[(r, i)])]
            out += total
        return (None, None, *out)


class _Anchor(torch.autograd.Function):
    """``out`` unchanged, with ``extra`` as inputs of zero gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, out, *extra):
        ctx.extra = [(t.shape, t.dtype, t.device) for t in extra]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *[torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.extra])


def publish(plan, like: tuple, local: dict) -> dict:
    """{piece index: tuple} for every piece of the plan, from ``local`` = this rank's pieces' tuples (shaped like
    ``like``). Differentiable: gradients of a piece's tensors reach its owner."""
    mine = [i for i, p in enumerate(plan.pieces) if p.owner == plan.me]
    flat = _Publish.apply(plan, like, *[t for i in mine for t in local[i]])
    k = len(like)
    return {i: flat[i * k:(i + 1) * k] for i in range(len(plan.pieces))}


def anchor(out: torch.Tensor, plan, *published: dict) -> torch.Tensor:
    """``out``, tied to every published tensor that needs a gradient, so every rank runs every exchange's
    backward in the same order."""
    extra = [t for d in published for i in range(len(plan.pieces)) for t in d[i] if t.requires_grad]
    return _Anchor.apply(out, *extra) if extra and out.requires_grad else out


def conv_tail(inputs: torch.Tensor, resets: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A piece's conv inputs as the next piece's window sees them: (tail (B, C, width) = the last ``width``
    inputs right-aligned, zero before the piece's last document start (and left of a piece shorter than width);
    passes (B,) float = 1 where the piece holds no document start, i.e. earlier windows still reach through it).
    ``inputs`` (B, C, L) channels first (the layers' conv layout)."""
    b, _, L = inputs.shape
    tail = F.pad(inputs[..., max(0, L - width):], (max(0, width - L), 0))
    if resets is None:
        return tail, torch.ones(b, dtype=torch.float32, device=inputs.device)
    resets = resets.expand(b, -1)
    pos = torch.arange(L, device=inputs.device)
    last = torch.where(resets, pos, torch.full_like(pos, -1)).amax(-1)  # (B,) last start, -1 when none
    keep = torch.arange(L - width, L, device=inputs.device)[None] >= last[:, None]
    return tail * keep[:, None].to(tail.dtype), (last < 0).float()


def compose_windows(plan, tails: dict, width: int) -> list[torch.Tensor]:
    """The conv window (B, C, width) entering each piece of the plan, from every piece's ``conv_tail``:
    w_{i+1} = tail_i + passes_i * (w_i shifted left by the piece's length)."""
    like = tails[0][0]
    w = torch.zeros_like(like)
    out = []
    for i, p in enumerate(plan.pieces):
        out.append(w)
        tail, passes = tails[i]
        n = min(p.length, width)
        w = tail + passes.to(w.dtype)[:, None, None] * F.pad(w[..., n:], (0, n))
    return out

def forward_matches(cls, cache: dict, check) -> bool:
    """``check(source of cls.forward)``, cached per class in ``cache`` (False when the source cannot be read): the
    parallel paths recompute a layer from its parts and so only trust the forward they were written against."""
    if cls not in cache:
        import inspect
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        cache[cls] = bool(src) and bool(check(src))
    return cache[cls]


__all__ = ["SERIAL_ENV", "anchor", "compose_windows", "conv_tail", "forward_matches", "publish", "serial_requested"]
