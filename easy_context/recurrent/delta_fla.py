"""The gated delta rule's parallel pass as ONE autograd Function on flash-linear-attention's building blocks
(delta_kernels.FlaKernels holds them): the WY tensors (w, u) are made once and shared by the state-only pre-pass and
the kernel pass, and the backward recomputes them once for the adjoint and the kernel backward alike.

Forward:  cumsum(g) -> WY (w, u, A) -> (R, P) of every sequence in one launch -> state_in (exchange + composition,
          delta_parallel.py) -> state scan from the true incoming states -> outputs
Backward: recompute w, u -> state scan -> local dv -> D of every piece-first sequence (the adjoint) -> grad_out
          (exchange + reverse composition) -> state-gradient scan from each sequence's d(final state) -> dq, dk, dw,
          dg -> WY backward
The same order as fla's own context-parallel chunk_gated_delta_rule (fla/ops/gated_delta_rule/chunk.py with a
cp_context), whose pre-process runs inside its forward on the w, u it already has; here the pieces are any
sequences of the varlen row (contiguous, zigzag, k-pairs, the time-balanced dispatch, USP), composed by the caller.
The incoming states are constants of the kernel pass: their gradient reaches earlier pieces through ``grad_out``.
"""
from __future__ import annotations

import torch


class FlaPieces(torch.autograd.Function):
    """(q, k, v, g, beta) of one varlen row (q, k normalised) -> outputs (N, H, dv); ``info`` = (kern, cu, lasts,
    firsts, state_in, grad_out): state_in(R, P) -> h0 (n, H, dk, dv) float32 from the summaries of the sequences
    ``lasts``; grad_out(D) -> d(final state) (n, H, dk, dv) from the adjoints of the sequences ``firsts``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, info):
        kern, cu, lasts, _, state_in, _ = info
        c, scale = kern.cp, k.shape[-1] ** -0.5
        cu_t, idx = kern.geometry(cu, k.device)
        q4, k4, v4, b4 = q[None], k[None], v[None], beta[None]
        gc, w, u, A = kern.wy(k4, v4, g[None], b4, cu_t, idx)
        with torch.no_grad():
            hm = kern.summaries(k4, w, u, gc, cu_t)
            dv = v.shape[-1]
            h0 = state_in([hm[j, ..., :dv] for j in lasts], [hm[j, ..., dv:] for j in lasts])
        del hm
        h, v_new, _ = c["fwd_h_full"](k=k4, w=w, u=u, g=gc, initial_state=h0, output_final_state=False,
                                      cu_seqlens=cu_t, chunk_indices=idx)
        o = c["fwd_o"](q=q4, k=k4, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu_t, chunk_indices=idx)
        ctx.save_for_backward(q, k, v, gc, beta, A, h0)
        ctx.info, ctx.geo = info, (cu_t, idx)
        return o[0].to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, gc, beta, A, h0 = ctx.saved_tensors
        kern, _, _, firsts, _, grad_out = ctx.info
        (cu_t, idx), c, scale = ctx.geo, kern.cp, k.shape[-1] ** -0.5
        q4, k4, v4, b4 = q[None], k[None], v[None], beta[None]
        do = do[None].to(q.dtype).contiguous()
        geo = dict(cu_seqlens=cu_t, chunk_indices=idx)
        w, u = c["recompute"](k=k4, v=v4, beta=b4, A=A, g=gc, **geo)
        h, v_new, _ = c["fwd_h_full"](k=k4, w=w, u=u, g=gc, initial_state=h0, output_final_state=False, **geo)
        dv = c["dv_local"](q=q4, k=k4, g=gc, do=do, scale=scale, **geo)
        D = kern.adjoints(q4, k4, w, do, dv, gc, cu_t, firsts)
        dht = grad_out(D)
        dh, _, dv = c["bwd_dhu"](q=q4, k=k4, w=w, g=gc, h0=h0, dht=dht, do=do, dv=dv, scale=scale, **geo)
        dq, dk, dw, dg = c["dqkwg"](q=q4, k=k4, v=v_new, w=w, g=gc, h=h, dv=dv, do=do, dh=dh, scale=scale, **geo)
        dk2, dv, db, dg2 = c["wy_bwd"](k=k4, v=v4, beta=b4, g=gc, A=A, dw=dw, du=dv, **geo)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = c["cumsum"](dg, chunk_size=A.shape[-1], reverse=True, **geo)
        return dq[0].to(q.dtype), dk[0].to(k.dtype), dv[0].to(v.dtype), dg[0].to(gc.dtype), db[0].to(beta.dtype), None


__all__ = ["FlaPieces"]
