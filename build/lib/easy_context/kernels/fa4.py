"""FlashAttention-4 behind the kernel facade (the only module that imports ``flash_attn.cute``).

FA4 (Dao-AILab, ``pip install "easy-context[fa4]"``, CuTe DSL, JIT-compiled per shape) runs causal attention
faster than cuDNN on an H200 (README has the measured figures), takes GQA without expanding k/v and returns the fp32
LSE ``(B, H, L)`` the ring merge needs. Its raw entry points ``_flash_attn_fwd/_flash_attn_bwd`` are private
names, so the tested version range is pinned (``TESTED``); another version is used only with
``EASY_CONTEXT_FA4=force``. Any import failure, untested version or shape FA4 refuses falls back to cuDNN
with ONE warning (per reason / per shape), never an error.

Settings (environment, read once):
  EASY_CONTEXT_FA4          auto (default: use when importable, tested and on sm90/sm100) | 0 (off) | force
  EASY_CONTEXT_FA4_BWD_ACCUM_MB  the backward's fp32 dq accumulator above which heads go in groups (default 256)
  EASY_CONTEXT_FA4_CACHE    directory of FA4's on-disk kernel cache (default ~/.cache/easy_context/fa4).
                            FA4 compiles each new shape (seconds per shape and direction); with the
                            cache, the ranks of a node and later runs load the compiled kernels instead
                            (FA4's own FLASH_ATTENTION_CUTE_DSL_CACHE_* variables, if set, win; ``0`` disables).
"""
from __future__ import annotations

import importlib
import os
import warnings
from functools import lru_cache

TESTED = ("4.0.0b36", "4.1")  # [low, high): the range whose private entry points were checked on an H200
ENV = "EASY_CONTEXT_FA4"
CACHE_ENV = "EASY_CONTEXT_FA4_CACHE"
ACCUM_ENV = "EASY_CONTEXT_FA4_BWD_ACCUM_MB"

_warned: set[str] = set()
_failed_shapes: set[tuple] = set()


def _warn(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"easy_context: {msg}", RuntimeWarning, stacklevel=3)


def _version_tested(version: str) -> bool:
    from packaging.version import Version
    return Version(TESTED[0]) <= Version(version) < Version(TESTED[1])


def _enable_disk_cache() -> None:
    """Turn on FA4's on-disk kernel cache (its env vars are read when flash_attn.cute is imported)."""
    cache = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "easy_context", "fa4"))
    if cache in ("", "0"):
        return
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", cache)


@lru_cache(maxsize=None)
def module():
    """``flash_attn.cute.interface`` if FA4 may be used in this process, else None (reason warned once)."""
    mode = os.environ.get(ENV, "auto").lower()
    if mode in ("0", "off", "false"):
        return None
    try:
        from importlib.metadata import version
        ver = version("flash-attn-4")
    except Exception:
        return None  # not installed: the normal case, no warning
    if mode != "force" and not _version_tested(ver):
        _warn("version", f"flash-attn-4 {ver} is outside the tested range [{TESTED[0]}, {TESTED[1]}); using cuDNN "
              f"(set {ENV}=force to try it anyway)")
        return None
    _enable_disk_cache()
    try:
        mod = importlib.import_module("flash_attn.cute.interface")
        mod._flash_attn_fwd, mod._flash_attn_bwd  # noqa: B018  (the private names we rely on)
    except Exception as e:  # a broken CUTLASS DSL install, missing CUDA libs, renamed entry points
        _warn("import", f"flash-attn-4 {ver} is installed but unusable ({type(e).__name__}: {e}); using cuDNN")
        return None
    return mod


@lru_cache(maxsize=None)
def usable(device_index: int = 0) -> bool:
    """FA4 importable and the GPU is Hopper (sm90) or Blackwell (sm100): the archs its kernels target."""
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index)[0] not in (9, 10):
        return False
    return module() is not None


def _shape_key(kind, q, k, causal, extra=()):
    return (kind, tuple(q.shape), tuple(k.shape), q.dtype, bool(causal)) + tuple(extra)


def _run(kind, q, k, causal, call, fallback, extra=()):
    key = _shape_key(kind, q, k, causal, extra)
    mod = module()
    if mod is None or key in _failed_shapes:
        return fallback()
    try:
        return call(mod)
    except Exception as e:  # FA4 refused this shape/config: remember it, fall back for good
        _failed_shapes.add(key)
        _warn(repr(key), f"FlashAttention-4 {kind} failed for q {tuple(q.shape)}, k {tuple(k.shape)}, "
              f"causal={causal} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
              "using cuDNN for this shape")
        return fallback()


def forward(q, k, v, causal, scale, fallback):
    """(out, lse fp32 (B, Hq, Lq)); ``fallback(q, k, v, causal, scale)`` is the cuDNN path."""
    def call(mod):
        out, lse, *_ = mod._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
        return out, lse
    return _run("forward", q, k, causal, call, lambda: fallback(q, k, v, causal, scale))


