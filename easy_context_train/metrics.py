"""Throughput, MFU, peak memory; per-step JSON lines; wandb via Accelerate's tracker."""
from __future__ import annotations

import json
import os
import resource

import torch

PEAK_FLOPS = 989e12  # H100/H200 dense bf16, the project's MFU reference (README, "Performance")


def flops_per_token(n_params: int, n_layers: int, seq_len: int, d_model: int) -> float:
    """Model FLOPs per trained token, fwd+bwd, causal attention, recompute excluded."""
    return 6 * n_params + 6 * n_layers * seq_len * d_model


def peak_memory_gib() -> tuple[float, str]:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, "gpu"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "host"  # ru_maxrss is KiB on Linux


class StepMetrics:
    def __init__(self, n_params, config, seq_len, world_size, tokens_per_step):
        self.fpt = flops_per_token(n_params, config.num_hidden_layers, seq_len, config.hidden_size)
        self.world, self.tokens = world_size, tokens_per_step

    def __call__(self, seconds: float) -> dict:
        tps = self.tokens / max(seconds, 1e-9)
        mem, where = peak_memory_gib()
        return {"tokens_per_s": tps, "tokens_per_s_per_gpu": tps / self.world,
                "mfu": self.fpt * tps / self.world / PEAK_FLOPS, f"peak_mem_{where}_gib": mem,
                "step_time_s": seconds}


def postfix(m: dict) -> dict:
    mem = next(v for k, v in m.items() if k.startswith("peak_mem"))
    out = {"loss": f"{m['loss']:.4f}"}
    if "eval_loss" in m:
        out["eval"] = f"{m['eval_loss']:.4f}"
    return {**out, "tok/s": f"{m['tokens_per_s']:.0f}", "tok/s/gpu": f"{m['tokens_per_s_per_gpu']:.0f}",
            "mfu": f"{100 * m['mfu']:.1f}%", "mem": f"{mem:.1f}G"}


def report(row: dict, log, bar, accelerator, wandb: bool) -> None:
    """One step's metrics to metrics.jsonl, wandb (via Accelerate's tracker) and the progress bar."""
    log.write(row)
    if wandb:
        accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    bar.set_postfix(postfix(row), refresh=False)
    bar.update(1)


def _readable_lines(path: str) -> list[str]:
    """The lines of a metrics file that parse; a torn last line (a kill mid-write) is dropped with a note."""
    good = []
    with open(path) as f:
        lines = f.readlines()
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            json.loads(ln)
        except ValueError:
            print(f"note: {path} line {i + 1} is not valid JSON (a write cut short?); dropped", flush=True)
            continue
        good.append(ln if ln.endswith("\n") else ln + "\n")
    return good


class JsonlLog:
    """metrics.jsonl on the main process; on resume, lines after the resumed step are dropped. Writes go through the
    guarded writer (``writes.py``): a failed one is kept in ``failed`` (a ``WriteError``, never a traceback) and
    train.py's next agreement (``Guard.stop_requested``) stops every rank with it (exit 74)."""

    def __init__(self, path: str, enabled: bool, resume_step: int = 0):
        self.path, self.enabled, self.failed = path, enabled, None
        if enabled:
            from .writes import atomic_text, guarded
            try:
                with guarded("the metrics log", path):
                    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                    keep = []
                    if resume_step and os.path.exists(path):
                        keep = [ln for ln in _readable_lines(path) if json.loads(ln)["step"] <= resume_step]
                    atomic_text(path, "".join(keep))  # a private temp file next to it, then one rename
            except Exception as e:  # noqa: BLE001 - a WriteError, reported at the next agreement
                self.failed = e

    def write(self, row: dict) -> None:
        if not self.enabled or self.failed is not None:
            return
        from .checkpoint import injected
        from .writes import guarded
        try:
            with guarded("the metrics log", self.path):
                if injected("readonly", row["step"]):  # test hook: the file system turns read-only mid-run
                    import errno
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), self.path)
                with open(self.path, "a") as f:
                    f.write(json.dumps(row) + "\n")
        except Exception as e:  # noqa: BLE001 - a WriteError
            self.failed = e
