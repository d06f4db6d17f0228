"""The backend table: which kernels exist, which one runs (``choose_backend``), and the adapters that give each the
facade's signature ``forward(q, k, v, causal, scale) -> (out, lse)``, ``backward(dout, q, k, v, out, lse, causal,
scale) -> (dq, dk, dv)``. Adding a backend: its two adapters, one entry in ``_FORWARD`` / ``_BACKWARD`` /
``_DTYPES`` / ``BACKENDS``, and its availability in ``available_backends``.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from .checks import check_qkv  # noqa: F401 (kernels.backends.check_qkv, as before)
from .fa4 import backward as _fa4_kernel_backward
from .fa4 import forward as _fa4_kernel_forward
from .fa4 import usable as _fa4_usable
from .reference import _math_backward, _math_forward

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
        if _fa4_usable(device.index or 0):
            names.insert(0, "fa4")
        if _flash_attn_module() is not None:
            names.append("flash_attn")
        return names + ["math"]
    return ["cpu", "math"]


def auto_cuda_backend(dtype: torch.dtype, head_dim: int, hopper: bool, fa4_usable) -> str:
    """The automatic choice on a GPU (pure, for tests): fa4 > cudnn on Hopper/Blackwell, flash before. Head dim
    129-256 (Qwen3.5 / Qwen3-Next / Gemma attention) on cuDNN, 7x the efficient kernel (README, Attention kernels)."""
    if dtype in _HALF and head_dim <= 256:
        if not hopper:
            return "flash"
        return "fa4" if head_dim <= 128 and fa4_usable() else "cudnn"
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
        return auto_cuda_backend(q.dtype, q.shape[-1], _is_hopper_or_newer(idx), lambda: _fa4_usable(idx))
    # CPU: the fused kernel returns the LSE and is exact enough in float32; float64 stays on math.
    return "cpu" if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else "math"


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
    if q.shape[1] == 1 and k.shape[1] == 1:  # cuDNN refuses s_q = s_kv = 1 (a one-token packed document)
        return _math_forward(q, k, v, causal, scale)
    k, v = _expand_kv(k, v, q.shape[2])
    o, lse, *_ = aten._scaled_dot_product_cudnn_attention(
        _bhld(q), _bhld(k), _bhld(v), None, True, 0.0, causal, False, scale=scale)
    return _bhld(o), lse.view(lse.shape[0], lse.shape[1], lse.shape[2])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    # Dense (non-varlen) call: cum_seq/attn_bias are None, philox state unused without dropout
    # (probed on H200 / torch 2.11: None is accepted where the forward returned None).
    if q.shape[1] == 1 and k.shape[1] == 1:  # cuDNN refuses s_q = s_kv = 1 (a one-token packed document)
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
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
    return _fa4_kernel_forward(q, k, v, causal, scale, fallback=_cudnn_forward)


def _fa4_backward(dout, q, k, v, out, lse, causal, scale):
    return _fa4_kernel_backward(dout, q, k, v, out, lse, causal, scale, fallback=_cudnn_backward)


_FORWARD = {"fa4": _fa4_forward, "math": _math_forward, "cpu": _cpu_forward, "cudnn": _cudnn_forward,
            "flash": _flash_forward, "efficient": _efficient_forward, "flash_attn": _flash_attn_forward}
_BACKWARD = {"fa4": _fa4_backward, "math": _math_backward, "cpu": _cpu_backward, "cudnn": _cudnn_backward,
             "flash": _flash_backward, "efficient": _efficient_backward, "flash_attn": _flash_attn_backward}


