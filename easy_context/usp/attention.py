"""USP: Ulysses all-to-all inside the Ulysses group, zigzag ring attention over the ring group.

The hybrid of yunchang's LongContextAttention (Fang & Zhao, "USP: A Unified Sequence Parallelism Approach
for Long Context Generative AI", 2024), written on our own pieces: the packed all-to-all of
``ulysses_attn`` and the zigzag ring of ``zigzag_ring_attn``. Shapes (R ring x U Ulysses ranks):

    q_BSlHD (B, S/(R*U), Hq, D)  --all-to-all in ulysses_group-->  (B, S/R, Hq/U, D)
        the gathered S/R tokens are exactly this ring rank's zigzag pair (chunks r, 2R-1-r of 2R; for packed
        rows its k mirrored pairs of 2Rk chunks, which the ring reads off ``docs.pairs(R)``, see sharding.py)
    zigzag ring over ring_group on those heads                -->  out (B, S/R, Hq/U, D), lse
    --all-to-all back-->  out (B, S/(R*U), Hq, D)

Layout (usp/cut.py): sp rank = ring_rank * U + ulysses_rank. kv heads are replicated inside the
Ulysses group exactly as in ulysses_attn (U > kv heads works); the ring carries the (few) kv heads.
"""
from __future__ import annotations

import math

import torch

from ..comm import group_rank_world
from ..ulysses_attn.attention import check_inputs as check_ulysses, heads_to_seq, reduce_kv_grad
from ..ulysses_attn.attention import head_parallel_forward, seq_to_heads, sinks_grad
from ..zigzag_ring_attn.attention import zigzag_ring_backward, zigzag_ring_forward

_NO_ULYSSES = None  # with U == 1 the all-to-alls are skipped, so the group is never used


def resolve_groups(ring_group, ulysses_group):
    """-> (ring_group, R, U, ulysses_group). None means the world group (as everywhere), except that both
    None means a ring over the world and no Ulysses split (usp/cut.py's ring_degree=None default)."""
    if ring_group is None and ulysses_group is None:
        return None, group_rank_world(None)[1], 1, _NO_ULYSSES
    return ring_group, group_rank_world(ring_group)[1], group_rank_world(ulysses_group)[1], ulysses_group


def check_inputs(q, k, v, dropout_p, causal, ring: int, ulysses: int) -> int:
    """Validate before any collective; returns the kv replication inside the Ulysses group."""
    if not causal:
        raise ValueError("usp_attn_func supports only causal=True (its ring is zigzag, which exists to balance the "
                         "causal mask); for non-causal attention use ulysses_attn_func")
    rep = check_ulysses(q, k, v, dropout_p, ulysses, what=f"usp_attn (ring {ring} x ulysses {ulysses})")
    if ring > 1 and (q.shape[1] * ulysses) % 2 != 0:
        raise ValueError(f"usp_attn_func: the ring rank's sequence ({q.shape[1]} x {ulysses} tokens) must be even "
                         f"(two zigzag chunks); make the global length a multiple of 2 x {ring} x {ulysses} and "
                         "shard it with shard_sequence('usp_attn', ..., ring_degree=R)")
    return rep


def usp_forward(q, k, v, softmax_scale, rep, ring_group, ulysses, ulysses_group, docs=None, sinks=None):
    # all-to-all (B, S/(RU), H, D) -> this ring rank's zigzag pair (B, S/R, H/U, D), the zigzag ring over the
    # ring group on those heads, all-to-all back (selective-checkpoint aware: the ring is never rerun)
    return head_parallel_forward(q, k, v, rep, ulysses, ulysses_group, lambda qh, kh, vh: zigzag_ring_forward(
        qh, kh, vh, softmax_scale, ring_group, docs=docs), sinks)


def usp_backward(dout, saved, softmax_scale, rep, ring_group, ulysses, ulysses_group, docs=None, sinks=None):
    qh, kh, vh, outh, lse = saved
    (douth,) = seq_to_heads([dout], ulysses, ulysses_group)
    dqh, dkh, dvh = zigzag_ring_backward(douth, qh, kh, vh, outh, lse, softmax_scale, ring_group, docs=docs)
    dq, dk, dv = heads_to_seq([dqh, dkh, dvh], ulysses, ulysses_group)
    dsinks = sinks_grad(douth, saved, sinks, ulysses, ulysses_group)
    return dq, reduce_kv_grad(dk, rep), reduce_kv_grad(dv, rep), dsinks


class UspAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, rep, ring_group, ulysses, ulysses_group, docs=None, sinks=None):
        out, saved = usp_forward(q, k, v, softmax_scale, rep, ring_group, ulysses, ulysses_group, docs, sinks)
        ctx.save_for_backward(*saved, sinks)
        ctx.args = (softmax_scale, rep, ring_group, ulysses, ulysses_group, docs)
        return out

    @staticmethod
    def backward(ctx, dout):
        *saved, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = usp_backward(dout, saved, *ctx.args, sinks=sinks)
        return dq, dk, dv, None, None, None, None, None, None, dsinks


def usp_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, ring_group=None, ulysses_group=None,
             docs=None, sinks=None):
    """Validated entry point (see ``easy_context.usp.usp_attn_func``)."""
    ring_group, ring, ulysses, ulysses_group = resolve_groups(ring_group, ulysses_group)
    rep = check_inputs(q, k, v, dropout_p, causal, ring, ulysses)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return UspAttnFunc.apply(q, k, v, float(softmax_scale), rep, ring_group, ulysses, ulysses_group, docs, sinks)
