"""DistFlashAttn forward/backward over the contiguous layout, driven by ``schedule.block_plan``.

Idea and schedule from LightSeq / DistFlashAttn (Li et al. 2023, github.com/RulinShao/LightSeq); the code
is ours and runs every block through ``easy_context.kernels`` (any backend, any dtype the backend takes).

Layouts: q/out/dq/dout (B, L, Hq, D), k/v/dk/dv (B, L, Hkv, D) with L the local length (equal on every
rank), lse float32 (B, Hq, L). GQA k/v travel with their own (fewer) heads.

Pipeline (forward and backward alike): before computing step s the messages of the next step are issued
together with the partial results of the previous step (one ``p2p_exchange``), so communication overlaps
the current block. Accumulators are float32 and allocated per call; nothing is global; no synchronize.
"""
from __future__ import annotations

import math

import torch

from .. import kernels
from ..attention_cache import cached_attention
from ..comm import group_rank_world, p2p_exchange
from .schedule import (Block, all_plans, check_world_size, input_messages, num_steps,
                       result_messages)


# ----------------------------------------------------------------------------------------------
# validation (local only: runs before any collective)
# ----------------------------------------------------------------------------------------------
def check_inputs(q, k, v, dropout_p=0.0, causal=True, group=None) -> tuple[int, int]:
    """(rank, world) of ``group`` after checking the arguments; ValueError before any communication."""
    if not causal:
        raise ValueError("dist_flash_attn is causal only (its schedule balances causal work); "
                         "pass causal=True, or use ulysses_attn for non-causal attention")
    if dropout_p:
        raise ValueError(f"dist_flash_attn does not support attention dropout (got dropout_p={dropout_p}); "
                         "set config.attention_dropout=0")
    kernels.check_qkv(q, k, v, "dist_flash_attn", local=True)
    if q.shape[1] == 0:
        raise ValueError("dist_flash_attn got an empty local sequence; the global length must be at least "
                         "the number of ranks (shard with shard_sequence('dist_flash_attn', ...))")
    rank, world = group_rank_world(group)
    check_world_size(world)
    return rank, world


def _acc_dtype(q):  # float32 accumulators (float64 stays float64 for the math-backend reference)
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _buf(x):  # receive buffers are always contiguous (empty_like would copy e.g. a transposed layout)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _scale(q, softmax_scale):
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


# ----------------------------------------------------------------------------------------------
# the schedule runner shared by forward and backward
# ----------------------------------------------------------------------------------------------
def _run(rank, world, group, split, steps, backward, payload, alloc, diag, compute, consume):
    """Run the off-diagonal ``steps`` in order, overlapping each step's compute with the next exchange.

    payload(msg) -> tensors this rank sends for ``msg``; alloc(msg) -> receive buffers;
    diag() computes step 0; compute(block, received) -> tensors for this rank's result message (or None);
    consume(msg, tensors) folds a received partial result into the accumulators.
    """
    plan = all_plans(world, split)[rank]
    results: dict[int, tuple] = {}
    inputs: dict[int, tuple] = {}

    def exchange(msgs):
        sends, recvs, got = [], [], []
        for m in msgs:  # the same global order on every rank keeps each peer pair's ops matched
            if m.src == rank:
                sends += [(t, m.dst) for t in payload(m, results)]
            if m.dst == rank:
                bufs = alloc(m)
                recvs += [(b, m.src) for b in bufs]
                got.append((m, bufs))
        # ``sends`` rides along until the wait so sent tensors (e.g. a helper's result) stay alive
        return p2p_exchange(sends, recvs, group), got, sends

    def finish(pending):
        reqs, got, _ = pending
        for r in reqs:
            r.wait()
        for m, bufs in got:
            if m.kind in ("kv", "q", "q_do_o_lse"):
                inputs[m.step] = bufs
            else:
                consume(m, bufs)

    pending = exchange(input_messages(steps[0], world, backward, split)) if steps else ([], [], [])
    diag()  # overlaps the first exchange
    for i, s in enumerate(steps):
        finish(pending)
        nxt = input_messages(steps[i + 1], world, backward, split) if i + 1 < len(steps) else []
        prev = result_messages(steps[i - 1], world, backward, split) if i > 0 else []
        pending = exchange(nxt + prev)
        blk: Block | None = plan[s]
        if blk is not None:
            res = compute(blk, inputs.pop(s, None))
            if res is not None:
                results[s] = res
    finish(pending)
    if steps:
        finish(exchange(result_messages(steps[-1], world, backward, split)))


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------
def _docs_of(docs, blk, n, rank):
    """Global rows of a block (contiguous layout: rank r holds [r*n, (r+1)*n)) for packed documents."""
    if docs is None:
        return None
    r = blk.q_rows(n) if blk is not None else slice(0, n)
    q_rank, kv_rank = (blk.q_rank, blk.kv_rank) if blk is not None else (rank, rank)
    return docs.block(torch.arange(q_rank * n + r.start, q_rank * n + r.stop),
                      torch.arange(kv_rank * n, (kv_rank + 1) * n))