def head_groups(q, k) -> int:
    """In how many groups of kv heads (with their q heads) the backward runs. FA4 keeps an fp32 dq accumulator of
    the whole call (16 KB/token at 32 x 128 heads, more than dq itself); above EASY_CONTEXT_FA4_BWD_ACCUM_MB
    (default 256) the heads go in up to 8 groups, each writing its slice of dq/dk/dv in place, so the peak of a long
    layer's backward holds 1/groups of it. Same arithmetic per head: exact."""
    return accumulator_groups(4.0 * q.shape[0] * q.shape[1] * q.shape[2] * q.shape[3], k.shape[2])


def accumulator_groups(accum_bytes: float, kv_heads: int) -> int:
    """The rule of ``head_groups`` on sizes alone (the planner uses it too): halve while over the limit."""
    limit = float(os.environ.get(ACCUM_ENV, "256")) * 2**20
    g = 1
    while accum_bytes / g > limit and g < 8 and kv_heads % (2 * g) == 0:
        g *= 2
    return g


def backward(dout, q, k, v, out, lse, causal, scale, fallback):
    """(dq, dk, dv) with dk/dv in k's kv-head count (FA4 reduces GQA groups itself)."""
    def call(mod):
        groups = head_groups(q, k)
        if groups == 1:
            dq, dk, dv, *_ = mod._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse.contiguous(),
                                                 softmax_scale=scale, causal=causal)
            return dq, dk, dv
        import torch
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        do = dout.contiguous()
        hq, hk = q.shape[2] // groups, k.shape[2] // groups
        for i in range(groups):
            a, b = slice(i * hq, (i + 1) * hq), slice(i * hk, (i + 1) * hk)
            mod._flash_attn_bwd(q[:, :, a], k[:, :, b], v[:, :, b], out[:, :, a], do[:, :, a],
                                lse[:, a].contiguous(), softmax_scale=scale, causal=causal,
                                dq=dq[:, :, a], dk=dk[:, :, b], dv=dv[:, :, b])
        return dq, dk, dv
    return _run("backward", q, k, causal, call, lambda: fallback(dout, q, k, v, out, lse, causal, scale))


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, fallback):
    """Packed (total, H, D) q/k/v with int32 cumulative lengths; lse (Hq, total_q). Falls back like ``forward``."""
    def call(mod):
        out, lse, *_ = mod._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                           max_seqlen_k=max_k, softmax_scale=scale, causal=causal,
                                           return_lse=True)
        return out, lse
    return _run("varlen forward", q, k, causal, call, fallback, (max_q, max_k))


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, fallback):
    def call(mod):
        dq, dk, dv, *_ = mod._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse.contiguous(),
                                             softmax_scale=scale, causal=causal, cu_seqlens_q=cu_q,
                                             cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
        return dq, dk, dv
    return _run("varlen backward", q, k, causal, call, fallback, (max_q, max_k))


def varlen_window_forward(q, k, v, cu, max_len, left, scale, fallback):
    """A diagonal run of documents, causal within each and windowed (key b kept for query a iff a - left <= b <= a),
    in one varlen call: documents longer than the window join the run instead of a launch each."""
    def call(mod):
        out, lse, *_ = mod._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                           max_seqlen_k=max_len, softmax_scale=scale, causal=True,
                                           window_size_left=left, window_size_right=0, return_lse=True)
        return out, lse
    return _run("varlen window forward", q, k, True, call, fallback, (max_len, left))


def varlen_window_backward(dout, q, k, v, out, lse, cu, max_len, left, scale, fallback):
    def call(mod):
        dq, dk, dv, *_ = mod._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse.contiguous(), softmax_scale=scale,
                                             causal=True, window_size_left=left, window_size_right=0,
                                             cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                             max_seqlen_k=max_len)
        return dq, dk, dv
    return _run("varlen window backward", q, k, True, call, fallback, (max_len, left))


def window_forward(q, k, v, left, right, scale, fallback):
    """A sliding-window piece in one call: key b kept for query a iff a + Lk - Lq - left <= b (and b <= a + Lk - Lq
    + right unless right is None), flash-attention's bottom-right convention (packing.Window.kernel_window)."""
    def call(mod):
        out, lse, *_ = mod._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=False, window_size_left=left,
                                           window_size_right=right, return_lse=True)
        return out, lse
    return _run("window forward", q, k, False, call, fallback, (left, right))


def window_backward(dout, q, k, v, out, lse, left, right, scale, fallback):
    def call(mod):
        dq, dk, dv, *_ = mod._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse.contiguous(), softmax_scale=scale,
                                             causal=False, window_size_left=left, window_size_right=right)
        return dq, dk, dv
    return _run("window backward", q, k, False, call, fallback, (left, right))
