"""Zigzag ring attention: causal attention over a sequence split in zigzag order across a ring of W ranks.

Idea from ring-flash-attention's zigzag_ring_flash_attn (zhuzilin) and the load-balancing argument of
Striped/zigzag attention; written here on the kernel facade, no code copied.

Layout legend (flash-attn's): q/out/dq ``(B, 2c, Hq, D)``, k/v/dk/dv ``(B, 2c, Hkv, D)``, lse fp32
``(B, Hq, 2c)``. The global sequence is cut into 2W chunks of length c; rank r holds chunks r and
2W-1-r (local chunk 0 and local chunk 1). k/v travel the ring r -> r+1, so at step s rank r holds the
k/v of ``src = (r - s) % W``. Which part of that block the causal mask needs (see ``block_plan``)::

    step 0 (own k/v)     causal on the local pair: [r, 2W-1-r] x [r, 2W-1-r]
    src < r              both q chunks vs kv chunk ``src`` (earlier than both); kv chunk 2W-1-src is
                         later than both q chunks -> skipped.                        non-causal, 2c x c
    src > r              only q chunk 2W-1-r, against both kv chunks (src and 2W-1-src are both
                         earlier); q chunk r is earlier than both -> skipped.         non-causal, c x 2c

Every step is 2c^2 score elements on every rank: the causal work is balanced with no padding.

Packed documents (``docs``) of a row long enough use the finer k-pair layout (sharding.py: 2Wk chunks, rank r
holds the mirrored pairs {i, 2Wk-1-i : i mod W == r}; k = ``docs.pairs(W)``, from (L, W) only, 1 for rows
without restarts, which keep the plan above unchanged). A ring step then hands the facade the whole local q
against the whole visiting k/v as one ``BlockDocs``: it walks every (q chunk run, kv chunk run) pair, computes
the diagonal runs and the kv runs before the q runs that share a document, and skips the rest (no kernel call).

Forward: the next k/v is posted (``RingComm``) before the current block is computed, so the transfer
overlaps with compute; partial (out, lse) fold into float32 accumulators with ``kernels.merge_attn_out``.
Backward: the final out/lse of each row make every block's (dq, dk, dv) an exact contribution
(``kernels.attn_backward``). dq stays local; k/v ring again; the float32 dk/dv of the block a rank is
visiting travel on a second ring one step behind, so after W steps each rank holds its own k/v's grads.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from .. import kernels
from ..attention_cache import cached_attention
from ..comm import RingComm, group_rank_world
from ..sharding import pairs_indices


class RingBlock(NamedTuple):
    """One ring step of one rank: local q chunks (0 and/or 1) against the visiting rank's kv chunks."""
    step: int
    src: int                      # group rank whose k/v is used at this step
    q_chunks: tuple[int, ...]     # local chunk indices of q: (0, 1) or (1,)
    kv_chunks: tuple[int, ...]    # local chunk indices of src's k/v: (0, 1) or (0,)
    causal: bool

    def q_slice(self, c: int) -> slice:
        return slice(self.q_chunks[0] * c, (self.q_chunks[-1] + 1) * c)

    def kv_slice(self, c: int) -> slice:
        return slice(self.kv_chunks[0] * c, (self.kv_chunks[-1] + 1) * c)


def global_chunks(rank: int, world_size: int) -> tuple[int, int]:
    """Global chunk ids (of 2W) held by ``rank``: local chunk 0 is ``rank``, local chunk 1 is 2W-1-rank."""
    return rank, 2 * world_size - 1 - rank


