"""The one place that knows attention kernels.

Every sequence-parallel algorithm calls exactly two functions:

    attn_forward(q, k, v, causal, softmax_scale)              -> (out, lse)
    attn_backward(dout, q, k, v, out, lse, causal, softmax_scale) -> (dq, dk, dv)

Layout legend (flash-attn's): q/out/dq ``(B, Lq, Hq, D)``; k/v/dk/dv ``(B, Lk, Hkv, D)`` with
``Hq % Hkv == 0`` (GQA: k/v are never expanded over the wire, and not in memory where the backend
takes fewer kv heads); ``lse`` is float32 ``(B, Hq, Lq)``, natural log, of the *scaled* scores.
``causal=True`` needs ``Lq == Lk`` (the diagonal block of a ring step); unequal lengths are non-causal.

Backends (``backend=`` argument, else env ``EASY_CONTEXT_ATTN_BACKEND``, else automatic):
  fa4        FlashAttention-4 (``flash-attn-4``, CuTe DSL, JIT) on sm90/sm100 when importable: ~610 TFLOP/s
             fwd+bwd on H200, native GQA; any failure falls back to cudnn with one warning (see fa4.py)
  cudnn      aten._scaled_dot_product_cudnn_attention  (fastest on Hopper: ~540 TFLOP/s fwd+bwd on H200)
  flash      aten._scaled_dot_product_flash_attention  (FA2 inside PyTorch)
  efficient  aten._scaled_dot_product_efficient_attention (any CUDA dtype incl. fp32)
  flash_attn the flash-attn package, if importable
  cpu        aten._scaled_dot_product_flash_attention_for_cpu (returns the LSE)
  math       plain PyTorch, q processed in chunks; any dtype incl. float64 — the reference

``merge_attn_out`` folds a block's partial ``(out, lse)`` into a running float32 accumulator.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from . import fa4
from .ops.jit import compiled

aten = torch.ops.aten

BACKENDS = ("fa4", "cudnn", "flash", "efficient", "flash_attn", "cpu", "math")
ENV_VAR = "EASY_CONTEXT_ATTN_BACKEND"
_HALF = (torch.float16, torch.bfloat16)
# dtypes each backend accepts (math takes anything floating).
_DTYPES = {
    "fa4": _HALF,
    "cudnn": _HALF,
    "flash": _HALF,
    "flash_attn": _HALF,
    "efficient": _HALF + (torch.float32,),
    "cpu": _HALF + (torch.float32, torch.float64),
    "math": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
}


# ----------------------------------------------------------------------------------------------
# validation and backend choice
# ----------------------------------------------------------------------------------------------
def check_qkv(q, k, v, what: str = "attention", local: bool = False, causal: bool = False) -> None:
    """Shape/dtype checks of q, k, v in the flash-attn layout, shared by the facade and every
    sequence-parallel mode. ``local=True``: the shards of one rank (q and k/v also share the local length);
    ``causal=True`` (facade): a causal block needs equal q and kv lengths. Raises ValueError with the fix."""
    seq = "seq_local" if local else "seq"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{what} expects q, k, v shaped (batch, {seq}, heads, head_dim); "
                             f"got {name} with shape {tuple(getattr(t, 'shape', ()))}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if local and (q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]):
        raise ValueError(f"{what}: q and k/v must agree on batch, local length and head_dim; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{what}: q and k must agree on batch and head_dim; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{what}: q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]}) for "
                         "grouped-query attention")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"{what}: causal=True needs equal q and kv lengths (got {q.shape[1]} and {k.shape[1]}); "
                         "pass causal=False for an off-diagonal block")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


@lru_cache(maxsize=None)
def _flash_attn_module():
    try:
        import flash_attn.flash_attn_interface as fai  # noqa: F401
        return fai
    except Exception:  # ImportError or a broken CUDA build: the package is optional
        return None


@lru_cache(maxsize=None)
def _is_hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on ``device`` in this process."""
    device = torch.device(device)
    if device.type == "cuda":
        names = ["cudnn", "flash", "efficient"]
        if fa4.usable(device.index or 0):
            names.insert(0, "fa4")
        if _flash_attn_module() is not None:
            names.append("flash_attn")
        return names + ["math"]
    return ["cpu", "math"]


