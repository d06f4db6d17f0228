"""The math backend and the test oracle: plain PyTorch attention, any floating dtype incl. float64.

``_math_forward`` / ``_math_backward`` (q processed in chunks so memory stays bounded) are the ``math`` backend of
the table in backends.py and the explicit-mask path of documents.py; ``attention_reference`` is differentiable by
autograd through plain ops: what every test compares against.
"""
from __future__ import annotations

import math

import torch

from .checks import check_qkv


# ----------------------------------------------------------------------------------------------
# math backend: the readable reference (chunked over q so memory stays bounded)
# ----------------------------------------------------------------------------------------------
def _math_chunk(lq: int, lk: int, heads: int, batch: int) -> int:
    budget = 1 << 24  # score elements per chunk (4 bytes each in fp32)
    return max(1, min(lq, budget // max(1, lk * heads * batch)))


def _scores(qc, k, scale, q0, causal):
    # qc: (B, Hkv, G, c, D), k: (B, Hkv, 1, Lk, D) -> (B, Hkv, G, c, Lk). causal: bool, or a packing.Band
    # (key b kept for query a iff b - a >= band.c: the partial edge of a sliding window)
    s = torch.matmul(qc, k.transpose(-1, -2)) * scale
    if causal is not False:
        rows = torch.arange(q0, q0 + qc.shape[-2], device=qc.device)[:, None]
        cols = torch.arange(k.shape[-2], device=qc.device)[None, :]
        s = s.masked_fill(cols > rows if causal is True else cols - rows < causal.c, float("-inf"))
    return s


def _finite(m):  # a row with every key masked has lse -inf: exp(s - lse) must give 0, not nan
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _grouped(q, k, v):
    """(B,L,H,D) -> q (B,Hkv,G,Lq,D), k/v (B,Hkv,1,Lk,D) in a compute dtype >= float32."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.to(ct).permute(0, 2, 1, 3).reshape(b, hkv, hq // hkv, lq, d)
    kg = k.to(ct).permute(0, 2, 1, 3).unsqueeze(2)
    vg = v.to(ct).permute(0, 2, 1, 3).unsqueeze(2)
    return qg, kg, vg


def _math_forward(q, k, v, causal, scale):
    b, lq, hq, d = q.shape
    qg, kg, vg = _grouped(q, k, v)
    out = torch.empty_like(qg)
    lse = torch.empty(qg.shape[:-1], dtype=qg.dtype, device=q.device)
    step = _math_chunk(lq, k.shape[1], hq, b)
    for s0 in range(0, lq, step):
        s = _scores(qg[..., s0:s0 + step, :], kg, scale, s0, causal)
        m = torch.logsumexp(s, dim=-1)
        lse[..., s0:s0 + step] = m
        out[..., s0:s0 + step, :] = torch.matmul(torch.exp(s - _finite(m).unsqueeze(-1)), vg)
    out = out.reshape(b, hq, lq, d).permute(0, 2, 1, 3).to(q.dtype)
    return out, lse.reshape(b, hq, lq).float() if q.dtype != torch.float64 else lse.reshape(b, hq, lq)


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    qg, kg, vg = _grouped(q, k, v)
    ct = qg.dtype
    do = dout.to(ct).permute(0, 2, 1, 3).reshape(qg.shape)
    o = out.to(ct).permute(0, 2, 1, 3).reshape(qg.shape)
    lse_g = lse.to(ct).reshape(qg.shape[:-1])
    delta = (do * o).sum(-1)  # (B,Hkv,G,Lq): rowsum(dO ∘ O) = rowsum(P ∘ dP)
    dq = torch.empty_like(qg)
    dk = torch.zeros_like(kg.squeeze(2))
    dv = torch.zeros_like(dk)
    step = _math_chunk(lq, k.shape[1], hq, b)
    for s0 in range(0, lq, step):
        sl = slice(s0, s0 + step)
        p = torch.exp(_scores(qg[..., sl, :], kg, scale, s0, causal) - _finite(lse_g[..., sl]).unsqueeze(-1))
        dv += torch.matmul(p.transpose(-1, -2), do[..., sl, :]).sum(2)
        dp = torch.matmul(do[..., sl, :], vg.transpose(-1, -2))
        ds = p * (dp - delta[..., sl].unsqueeze(-1))
        dq[..., sl, :] = torch.matmul(ds, kg) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qg[..., sl, :]).sum(2) * scale
    dq = dq.reshape(b, hq, lq, d).permute(0, 2, 1, 3).to(q.dtype)
    dk = dk.reshape(b, hkv, -1, d).permute(0, 2, 1, 3).to(k.dtype)
    dv = dv.reshape(b, hkv, -1, d).permute(0, 2, 1, 3).to(v.dtype)
    return dq, dk, dv


def attention_reference(q, k, v, causal: bool = True, softmax_scale: float | None = None):
    """Differentiable full attention (autograd through plain ops): the test oracle."""
    check_qkv(q, k, v, causal=causal)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qg, kg, vg = _grouped(q, k, v)
    s = _scores(qg, kg, scale, 0, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.softmax(s, dim=-1), vg)
    b, lq, hq, d = q.shape
    return out.reshape(b, hq, lq, d).permute(0, 2, 1, 3).to(q.dtype), lse.reshape(b, hq, lq)