def block_plan(rank: int, world_size: int) -> list[RingBlock]:
    """The W blocks ``rank`` computes, in ring order (pure: used by the kernel, benchmarks and tests)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"block_plan needs 0 <= rank < world_size; got rank={rank}, world_size={world_size}")
    plan = [RingBlock(0, rank, (0, 1), (0, 1), True)]
    for s in range(1, world_size):
        src = (rank - s) % world_size
        if src < rank:
            plan.append(RingBlock(s, src, (0, 1), (0,), False))
        else:
            plan.append(RingBlock(s, src, (1,), (0, 1), False))
    return plan


# ----------------------------------------------------------------------------------------------
# validation (before any collective, so a bad call fails on every rank alike instead of hanging)
# ----------------------------------------------------------------------------------------------
def check_inputs(q, k, v, dropout_p: float, causal: bool) -> None:
    if not causal:
        raise ValueError("zigzag_ring_attn_func supports only causal=True: the zigzag layout exists to balance "
                         "the causal mask; for non-causal attention use ulysses_attn_func (contiguous layout)")
    if dropout_p and dropout_p > 0:
        raise ValueError(f"zigzag_ring_attn_func does not support attention dropout (got dropout_p={dropout_p}); "
                         "pass dropout_p=0.0 (set config.attention_dropout=0.0)")
    kernels.check_qkv(q, k, v, "zigzag_ring_attn_func", local=True)
    if q.shape[1] % 2 != 0 or q.shape[1] == 0:
        raise ValueError(f"zigzag_ring_attn_func: the local length ({q.shape[1]}) must be even and > 0 (each "
                         "rank holds two equal zigzag chunks); make the global length a multiple of "
                         "2 x world_size and shard it with shard_sequence('zigzag_ring_attn', ...)")


# ----------------------------------------------------------------------------------------------
# forward / backward
# ----------------------------------------------------------------------------------------------
def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulators are float32 (float64 inputs, the test reference, keep float64)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _ring_position(group) -> tuple[int, int]:
    rank, world = group_rank_world(group)
    if rank < 0:
        raise ValueError("zigzag_ring_attn: this process is not a member of the given process group; "
                         "call it only on the ranks of `group` (or pass group=None for the world)")
    return rank, world


def _block_docs(docs, rank, src, world, c, blk):
    """The block's rows as global indices (packed documents), or None for a dense block."""
    if docs is None:
        return None
    n = 2 * c * world
    return docs.block(_rows(n, rank, world, 1)[blk.q_slice(c)], _rows(n, src, world, 1)[blk.kv_slice(c)])


class Step(NamedTuple):
    """One ring step as the kernels see it: q rows ``qs`` of this rank vs kv rows ``ks`` of rank ``src``."""
    step: int
    src: int
    qs: slice
    ks: slice
    causal: bool
    docs: object  # packing.BlockDocs, or None for a dense block


def ring_steps(rank: int, world: int, local_len: int, docs=None, pairs: int | None = None) -> list[Step]:
    """The W steps ``rank`` runs (pure: the ring, benchmarks and tests share it). Dense rows and k = 1: the zigzag
    ``block_plan``; packed rows in the k-pair layout: the whole local q vs the whole visiting kv, the document
    pieces deciding what is computed. ``pairs``: force k (benchmarks comparing layouts; needs ``docs``)."""
    if pairs is None:
        pairs = 1 if docs is None else docs.pairs(world)
    if pairs == 1:
        c = local_len // 2
        return [Step(b.step, b.src, b.q_slice(c), b.kv_slice(c), b.causal, _block_docs(docs, rank, b.src, world, c, b))
                for b in block_plan(rank, world)]
    n, every = local_len * world, slice(None)
    return [Step(s, (rank - s) % world, every, every, True,
                 docs.block(_rows(n, rank, world, pairs), _rows(n, (rank - s) % world, world, pairs)))
            for s in range(world)]


@lru_cache(maxsize=64)
def _rows(n: int, rank: int, world: int, pairs: int) -> torch.Tensor:
    """A rank's global row indices (asked for by every layer and ring step; never modified)."""
    return pairs_indices(n, rank, world, pairs)


def _check_docs(docs, q, world) -> None:
    if docs is not None and docs.length != q.shape[1] * world:
        raise ValueError(f"zigzag_ring_attn: docs describe a sequence of {docs.length} tokens but {world} ranks hold "
                         f"{q.shape[1]} each ({q.shape[1] * world}); build them from the global position ids")


