"""Ulysses attention: all-to-all from sequence shards to head shards, full attention, all-to-all back.

Idea from DeepSpeed-Ulysses (Jacobs et al. 2023) and yunchang; the kv-head replication for W > kv heads
follows DeepSpeed's ALST / Arctic long-sequence training. Shapes (W = size of ``group``):

    q_BSlHD   (B, S/W, Hq,  D)  --all-to-all-->  q_BSHlD   (B, S, Hq/W,  D)
    k_BSlKD   (B, S/W, Hkv, D)  --replicate x rep, all-to-all-->  (B, S, Hkv*rep/W, D)
    out_BSHlD (B, S, Hq/W, D)   --all-to-all-->  out_BSlHD (B, S/W, Hq, D)

Rank r owns q heads [r*Hq/W, (r+1)*Hq/W). GQA: when W does not divide Hkv, each kv head is repeated
``rep = W / gcd(Hkv, W)`` times, the smallest count that makes the kv heads split evenly *and* lines each
rank's kv heads up with its q heads (rank r gets exactly the kv heads its q heads read). Llama-3's 8 kv
heads on 16 ranks: rep 2, one kv head per rank. Gradients of the replicas are summed back.

q, k and v travel in ONE all-to-all (packed per destination rank along the head dim), and dq, dk, dv in one
on the way back: three collectives' latency becomes one.
"""
from __future__ import annotations

import math

import torch

from .. import kernels
from ..attention_cache import cached_attention
from ..comm import all_to_all_4d, group_rank_world


# ----------------------------------------------------------------------------------------------
# validation (pure logic: runs before any collective)
# ----------------------------------------------------------------------------------------------
def largest_valid_degree(num_heads: int, degree: int) -> int:
    """The largest Ulysses degree <= ``degree`` that divides ``num_heads``."""
    return max(d for d in range(1, max(1, min(degree, num_heads)) + 1) if num_heads % d == 0)


def kv_replication(num_q_heads: int, num_kv_heads: int, world: int, what: str = "ulysses_attn") -> int:
    """How often each kv head is repeated so ``world`` ranks split q and kv heads consistently.

    Raises ValueError (with the fix) when the q heads do not split over ``world`` ranks.
    """
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{what}: q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if num_q_heads % world != 0:
        raise ValueError(
            f"{what}: {num_q_heads} q heads cannot be split over a Ulysses degree of {world}; the degree must "
            f"divide the q heads: the largest valid one <= {world} is {largest_valid_degree(num_q_heads, world)} "
            "(use fewer Ulysses ranks, or usp_attn with a ring degree taking the rest)")
    return world // math.gcd(num_kv_heads, world)


def check_inputs(q, k, v, dropout_p: float, world: int, what: str = "ulysses_attn",
                 causal: bool | None = None) -> int:
    """Validate local shards for a Ulysses all-to-all over ``world`` ranks; returns the kv replication."""
    if dropout_p:
        raise ValueError(f"{what}: attention dropout is not supported (got dropout_p={dropout_p}); "
                         "set config.attention_dropout=0.0")
    if causal is False:
        raise ValueError(f"{what}: causal=False is not supported; sequence-parallel training of causal LMs "
                         "needs causal=True (use ulysses_attn for non-causal attention)")
    kernels.check_qkv(q, k, v, what, local=True)
    return kv_replication(q.shape[2], k.shape[2], world, what)


