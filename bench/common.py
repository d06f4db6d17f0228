"""Shared benchmark helpers: CUDA-event timing (median), FLOP counts, environment line."""
from __future__ import annotations

import datetime
import statistics

import torch


def require_cuda():
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (absolute times are only reported on a GPU)")


def env_line() -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import transformers
    return (f"{dev}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{datetime.date.today().isoformat()}")


def cuda_time_ms(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events (no host sync inside fn)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def attn_flops(batch, heads, lq, lk, head_dim, causal, mode="fwd") -> float:
    """Matmul FLOPs of attention: fwd = 4·B·H·Lq·Lk·D (halved when causal); bwd = 2.5 × fwd."""
    f = 4.0 * batch * heads * lq * lk * head_dim * (0.5 if causal else 1.0)
    return {"fwd": f, "bwd": 2.5 * f, "fwd_bwd": 3.5 * f}[mode]


def table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)
