"""The gated delta rule's parallel pass as ONE autograd Function on flash-linear-attention's building blocks
(delta_kernels.FlaKernels holds them): the WY tensors (w, u) are made once and shared by the state-only pre-pass and
the kernel pass, and the backward recomputes them once for the adjoint and the kernel backward alike.

fla's state scans (``chunk_gated_delta_rule_fwd_h`` / ``_bwd_dhu``) walk a sequence's chunks one after another in
one program per (head, value block): a long sequence leaves most of the GPU idle. So every sequence is cut further
into sub-sequences of ``SPAN`` tokens (longer where a row would get over ``MAX_SUBS``; chunk-aligned: the
chunk-local passes are unchanged), each summarised as S_out = P S_in + R like a piece, composed here, and scanned at
once (the idea of fla's intra-card context parallelism, fla/ops/common/intracard_cp.py, used here in training too).
The default with fla (``EASY_CONTEXT_DELTA_FUSED=0``: the separate passes), uncut (``SPAN`` 0) unless asked.

Forward:  cumsum(g), WY (w, u, A) -> [R | P] of every sub-sequence in one launch -> each sequence's (R, P) ->
          state_in (the caller's exchange + composition) -> each sub-sequence's incoming state -> state scan ->
          outputs
Backward: recompute w, u -> state scan -> local dv -> state-gradient scan from a zero final gradient: D (d(own
          outputs)/d(incoming state)) of every sub-sequence -> each sequence's D -> grad_out (the caller's exchange,
          reverse composition) -> each sub-sequence's d(final state) -> the state-gradient scan -> dq, dk, dw, dg ->
          WY backward
The incoming states are constants of the kernel pass: their gradient reaches earlier pieces through ``grad_out``.
"""
from __future__ import annotations

import os

import torch

SPAN_ENV = "EASY_CONTEXT_DELTA_SPAN"  # tokens per sub-sequence of the state scans (a multiple of 64; 0: no cut)
SPAN = 0  # no cut: a rank's pieces already scan side by side; a cut did not pay on the GPU (docs/hybrid.md)
MAX_SUBS = 32  # a longer row gets longer sub-sequences: the saved transitions stay at <= 32 x H x dk x dk