def auto_cuda_backend(dtype: torch.dtype, head_dim: int, hopper: bool, fa4_usable) -> str:
    """The automatic choice on a GPU (pure, for tests): fa4 > cudnn on Hopper/Blackwell, flash before."""
    if dtype in _HALF and head_dim <= 128:
        if not hopper:
            return "flash"
        return "fa4" if fa4_usable() else "cudnn"
    return "efficient" if dtype in _HALF + (torch.float32,) else "math"


def choose_backend(q: torch.Tensor, backend: str | None = None) -> str:
    """The explicit ``backend``, else ``$EASY_CONTEXT_ATTN_BACKEND``, else the fastest for q."""
    name = backend or os.environ.get(ENV_VAR) or "auto"
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS} or 'auto'")
        if name not in available_backends(q.device):
            raise ValueError(f"attention backend {name!r} is not available on {q.device}; "
                             f"available: {available_backends(q.device)}")
        if q.dtype not in _DTYPES[name]:
            raise ValueError(f"attention backend {name!r} does not support {q.dtype}; "
                             f"it takes {[str(d) for d in _DTYPES[name]]}")
        return name
    if q.device.type == "cuda":
        idx = q.device.index or 0
        return auto_cuda_backend(q.dtype, q.shape[-1], _is_hopper_or_newer(idx), lambda: fa4.usable(idx))
    # CPU: the fused kernel returns the LSE and is exact enough in float32; float64 stays on math.
    return "cpu" if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else "math"


# ----------------------------------------------------------------------------------------------
# math backend: the readable reference (chunked over q so memory stays bounded)
# ----------------------------------------------------------------------------------------------
def _math_chunk(lq: int, lk: int, heads: int, batch: int) -> int:
    budget = 1 << 24  # score elements per chunk (64 MiB in fp32)
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


# ----------------------------------------------------------------------------------------------
# fused backends. aten ops take (B, H, L, D) views: a transpose of our (B, L, H, D) is free.
# ----------------------------------------------------------------------------------------------
def _bhld(x):
    return x.transpose(1, 2)


def _expand_kv(k, v, hq):
    """Repeat kv heads for kernels that need equal head counts (grads are summed back)."""
    rep = hq // k.shape[2]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def _reduce_kv_grad(dk, hkv):
    b, l, hq, d = dk.shape
    if hq == hkv:
        return dk
    return dk.view(b, l, hkv, hq // hkv, d).sum(3)


def _cpu_forward(q, k, v, causal, scale):
    o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        _bhld(q), _bhld(k), _bhld(v), 0.0, causal, scale=scale)
    return _bhld(o), lse if q.dtype == torch.float64 else lse.float()


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    # The CPU kernel takes fewer kv heads in forward; its backward wants them expanded.
    hkv = k.shape[2]
    ke, ve = _expand_kv(k, v, q.shape[2])
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhld(dout.contiguous()), _bhld(q), _bhld(ke), _bhld(ve), _bhld(out.contiguous()),
        lse, 0.0, causal, scale=scale)
    return _bhld(dq), _reduce_kv_grad(_bhld(dk), hkv), _reduce_kv_grad(_bhld(dv), hkv)


def _cudnn_forward(q, k, v, causal, scale):
    k, v = _expand_kv(k, v, q.shape[2])
    o, lse, *_ = aten._scaled_dot_product_cudnn_attention(
        _bhld(q), _bhld(k), _bhld(v), None, True, 0.0, causal, False, scale=scale)
    return _bhld(o), lse.view(lse.shape[0], lse.shape[1], lse.shape[2])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    # Dense (non-varlen) call: cum_seq/attn_bias are None, philox state unused without dropout
    # (probed on H200 / torch 2.11: None is accepted where the forward returned None).
    hkv = k.shape[2]
    ke, ve = _expand_kv(k, v, q.shape[2])
    lq, lk = q.shape[1], k.shape[1]
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        _bhld(dout.contiguous()), _bhld(q), _bhld(ke), _bhld(ve), _bhld(out), lse.unsqueeze(-1),
        seed, seed, None, None, None, lq, lk, 0.0, causal, scale=scale)
    return _bhld(dq), _reduce_kv_grad(_bhld(dk), hkv), _reduce_kv_grad(_bhld(dv), hkv)


