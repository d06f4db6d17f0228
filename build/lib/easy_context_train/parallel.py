"""dp x sp layout (``easy_context.parallel_layout``), the accelerator, and the summed token NLL train.py scales
(``nll_sum``: library code in easy_context/loss.py, re-exported here).

train.py's loss: each rank backpropagates ``sum(local NLL) * world * GA / N_window`` where N_window is
the number of valid targets of the whole optimizer step (all ranks, all micro-batches); DeepSpeed/DDP
average gradients over the world and scale by 1/GA, so the update is the one of the global token mean
(``easy_context.loss`` explains the same identity for one micro-batch; its ``global_sum`` is the all-reduce).
"""
from __future__ import annotations

import torch

from easy_context.loss import nll_sum  # noqa: F401 (library code; train.py imports it from here)
from .errors import UsageError


def build_layout(mode, sp_size: int | None, ring_degree: int | None, seq_length: int, config=None):
    """Process groups for ``mode`` (a Mode or --parallel_mode's name; collective on every rank); bad degrees /
    lengths -> UsageError. ``config``: the model's; packed rows are then dealt with each token's cost capped by the
    window every attention layer shares, if there is one (``hf.config.attention_window``)."""
    from easy_context.hf.config import attention_window
    from easy_context.parallel_layout import ParallelLayout

    try:
        layout = ParallelLayout.build(mode, sp_size=sp_size, ring_degree=ring_degree)
        layout.check_seq_len(seq_length)
    except ValueError as e:
        raise UsageError(str(e).replace("sequence length", "--seq-length")) from None
    layout.dispatch_window = None if config is None else attention_window(config)
    return layout


def make_accelerator(args):
    """Accelerator with the flags' GA and tracker; gloo spelled out for DeepSpeed on CPU (else every rank
    silently gets a world of 1)."""
    import datetime
    import os
    import warnings

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from .watchdog import backstop_timeout

    # DeepSpeed's ZeRO-3 calls torch's deprecated all_gather_into_tensor / reduce_scatter_tensor, and something in
    # every step enters warnings.catch_warnings, which resets the once-per-location registry: the FutureWarning
    # was printed on every call (over 4000 lines in a 4-minute CPU demo). Not ours to fix; hidden by message only.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    launched = "WORLD_SIZE" in os.environ or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    backend = None if not launched else "nccl" if torch.cuda.is_available() else "gloo"
    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulate_every, step_scheduler_with_optimizer=False,
        log_with="wandb" if args.wandb else None,
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=datetime.timedelta(
            seconds=backstop_timeout(args.timeout)))])  # our watchdog names the silent rank first
