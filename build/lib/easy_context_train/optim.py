"""AdamW + LR schedule, the same with and without DeepSpeed, and the LR flag is the LR used.

EasyContext's DeepSpeed json pinned the LR in a WarmupLR scheduler, so ``--learning-rate`` was
ignored. Here the json's optimizer LR / weight decay are overwritten from the flags, any json
``scheduler`` is dropped (with a warning), and the schedule is a ``LambdaLR`` we build on the optimizer
DeepSpeed creates (``DummyScheduler(lr_scheduler_callable=...)``); DeepSpeed steps it at every optimizer
step and saves it in its checkpoints.
"""
from __future__ import annotations

import math
import warnings

import torch

from .modeling import no_decay_names

BETAS, EPS = (0.9, 0.95), 1e-8


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup reaching 1.0 at
    step ``warmup - 1``, then constant (exactly 1.0) or cosine/linear decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * decay


class LRLambda:
    """Picklable schedule (LambdaLR saves callable objects' state, not closures)."""

    def __init__(self, warmup, total, schedule, min_ratio):
        self.warmup, self.total, self.schedule, self.min_ratio = warmup, total, schedule, min_ratio

    def __call__(self, step):
        return lr_factor(step, self.warmup, self.total, self.schedule, self.min_ratio)


def param_groups(model, weight_decay: float, decay_all: bool = False) -> list[dict]:
    skip = set() if decay_all else no_decay_names(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name in skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def configure_deepspeed(accelerator, args) -> bool:
    """Make the DeepSpeed config follow the flags. Returns True when DeepSpeed is in use."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return False
    cfg = plugin.deepspeed_config
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = opt.setdefault("params", {})
    for key, val in (("lr", args.learning_rate), ("weight_decay", args.weight_decay)):
        if params.get(key, "auto") not in ("auto", val) and accelerator.is_main_process:
            warnings.warn(f"DeepSpeed config optimizer.params.{key}={params[key]} replaced by the flag value {val}")
        params[key] = val
    params.setdefault("betas", list(BETAS))
    params.setdefault("eps", EPS)
    if "scheduler" in cfg:
        if accelerator.is_main_process:
            warnings.warn("DeepSpeed config 'scheduler' ignored: the schedule comes from --warmup-steps/--lr-schedule")
        del cfg["scheduler"]
    cfg["gradient_clipping"] = float(args.max_grad_norm)
    cfg["train_micro_batch_size_per_gpu"] = args.batch_size
    cfg["gradient_accumulation_steps"] = args.gradient_accumulate_every
    cfg["train_batch_size"] = args.batch_size * args.gradient_accumulate_every * accelerator.num_processes
    plugin.gradient_accumulation_steps = args.gradient_accumulate_every
    return True


def build_optimizer(model, args, use_deepspeed: bool):
    """(optimizer, scheduler) to hand to ``accelerator.prepare``."""
    groups = param_groups(model, args.weight_decay, args.decay_all)
    sched = LRLambda(args.warmup_steps, args.max_train_steps, args.lr_schedule, args.min_lr_ratio)
    if use_deepspeed:
        from accelerate.utils import DummyOptim, DummyScheduler

        opt = DummyOptim(groups, lr=args.learning_rate, weight_decay=args.weight_decay)
        return opt, DummyScheduler(opt, lr_scheduler_callable=lambda o: torch.optim.lr_scheduler.LambdaLR(o, sched))
    opt = torch.optim.AdamW(groups, lr=args.learning_rate, betas=BETAS, eps=EPS, weight_decay=args.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, sched)


def current_lr(model, optimizer) -> float:
    """The LR the real optimizer will use next (DeepSpeed's own optimizer when wrapped)."""
    real = getattr(model, "optimizer", None) or getattr(optimizer, "optimizer", optimizer)
    return float(real.param_groups[0]["lr"])