def _flash_forward(q, k, v, causal, scale):
    k, v = _expand_kv(k, v, q.shape[2])
    o, lse, *_ = aten._scaled_dot_product_flash_attention(
        _bhld(q), _bhld(k), _bhld(v), 0.0, causal, False, scale=scale)
    return _bhld(o), lse


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    hkv = k.shape[2]
    ke, ve = _expand_kv(k, v, q.shape[2])
    lq, lk = q.shape[1], k.shape[1]
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        _bhld(dout.contiguous()), _bhld(q), _bhld(ke), _bhld(ve), _bhld(out), lse,
        None, None, lq, lk, 0.0, causal, rng, unused, scale=scale)
    return _bhld(dq), _reduce_kv_grad(_bhld(dk), hkv), _reduce_kv_grad(_bhld(dv), hkv)


def _efficient_forward(q, k, v, causal, scale):
    k, v = _expand_kv(k, v, q.shape[2])
    o, lse, *_ = aten._scaled_dot_product_efficient_attention(
        _bhld(q), _bhld(k), _bhld(v), None, True, 0.0, causal, scale=scale)
    return _bhld(o), lse[:, :, : q.shape[1]]  # the LSE is padded to a multiple of 32


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    hkv = k.shape[2]
    ke, ve = _expand_kv(k, v, q.shape[2])
    pad = (-lse.shape[-1]) % 32
    lse_p = F.pad(lse, (0, pad)) if pad else lse
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        _bhld(dout.contiguous()), _bhld(q), _bhld(ke), _bhld(ve), None, _bhld(out), lse_p.contiguous(),
        seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    return _bhld(dq), _reduce_kv_grad(_bhld(dk), hkv), _reduce_kv_grad(_bhld(dv), hkv)


def _flash_attn_forward(q, k, v, causal, scale):
    fai = _flash_attn_module()
    # Keyword arguments keep us independent of positional drift between flash-attn releases.
    res = fai._flash_attn_forward(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal,
                                  window_size_left=-1, window_size_right=-1, softcap=0.0,
                                  alibi_slopes=None, return_softmax=False)
    return res[0], res[1]


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    fai = _flash_attn_module()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fai._flash_attn_backward(dout.contiguous(), q, k, v, out, lse, dq, dk, dv, dropout_p=0.0,
                             softmax_scale=scale, causal=causal, window_size_left=-1,
                             window_size_right=-1, softcap=0.0, alibi_slopes=None,
                             deterministic=False, rng_state=None)
    return dq, dk, dv


def _fa4_forward(q, k, v, causal, scale):
    return fa4.forward(q, k, v, causal, scale, fallback=_cudnn_forward)


def _fa4_backward(dout, q, k, v, out, lse, causal, scale):
    return fa4.backward(dout, q, k, v, out, lse, causal, scale, fallback=_cudnn_backward)


_FORWARD = {"fa4": _fa4_forward, "math": _math_forward, "cpu": _cpu_forward, "cudnn": _cudnn_forward,
            "flash": _flash_forward, "efficient": _efficient_forward, "flash_attn": _flash_attn_forward}
_BACKWARD = {"fa4": _fa4_backward, "math": _math_backward, "cpu": _cpu_backward, "cudnn": _cudnn_backward,
             "flash": _flash_backward, "efficient": _efficient_backward, "flash_attn": _flash_attn_backward}