def _span(chunk, tokens):
    span = int(os.environ.get(SPAN_ENV, SPAN))
    if span % chunk:
        raise ValueError(f"{SPAN_ENV}={span}: must be a multiple of the chunk ({chunk} tokens), or 0 for no cut")
    return span and max(span, -(-tokens // (MAX_SUBS * chunk)) * chunk)


def sub_sequences(cu, span):
    """Every sequence of ``cu`` cut every ``span`` tokens from its start: (sub-sequence cu, the first sub-sequence of
    each sequence, how many it has)."""
    sub, first, count = [0], [], []
    for a, b in zip(cu, cu[1:]):
        edges = (list(range(a + span, b, span)) if span else []) + [b]
        first.append(len(sub) - 1)
        count.append(len(edges))
        sub += edges
    return sub, first, count


class _Subs:
    """Index helpers over one row's sub-sequences: ``at(t)`` = (sequences with a t-th sub-sequence, its index)."""

    def __init__(self, first, count, device):
        self.first, self.count, self.device = first, count, device
        self.depth = max(count)
        self.firsts = torch.tensor(first, device=device)
        self.lasts = torch.tensor([f + c - 1 for f, c in zip(first, count)], device=device)

    def at(self, t):
        js = [j for j, c in enumerate(self.count) if c > t]
        return (torch.tensor(js, device=self.device),
                torch.tensor([self.first[j] + t for j in js], device=self.device))


class FlaPieces(torch.autograd.Function):
    """(q, k, v, g, beta) of one varlen row (q, k normalised) -> outputs (N, H, dv); ``info`` = (kern, cu, lasts,
    firsts, state_in, grad_out): state_in(R, P) -> h0 (n, H, dk, dv) float32 from the summaries of the sequences
    ``lasts``; grad_out(D) -> d(final state) (n, H, dk, dv) from the adjoints of the sequences ``firsts``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, info):
        kern, cu, lasts, _, state_in, _ = info
        c, scale, dv = kern.cp, k.shape[-1] ** -0.5, v.shape[-1]
        sub_cu, first, count = sub_sequences(cu, _span(kern.chunk_size, cu[-1]))
        cu_t, idx = kern.geometry(sub_cu, k.device)
        subs = _Subs(first, count, k.device)
        q4, k4, v4, b4 = q[None], k[None], v[None], beta[None]
        gc, w, u, A = kern.wy(k4, v4, g[None], b4, cu_t, idx)
        hm = kern.summaries(k4, w, u, gc, cu_t)  # (n_sub, H, dk, dv + dk)
        Rs, Ps = hm[..., :dv], hm[..., dv:]
        R, P = Rs[subs.firsts].clone(), Ps[subs.firsts].clone()  # each sequence's, composed over its subs
        for t in range(1, subs.depth):
            js, ss = subs.at(t)
            R[js], P[js] = Rs[ss] + Ps[ss] @ R[js], Ps[ss] @ P[js]
        h0 = state_in([R[j] for j in lasts], [P[j] for j in lasts])
        h0s = h0 if subs.depth == 1 else h0.new_empty(Rs.shape)
        if subs.depth > 1:  # the state entering every sub-sequence
            h0s[subs.firsts] = h0
            for t in range(1, subs.depth):
                _, ss = subs.at(t)
                h0s[ss] = Rs[ss - 1] + Ps[ss - 1] @ h0s[ss - 1]
        h, v_new, _ = c["fwd_h_full"](k=k4, w=w, u=u, g=gc, initial_state=h0s, output_final_state=False,
                                      cu_seqlens=cu_t, chunk_indices=idx)
        o = c["fwd_o"](q=q4, k=k4, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu_t, chunk_indices=idx)
        ctx.save_for_backward(q, k, v, gc, beta, A, h0s, Ps.clone())
        ctx.info, ctx.geo, ctx.subs = info, (cu_t, idx), subs
        return o[0].to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, gc, beta, A, h0s, Ps = ctx.saved_tensors
        kern, _, _, firsts, _, grad_out = ctx.info
        (cu_t, idx), subs, c, scale = ctx.geo, ctx.subs, kern.cp, k.shape[-1] ** -0.5
        q4, k4, v4, b4 = q[None], k[None], v[None], beta[None]
        do = do[None].to(q.dtype).contiguous()
        geo = dict(cu_seqlens=cu_t, chunk_indices=idx)
        w, u = c["recompute"](k=k4, v=v4, beta=b4, A=A, g=gc, **geo)
        h, v_new, _ = c["fwd_h_full"](k=k4, w=w, u=u, g=gc, initial_state=h0s, output_final_state=False, **geo)
        dv = c["dv_local"](q=q4, k=k4, g=gc, do=do, scale=scale, **geo)
        # D of every sub-sequence at once: the state-gradient scan from a zero final-state gradient
        _, Ds, _ = c["bwd_dhu"](q=q4, k=k4, w=w, g=gc, h0=h0s, dht=None, do=do, dv=dv, scale=scale, **geo)
        Dc = Ds[subs.lasts].clone()  # each sequence's D: D_s0 + P_s0ᵀ (D_s1 + P_s1ᵀ (...))
        for t in range(subs.depth - 2, -1, -1):
            js, ss = subs.at(t + 1)
            Dc[js] = Ds[ss - 1] + Ps[ss - 1].transpose(-1, -2) @ Dc[js]
        dht = grad_out([Dc[j] for j in firsts])
        dhts = dht if subs.depth == 1 else dht.new_zeros(Ds.shape)
        if subs.depth > 1:  # d(final state) of every sub-sequence: d(S_in) of the next one
            dhts[subs.lasts] = dht
            for t in range(subs.depth - 2, -1, -1):
                _, ss = subs.at(t + 1)
                dhts[ss - 1] = Ds[ss] + Ps[ss].transpose(-1, -2) @ dhts[ss]
        dh, _, dv = c["bwd_dhu"](q=q4, k=k4, w=w, g=gc, h0=h0s, dht=dhts, do=do, dv=dv, scale=scale, **geo)
        dq, dk, dw, dg = c["dqkwg"](q=q4, k=k4, v=v_new, w=w, g=gc, h=h, dv=dv, do=do, dh=dh, scale=scale, **geo)
        dk2, dv, db, dg2 = c["wy_bwd"](k=k4, v=v4, beta=b4, g=gc, A=A, dw=dw, du=dv, **geo)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = c["cumsum"](dg, chunk_size=A.shape[-1], reverse=True, **geo)
        return dq[0].to(q.dtype), dk[0].to(k.dtype), dv[0].to(v.dtype), dg[0].to(gc.dtype), db[0].to(beta.dtype), None


__all__ = ["FlaPieces", "SPAN", "SPAN_ENV", "sub_sequences"]