def zigzag_ring_forward(q, k, v, softmax_scale: float, group=None, backend: str | None = None, docs=None):
    """Returns ``out`` (q's dtype) and ``lse`` (fp32, (B, Hq, 2c)) of this rank's rows.

    ``docs`` (``packing.Documents`` of the global sequence): causal within packed documents; ring steps whose
    kv rows all lie in documents that ended before this rank's q rows start compute nothing (no kernel, no merge).
    """
    rank, world = _ring_position(group)
    _check_docs(docs, q, world)
    if docs is not None and docs.dispatch is not None:  # packed rows in cost-balanced chunks (dispatch/ring.py)
        from ..dispatch.ring import dispatch_forward
        return dispatch_forward(q, k, v, softmax_scale, group, backend, docs)
    if world == 1:
        if docs is not None:
            idx = torch.arange(q.shape[1])
            return kernels.attn_forward(q, k, v, True, softmax_scale, backend, docs=docs.block(idx, idx))
        return kernels.attn_forward(q, k, v, True, softmax_scale, backend)
    comm = RingComm(group)
    out = lse = None
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for blk in ring_steps(rank, world, q.shape[1], docs):
        last = blk.step == world - 1
        if not last:  # post the next k/v before computing on the current one (overlap)
            k_next, v_next = comm.send_recv(k_cur), comm.send_recv(v_cur)
            comm.commit()
        qs, ks = blk.qs, blk.ks
        res = kernels.attn_forward(q[:, qs], k_cur[:, ks], v_cur[:, ks], blk.causal, softmax_scale, backend,
                                   docs=blk.docs)
        if res is None:
            pass  # packed documents: the mask removes this whole block
        elif out is None:  # step 0 covers every row (the diagonal): it initialises the fp32 accumulators
            out, lse = res[0].to(_acc_dtype(q)), res[1].to(_acc_dtype(q)).contiguous()
        else:  # in place into the rows this block touched
            kernels.merge_attn_out(out[:, qs], lse[:, :, qs], *res)
        if not last:
            comm.wait()
            k_cur, v_cur = k_next, v_next
    return out.to(q.dtype), lse


def zigzag_ring_backward(dout, q, k, v, out, lse, softmax_scale: float, group=None, backend: str | None = None,
                         docs=None):
    """(dq, dk, dv) of this rank's q and own k/v, from the saved inputs and the final out/lse."""
    rank, world = _ring_position(group)
    _check_docs(docs, q, world)
    if docs is not None and docs.dispatch is not None:
        from ..dispatch.ring import dispatch_backward
        return dispatch_backward(dout, q, k, v, out, lse, softmax_scale, group, backend, docs)
    if world == 1:
        if docs is not None:
            idx = torch.arange(q.shape[1])
            return kernels.attn_backward(dout, q, k, v, out, lse, True, softmax_scale, backend,
                                         docs=docs.block(idx, idx))
        return kernels.attn_backward(dout, q, k, v, out, lse, True, softmax_scale, backend)
    kv_comm, d_comm = RingComm(group), RingComm(group)
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dk_next = dv_next = None
    for blk in ring_steps(rank, world, q.shape[1], docs):
        last = blk.step == world - 1
        if not last:
            k_next, v_next = kv_comm.send_recv(k_cur), kv_comm.send_recv(v_cur)
            kv_comm.commit()
        qs, ks = blk.qs, blk.ks
        res = kernels.attn_backward(dout[:, qs], q[:, qs], k_cur[:, ks], v_cur[:, ks], out[:, qs], lse[:, :, qs],
                                    blk.causal, softmax_scale, backend, docs=blk.docs)
        if res is not None:
            dq[:, qs] += res[0]
        if blk.step == 0:
            dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:  # the grads of block ``src`` from the ranks it visited before (sent one step ago)
            d_comm.wait()
            dk_acc, dv_acc = dk_next, dv_next
        if res is not None:  # (a block the document mask removes adds nothing; the grads still travel on)
            dk_acc[:, ks] += res[1]
            dv_acc[:, ks] += res[2]
        # pass them on; after the last step this delivers each block's grads back to its owner
        dk_next, dv_next = d_comm.send_recv(dk_acc), d_comm.send_recv(dv_acc)
        d_comm.commit()
        if not last:
            kv_comm.wait()
            k_cur, v_cur = k_next, v_next
    d_comm.wait()
    return dq.to(q.dtype), dk_next.to(k.dtype), dv_next.to(v.dtype)


class ZigzagRingAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, group, backend, docs=None, sinks=None):
        # Under selective checkpointing the layer's recomputation gets (out, lse) back from the cache
        # (no ring traffic) and saves the recomputed q, k, v with them: only out + lse are kept per layer.
        out, lse = cached_attention(lambda: zigzag_ring_forward(q, k, v, softmax_scale, group, backend, docs))
        out, lse = kernels.fold_sinks(out, lse, sinks)  # once per row, after the ring's merge
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.softmax_scale, ctx.group, ctx.backend, ctx.docs = softmax_scale, group, backend, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = zigzag_ring_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.group, ctx.backend,
                                          ctx.docs)
        dsinks = None if sinks is None else kernels.sinks_grad(dout, out, lse, sinks)
        return dq, dk, dv, None, None, None, None, dsinks