# ----------------------------------------------------------------------------------------------
# public facade
# ----------------------------------------------------------------------------------------------
def attn_forward(q, k, v, causal: bool = True, softmax_scale: float | None = None,
                 backend: str | None = None, docs=None):
    """Attention of one block. Returns ``out`` (q's dtype, (B,Lq,Hq,D)) and ``lse`` (fp32, (B,Hq,Lq)).

    ``docs`` (a ``packing.BlockDocs``: the global indices of the block's q and kv rows and the packed
    documents) makes it document-masked: causal within each document by global index (``causal`` is then
    implied), computed as dense pieces; rows the mask leaves empty get out 0 and lse -inf, and a block the
    mask removes entirely returns None (no kernel call)."""
    check_qkv(q, k, v, causal=causal and docs is None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    name = choose_backend(q, backend)
    fwd = _FORWARD[name]
    if docs is not None:
        return _doc_forward(name, q, k, v, scale, docs)
    return fwd(q, k, v, causal, scale)


def attn_backward(dout, q, k, v, out, lse, causal: bool = True, softmax_scale: float | None = None,
                  backend: str | None = None, docs=None):
    """Gradients of one block given the saved ``out``/``lse`` of the *whole* row (not of this block).

    Passing the final merged out/lse of a ring makes each block's dq/dk/dv exact contributions
    (the softmax normaliser and rowsum(dO∘O) are those of the full row).
    """
    check_qkv(q, k, v, causal=causal and docs is None)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    name = choose_backend(q, backend)
    bwd = _BACKWARD[name]
    if docs is not None:
        return _doc_backward(name, dout, q, k, v, out, lse, scale, docs)
    return bwd(dout, q, k, v, out, lse, causal, scale)


def _doc_rows(q, docs):
    """(batch slice, pieces) pairs: all rows at once when every row is packed alike, else row by row."""
    if docs.docs.uniform:
        return [(slice(None), docs.pieces(0))]
    return [(slice(b, b + 1), docs.pieces(b)) for b in range(q.shape[0])]


# Backends with a varlen (cu_seqlens) kernel: a diagonal run of many documents is one launch instead of one
# per document. (forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, fallback) on (total, H, D) tensors
# -> (out, lse (H, total)); backward likewise.) Tests register a reference implementation here.
VARLEN = {"fa4": (fa4.varlen_forward, fa4.varlen_backward)}
VARLEN_MIN_DOCS = 4  # fewer documents in a run: per-document dense calls are as cheap


def _group(name, pieces):
    """Pieces -> items: ("dense", piece) or ("varlen", [causal diagonal pieces tiling one contiguous run])."""
    items, run = [], []

    def flush():
        if len(run) >= VARLEN_MIN_DOCS and name in VARLEN:
            items.append(("varlen", list(run)))
        else:
            items.extend(("dense", p) for p in run)
        run.clear()
    for p in pieces:
        qs, ks, causal = p
        if causal is True and qs == ks and (not run or run[-1][0].stop == qs.start):
            run.append(p)
            continue
        flush()
        if causal is True and qs == ks:
            run.append(p)
        else:
            items.append(("dense", p))
    flush()
    return items


def _flat(x, bs, span):  # (B, L, H, D) rows of a run -> (B * n, H, D) for a varlen kernel
    t = x[bs, span]
    return t.reshape(-1, *t.shape[2:])


def _cu(run, batch, device):
    lens = torch.tensor([p[0].stop - p[0].start for p in run] * batch, dtype=torch.int32)
    return F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)).to(device), int(lens.max())


def _doc_forward(name, q, k, v, scale, docs):
    fwd = _FORWARD[name]
    out = lse = None
    for bs, pieces in _doc_rows(q, docs):
        for kind, item in _group(name, pieces):
            if out is None:
                acc = torch.float64 if q.dtype == torch.float64 else torch.float32
                out = torch.zeros(q.shape, dtype=acc, device=q.device)
                lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=acc, device=q.device)
            if kind == "dense":
                qs, ks, causal = item
                f = fwd if isinstance(causal, bool) else _math_forward  # a window's band edge: explicit mask
                o, l = f(q[bs, qs], k[bs, ks], v[bs, ks], causal, scale)
            else:  # one varlen launch over a diagonal run of documents
                qs = slice(item[0][0].start, item[-1][0].stop)
                nb = q[bs].shape[0]
                cu, mx = _cu(item, nb, q.device)

                def dense(qs=qs, item=item):
                    return _varlen_by_pieces(fwd, q[bs], k[bs], v[bs], item, scale)
                o, l = VARLEN[name][0](_flat(q, bs, qs), _flat(k, bs, qs), _flat(v, bs, qs), cu, cu, mx, mx,
                                       True, scale, lambda: _pack_varlen(*dense(), nb))
                n = qs.stop - qs.start
                o = o.view(nb, n, *o.shape[1:])
                l = l.view(l.shape[0], nb, n).transpose(0, 1)
            merge_attn_out(out[bs, qs], lse[bs, :, qs], o, l)  # a row may get pieces of two runs
    return None if out is None else (out.to(q.dtype), lse)