def _empty_partial(q, ct):  # a helper's block the document mask removed: a no-op for the owner's merge
    return (torch.zeros_like(q), torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=ct,
                                            device=q.device))


def dist_flash_attn_forward(q, k, v, softmax_scale=None, group=None, backend=None, docs=None):
    """Causal attention of the contiguous local chunk -> (out in q's dtype, lse float32 (B, Hq, L)).
    ``docs``: packed documents of the whole sequence; blocks the mask removes are not computed (the
    schedule's messages still flow: a skipped helper block sends an empty partial)."""
    rank, world = group_rank_world(group)
    scale = _scale(q, softmax_scale)
    if docs is not None and docs.dispatch is not None:  # packed rows in cost-balanced chunks (dispatch/ring.py)
        from ..dispatch.ring import dispatch_forward
        return dispatch_forward(q, k, v, scale, group, backend, docs)
    if world == 1:
        return kernels.attn_forward(q, k, v, True, scale, backend, docs=_docs_of(docs, None, q.shape[1], rank))
    ct = _acc_dtype(q)
    b, n, hq, _ = q.shape
    split = n >= 2  # the last step's blocks are shared by row halves (schedule.py)
    plans = all_plans(world, split)
    acc = {}

    def rows(m, who):  # the q rows of message m's block, as run by rank ``who``
        return plans[who][m.step].q_rows(n)

    def diag():  # runs while the first exchange is in flight (every row sees itself: never empty)
        o0, l0 = kernels.attn_forward(q, k, v, True, scale, backend, docs=_docs_of(docs, None, n, rank))
        acc.update(out=o0.to(ct), lse=l0.to(ct, copy=True))

    def payload(m, results):
        if m.kind == "kv":
            return (k, v)
        if m.kind == "q":
            return (q[:, rows(m, m.dst)],)
        return results.pop(m.step)  # helper's (out, lse)

    def alloc(m):
        if m.kind == "kv":
            return (_buf(k), _buf(v))
        r = rows(m, rank if m.kind == "q" else m.src)
        if m.kind == "q":
            return (_buf(q[:, r]),)
        return (_buf(q[:, r]), torch.empty((b, hq, r.stop - r.start), dtype=ct, device=q.device))

    def compute(blk, got):
        if blk.role(rank) == "own":  # my queries vs an earlier rank's kv: merge locally
            r = blk.q_rows(n)
            res = kernels.attn_forward(q[:, r], got[0], got[1], False, scale, backend, docs=_docs_of(docs, blk, n, rank))
            if res is not None:
                kernels.merge_attn_out(acc["out"][:, r], acc["lse"][:, :, r], *res)
            return None
        # helper: their q, my kv
        res = kernels.attn_forward(got[0], k, v, False, scale, backend, docs=_docs_of(docs, blk, n, rank))
        return _empty_partial(got[0], ct) if res is None else (res[0], res[1].to(ct))

    def consume(m, bufs):  # a helper's partial result for (some rows of) my queries
        r = rows(m, m.src)
        kernels.merge_attn_out(acc["out"][:, r], acc["lse"][:, :, r], bufs[0], bufs[1])

    _run(rank, world, group, split, list(range(1, num_steps(world))), False, payload, alloc,
         diag, compute, consume)
    return acc["out"].to(q.dtype), acc["lse"]


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------
def dist_flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=None, group=None, backend=None, docs=None):
    """Gradients from the saved q, k, v and the *final* out/lse; the forward schedule in reverse order.

    Owners compute dq for their queries and dk/dv for the remote kv (sent back to its owner); helpers
    compute dq for the owner's queries (sent back) and dk/dv for their own kv (kept).
    """
    rank, world = group_rank_world(group)
    scale = _scale(q, softmax_scale)
    dout = dout.contiguous()
    if docs is not None and docs.dispatch is not None:
        from ..dispatch.ring import dispatch_backward
        return dispatch_backward(dout, q, k, v, out, lse, scale, group, backend, docs)
    if world == 1:
        return kernels.attn_backward(dout, q, k, v, out, lse, True, scale, backend,
                                     docs=_docs_of(docs, None, q.shape[1], rank))
    n = q.shape[1]
    split = n >= 2
    plans = all_plans(world, split)
    acc = {}

    def rows(m, who):
        return plans[who][m.step].q_rows(n)

    def diag():
        dq, dk, dv = kernels.attn_backward(dout, q, k, v, out, lse, True, scale, backend,
                                           docs=_docs_of(docs, None, n, rank))
        ct = _acc_dtype(q)
        acc.update(dq=dq.to(ct), dk=dk.to(ct), dv=dv.to(ct))

    def payload(m, results):
        if m.kind == "kv":
            return (k, v)
        if m.kind == "q_do_o_lse":
            r = rows(m, m.dst)
            return (q[:, r], dout[:, r], out[:, r], lse[:, :, r])
        return results.pop(m.step)

    def alloc(m):
        if m.kind in ("kv", "dkv"):
            return (_buf(k), _buf(v))
        if m.kind == "q_do_o_lse":
            r = rows(m, rank)
            return (_buf(q[:, r]), _buf(dout[:, r]), _buf(out[:, r]), _buf(lse[:, :, r]))
        return (_buf(q[:, rows(m, m.src)]),)  # dq

    def compute(blk, got):
        if blk.role(rank) == "own":
            r = blk.q_rows(n)
            res = kernels.attn_backward(dout[:, r], q[:, r], got[0], got[1], out[:, r], lse[:, :, r],
                                        False, scale, backend, docs=_docs_of(docs, blk, n, rank))
            if res is None:  # masked out: the kv owner still expects its (zero) grads
                return (torch.zeros_like(got[0]), torch.zeros_like(got[1]))
            acc["dq"][:, r] += res[0]
            return res[1:]  # belongs to the kv owner
        res = kernels.attn_backward(got[1], got[0], k, v, got[2], got[3], False, scale, backend,
                                    docs=_docs_of(docs, blk, n, rank))
        if res is None:
            return (torch.zeros_like(got[0]),)
        acc["dk"] += res[1]
        acc["dv"] += res[2]
        return (res[0],)  # belongs to the query owner

    def consume(m, bufs):
        if m.kind == "dkv":
            acc["dk"] += bufs[0]
            acc["dv"] += bufs[1]
        else:
            acc["dq"][:, rows(m, m.src)] += bufs[0]

    _run(rank, world, group, split, list(range(num_steps(world) - 1, 0, -1)), True, payload, alloc,
         diag, compute, consume)
    return acc["dq"].to(q.dtype), acc["dk"].to(k.dtype), acc["dv"].to(v.dtype)


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------
def _forward_cached(q, k, v, softmax_scale, group, backend, docs=None):
    # Under selective checkpointing the layer's recomputation gets the stored (out, lse) back instead of
    # running (and communicating) the distributed forward again — LightSeq's rematerialisation-aware
    # checkpointing; see easy_context/memory/selective.py.
    return cached_attention(lambda: dist_flash_attn_forward(q, k, v, softmax_scale, group, backend, docs))


class DistFlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, group, backend, docs=None, sinks=None):
        out, lse = kernels.fold_sinks(*_forward_cached(q, k, v, softmax_scale, group, backend, docs), sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.softmax_scale, ctx.group, ctx.backend, ctx.docs = softmax_scale, group, backend, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = dist_flash_attn_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.group,
                                              ctx.backend, ctx.docs)
        dsinks = None if sinks is None else kernels.sinks_grad(dout, out, lse, sinks)
        return dq, dk, dv, None, None, None, None, dsinks


def dist_flash_attn(q, k, v, softmax_scale=None, group=None, backend=None, docs=None, sinks=None):
    """Differentiable when grads are needed; a plain forward otherwise (inference_mode, no_grad)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return DistFlashAttnFunc.apply(q, k, v, softmax_scale, group, backend, docs, sinks)
    return kernels.fold_sinks(*_forward_cached(q, k, v, softmax_scale, group, backend, docs), sinks)[0]