# ----------------------------------------------------------------------------------------------
# the packed all-to-alls
# ----------------------------------------------------------------------------------------------
def _per_rank(x, world):
    """(B, L, H, D) -> (B, L, W, H/W, D): the heads each rank receives, side by side."""
    b, l, h, d = x.shape
    return x.reshape(b, l, world, h // world, d)


def seq_to_heads(tensors, world: int, group=None):
    """Sequence shards -> head shards for several (B, S/W, H_i, D) tensors in one all-to-all.

    Returns the list of (B, S, H_i/W, D) tensors (full sequence, this rank's heads)."""
    if world == 1:
        return list(tensors)
    widths = [t.shape[2] // world for t in tensors]
    packed = torch.cat([_per_rank(t, world) for t in tensors], dim=3).flatten(2, 3)
    full = all_to_all_4d(packed, scatter_dim=2, gather_dim=1, group=group)  # (B, S, sum(H_i)/W, D)
    return list(full.split(widths, dim=2))


def heads_to_seq(tensors, world: int, group=None):
    """Head shards -> sequence shards for several (B, S, h_i, D) tensors in one all-to-all.

    Returns the list of (B, S/W, h_i*W, D) tensors (local sequence, all heads in rank order)."""
    if world == 1:
        return list(tensors)
    widths = [t.shape[2] for t in tensors]
    packed = torch.cat(list(tensors), dim=2)
    local = all_to_all_4d(packed, scatter_dim=1, gather_dim=2, group=group)  # (B, S/W, W*sum(h_i), D)
    b, l, _, d = local.shape
    local = local.reshape(b, l, world, sum(widths), d)
    return [t.reshape(b, l, world * w, d) for t, w in zip(local.split(widths, dim=3), widths)]


def replicate_kv(k, rep: int):
    """Repeat each kv head ``rep`` times (head i -> heads i*rep .. i*rep+rep-1)."""
    return k if rep == 1 else k.repeat_interleave(rep, dim=2)


def reduce_kv_grad(dk, rep: int):
    """Sum the gradients of the replicas made by ``replicate_kv``."""
    if rep == 1:
        return dk
    b, l, h, d = dk.shape
    return dk.reshape(b, l, h // rep, rep, d).sum(3)


# ----------------------------------------------------------------------------------------------
# forward / backward / autograd.Function
# ----------------------------------------------------------------------------------------------
def head_parallel_forward(q, k, v, rep, world, group, attend, sinks=None):
    """Ulysses around ``attend(qh, kh, vh) -> (outh, lse)``; returns out and what the backward needs.
    ``sinks`` (Hq,): folded into this rank's heads after ``attend`` (kernels.fold_sinks).

    Selective checkpointing (memory/selective.py) keeps only (outh, lse): in the layer's recomputation the
    recomputed q/k/v are re-sharded (one all-to-all) but ``attend`` — the expensive, possibly ring-
    distributed attention — is not run again.
    """
    fresh = []

    def compute():
        # 1. one all-to-all: sequence shards of q/k/v -> this rank's heads over the full sequence
        fresh.append(seq_to_heads([q, replicate_kv(k, rep), replicate_kv(v, rep)], world, group))
        # 2. full-sequence attention on those heads
        return attend(*fresh[0])

    outh, lse = kernels.fold_sinks(*cached_attention(compute), head_slice(sinks, world, group))
    qkv = fresh[0] if fresh else seq_to_heads([q, replicate_kv(k, rep), replicate_kv(v, rep)], world, group)
    # 3. back to sequence shards
    (out,) = heads_to_seq([outh], world, group)
    return out, (*qkv, outh, lse)


def _full_docs(docs, length):
    """The gathered sequence is the whole sequence in order: one diagonal block over global 0..L-1."""
    if docs is None:
        return None
    idx = torch.arange(length)
    return docs.block(idx, idx)


def head_slice(sinks, world, group):
    """The sinks of the q heads this rank holds after ``seq_to_heads`` (None: no sinks)."""
    return kernels.head_slice(sinks, world, group_rank_world(group)[0] if world > 1 else 0)


def sinks_grad(douth, saved, sinks, world, group):
    """(Hq,) gradient of the sinks from this rank's heads (zeros elsewhere; summed over ranks like any weight)."""
    if sinks is None:
        return None
    _, _, _, outh, lse = saved
    g = kernels.sinks_grad(douth, outh, lse, head_slice(sinks, world, group))
    return kernels.head_scatter(g, sinks, world, group_rank_world(group)[0] if world > 1 else 0)


def ulysses_forward(q, k, v, causal, softmax_scale, rep, world, group=None, docs=None, sinks=None):
    """Returns out (B, S/W, Hq, D) and what the backward needs (head-sharded q/k/v/out and lse).
    ``docs``: packed documents of the sequence (causal within each one)."""
    return head_parallel_forward(q, k, v, rep, world, group, lambda qh, kh, vh: kernels.attn_forward(
        qh, kh, vh, causal=causal, softmax_scale=softmax_scale, docs=_full_docs(docs, qh.shape[1])), sinks)


def ulysses_backward(dout, saved, causal, softmax_scale, rep, world, group=None, docs=None, sinks=None):
    """(dq, dk, dv, dsinks) of this rank's shards (dsinks None without sinks)."""
    qh, kh, vh, outh, lse = saved
    # 1. dout to head shards, 2. the kernel's backward on this rank's heads (grads of replicas included)
    (douth,) = seq_to_heads([dout], world, group)
    dqh, dkh, dvh = kernels.attn_backward(douth, qh, kh, vh, outh, lse, causal=causal,
                                          softmax_scale=softmax_scale, docs=_full_docs(docs, qh.shape[1]))
    # 3. one all-to-all back to sequence shards; 4. sum the replicas' kv grads
    dq, dk, dv = heads_to_seq([dqh, dkh, dvh], world, group)
    return dq, reduce_kv_grad(dk, rep), reduce_kv_grad(dv, rep), sinks_grad(douth, saved, sinks, world, group)


class UlyssesAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, rep, group, docs=None, sinks=None):
        _, world = group_rank_world(group)
        out, saved = ulysses_forward(q, k, v, causal, softmax_scale, rep, world, group, docs, sinks)
        ctx.save_for_backward(*saved, sinks)
        ctx.args = (causal, softmax_scale, rep, world, group, docs)
        return out

    @staticmethod
    def backward(ctx, dout):
        *saved, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = ulysses_backward(dout, saved, *ctx.args, sinks=sinks)
        return dq, dk, dv, None, None, None, None, None, dsinks


def ulysses_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, group=None, docs=None, sinks=None):
    """Validated entry point (see ``easy_context.ulysses_attn.ulysses_attn_func``)."""
    _, world = group_rank_world(group)
    rep = check_inputs(q, k, v, dropout_p, world)
    if docs is not None and not causal:
        raise ValueError("ulysses_attn_func: packed documents (docs=) are causal within each document; "
                         "pass causal=True")
    return UlyssesAttnFunc.apply(q, k, v, bool(causal), softmax_scale, rep, group, docs, sinks)