def _varlen_by_pieces(fwd, q, k, v, run, scale):
    """Fallback of a varlen call: the run's documents one dense causal call each -> (out, lse) of the run."""
    outs, lses = zip(*(fwd(q[:, p[0]], k[:, p[1]], v[:, p[1]], True, scale) for p in run))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _pack_varlen(o, l, nb):  # (B, n, H, D), (B, H, n) -> the varlen layout (B*n, H, D), (H, B*n)
    return o.reshape(-1, *o.shape[2:]), l.transpose(0, 1).reshape(l.shape[1], -1)


def _doc_backward(name, dout, q, k, v, out, lse, scale, docs):
    bwd = _BACKWARD[name]
    grads = None
    for bs, pieces in _doc_rows(q, docs):
        for kind, item in _group(name, pieces):
            if grads is None:
                acc = torch.float64 if q.dtype == torch.float64 else torch.float32
                grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v)]
            if kind == "dense":
                qs, ks, causal = item
                b = bwd if isinstance(causal, bool) else _math_backward
                g = b(dout[bs, qs], q[bs, qs], k[bs, ks], v[bs, ks], out[bs, qs], lse[bs, :, qs], causal, scale)
            else:
                qs = ks = slice(item[0][0].start, item[-1][0].stop)
                nb, n = q[bs].shape[0], qs.stop - qs.start
                cu, mx = _cu(item, nb, q.device)
                l_flat = lse[bs, :, qs].transpose(0, 1).reshape(lse.shape[1], -1).contiguous()

                def dense(item=item):
                    parts = [bwd(dout[bs, p[0]], q[bs, p[0]], k[bs, p[1]], v[bs, p[1]], out[bs, p[0]],
                                 lse[bs, :, p[0]], True, scale) for p in item]
                    return tuple(torch.cat(x, dim=1).reshape(-1, *x[0].shape[2:]) for x in zip(*parts))
                g = VARLEN[name][1](_flat(dout, bs, qs), _flat(q, bs, qs), _flat(k, bs, qs), _flat(v, bs, qs),
                                    _flat(out, bs, qs), l_flat, cu, cu, mx, mx, True, scale, dense)
                g = [x.view(nb, n, *x.shape[1:]) for x in g]
            grads[0][bs, qs] += g[0]
            grads[1][bs, ks] += g[1]
            grads[2][bs, ks] += g[2]
    return None if grads is None else tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def _merge(out, lse_bl, block_out, blk):
    # a row the block masks entirely (lse -inf: a sliding window's band edge) leaves out unchanged, also when
    # out is still empty (both -inf would make the weight nan)
    w = torch.where(torch.isneginf(blk), torch.zeros_like(blk), torch.sigmoid(blk - lse_bl))
    new_out = out - w * (out - block_out.to(out.dtype))
    new_lse = torch.maximum(lse_bl, blk) + F.softplus(-(lse_bl - blk).abs())
    return new_out, torch.where(torch.isneginf(lse_bl), blk, new_lse)


_merge_fused = compiled(_merge)  # one kernel on CUDA instead of ~8 passes with fp32 temporaries


def merge_attn_out(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> None:
    """Fold a block's ``(block_out, block_lse)`` into the float32 accumulators ``(out, lse)`` in place.

    out: fp32 (B, L, H, D); lse: fp32 (B, H, L). Written as
      lse' = lse - logsigmoid(lse - block_lse),  out' = out - sigmoid(block_lse - lse) * (out - block_out)
    which never exponentiates a large positive number (the form ring-flash-attention adopted in its
    PR #34 discussion of LSE overflow); ``lse = -inf`` (no keys seen yet) takes the block as is.
    The math is one fused kernel on CUDA (``ops.jit.compiled``); the results are copied into the accumulators.
    """
    lse_bl = lse.transpose(1, 2).unsqueeze(-1)           # (B, L, H, 1) view onto lse
    blk = block_lse.transpose(1, 2).unsqueeze(-1).to(lse.dtype)
    new_out, new_lse = _merge_fused(out, lse_bl, block_out, blk)
    out.copy_(new_out)
    lse_bl.copy_(new_lse)


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
