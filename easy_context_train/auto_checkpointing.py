"""``--checkpointing auto``: offload every-k and selective layers chosen from the memory the ranks have
(``easy_context.memory.auto``), one choice for every rank.

Budgets of one rank, for one micro-batch of ``seq_length x batch_size / sp`` local tokens:

* GPU: ``--gpu-budget-gib``, else the free GPU memory less the gradients still to come (``memory.auto``) and less
  what ``accelerator.prepare`` will still put there (``prepare_reserve``: without DeepSpeed the weights and AdamW
  moments; with it the optimizer state / weights it does not offload).
* host: ``--host-budget-gib`` is per node, else 80% of the node's MemAvailable; either way split evenly among the
  node's ranks (``LOCAL_WORLD_SIZE``; unset: all processes, as on one node), and the measured one less the state
  ZeRO's CPU offload will keep there (the planner's calibrated bytes per parameter).

Measured before ``prepare``, while every rank still holds the whole model on the CPU: the host figure is then low,
never high. A CPU run has no free GPU memory to measure: it needs ``--gpu-budget-gib`` (train.py's flags say so).

Agreement: ranks choosing differently (other free memory) would desync ZeRO-3's gathers and the offload pattern.
Every rank sends its two budgets (one ``all_gather``), takes the smallest of each (``agree_budgets``) and runs the
same pure ``choose_checkpointing`` on them, so every rank chooses alike. A smaller budget never gives a smaller k
nor more selective layers, so the choice fits every rank. (Choosing per rank, then taking the largest k and the
fewest selective layers separately, can pick a pair no rank planned: a larger k takes GPU memory the other rank's
layer count assumed free.) A choice that fits nowhere fails alike on every rank, after the collective.
"""
from __future__ import annotations

import os

from .errors import UsageError

GiB = 2**30


def local_ranks(world: int) -> int:
    """Processes on this node (they share its host memory): LOCAL_WORLD_SIZE (torchrun / accelerate launch), else
    all ``world`` processes (the split that is never too generous on one node)."""
    try:
        return max(1, min(world, int(os.environ["LOCAL_WORLD_SIZE"])))
    except (KeyError, ValueError):
        return max(1, world)


def ds_config_of(accelerator) -> dict | None:
    """The DeepSpeed config this run will use (None: no DeepSpeed), known before ``accelerator.prepare``."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) if accelerator else None
    return None if plugin is None else (plugin.deepspeed_config or {})


def zero_stage(ds_config: dict | None) -> int:
    return int(((ds_config or {}).get("zero_optimization") or {}).get("stage", 0) or 0)


def prepare_reserve(model, ds_config: dict | None, world: int) -> tuple[float, float]:
    """(GPU, host) bytes per rank that ``accelerator.prepare`` and the optimizer will still allocate, beyond what
    ``memory.auto.measure_budgets`` counts (the gradients to come). ``ds_config``: DeepSpeed's config dict, or None
    (plain Accelerate: the weights move to the GPU, AdamW keeps two moments like the trainable ones)."""
    from easy_context.cost_model.constants import C
    params = list(model.parameters())
    if ds_config is None:
        on_cpu = sum(p.numel() * p.element_size() for p in params if p.device.type != "cuda")
        return float(on_cpu + 2 * sum(p.numel() * p.element_size() for p in params if p.requires_grad)), 0.0
    zero, stage = ds_config.get("zero_optimization") or {}, zero_stage(ds_config)
    n, elem = sum(p.numel() for p in params), max((p.element_size() for p in params), default=2)
    off_opt = (zero.get("offload_optimizer") or {}).get("device") == "cpu"
    off_par = stage == 3 and (zero.get("offload_param") or {}).get("device") == "cpu"
    gpu = host = 0.0
    if off_opt:  # fp32 master, Adam m and v, fp32 gradients (+ pinned 16-bit weights when those are offloaded too)
        host = (C("host_bytes_per_param_zero3_offload") - (0.0 if off_par else 2.0)) * n / world
    else:
        gpu += C("adam_bytes_per_param_gpu") * n / (world if stage >= 1 else 1)
    if not off_par:
        gpu += elem * n / (world if stage == 3 else 1)
    return gpu, host


def agree_budgets(budgets) -> tuple[float, float]:
    """The (GPU, host) budgets every rank plans with: the smallest of each over the ranks' ``(gpu, host)`` pairs."""
    budgets = [(float(g), float(h)) for g, h in budgets]
    if not budgets:
        raise ValueError("agree_budgets needs at least one rank's budgets")
    return min(g for g, _ in budgets), min(h for _, h in budgets)


def rank_budgets(model, args, accelerator) -> tuple[float, float]:
    """This rank's (GPU, host) bytes for activations and offloaded checkpoints (module docstring)."""
    from easy_context.memory.auto import measure_budgets
    if args.gpu_budget_gib is None and accelerator.device.type != "cuda":
        raise UsageError("--checkpointing auto on a CPU run needs --gpu-budget-gib G (the GPU memory per rank to plan "
                         "for): there is no free GPU memory to measure")
    world = accelerator.num_processes
    gpu_reserve, host_reserve = prepare_reserve(model, ds_config_of(accelerator), world)
    gpu, host = measure_budgets(model, None if args.gpu_budget_gib is None else args.gpu_budget_gib * GiB,
                                None if args.host_budget_gib is None else args.host_budget_gib * GiB)
    host /= local_ranks(world)
    if args.gpu_budget_gib is None:
        gpu -= gpu_reserve
    if args.host_budget_gib is None:
        host -= host_reserve
    return gpu, host


def _gather_budgets(gpu: float, host: float, device) -> list[tuple[float, float]]:
    import torch
    import torch.distributed as dist
    mine = torch.tensor([gpu, host], dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [(gpu, host)]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [tuple(t.tolist()) for t in every]


def apply_auto_checkpointing(model, args, layout, accelerator, head_chunks="auto"):
    """Choose (on the budgets agreed over all ranks) and apply offloaded checkpointing for this run's local tokens;
    print the choice once and record it in OUTPUT_DIR/run.json (and wandb's config). Returns the CheckpointChoice."""
    from easy_context.memory.auto import MARGIN, auto_checkpointing
    tokens = args.seq_length * args.batch_size // layout.sp
    budgets = _gather_budgets(*rank_budgets(model, args, accelerator), accelerator.device)
    gpu, host = agree_budgets(budgets)
    try:
        choice, _ = auto_checkpointing(model, tokens, gpu_budget=gpu, host_budget=host, tiled_mlp=args.tiled_mlp,
                                       lean_norm=False, margin=MARGIN if args.auto_margin is None else args.auto_margin,
                                       head_chunks=head_chunks,
                                       recurrent_tiles=getattr(args, "recurrent_tiles", None) or "auto")
    except ValueError as e:  # the same numbers on every rank: every rank fails alike
        why = str(e).removeprefix("auto checkpointing: ").replace("checkpointing='nested'", "--checkpointing nested")
        raise UsageError(f"--checkpointing auto: {why}") from None
    accelerator.print(f"--checkpointing auto ({tokens} tokens per rank, budgets the least over {len(budgets)} "
                      f"rank(s)): {choice.describe()}")
    record_choice(args, accelerator, choice, tokens, gpu, host)
    return choice


def choice_record(choice, tokens: int, gpu: float, host: float) -> dict:
    return {"offload_every_k": choice.offload_every_k, "selective_layers": list(choice.selective_layers),
            "head_chunks": choice.head_chunks, "recurrent_tiles": choice.recurrent_tiles,
            "tokens_per_rank": tokens, "gpu_budget_gib": gpu / GiB, "host_budget_gib": host / GiB,
            "describe": choice.describe()}


def record_choice(args, accelerator, choice, tokens: int, gpu: float, host: float) -> None:
    """Main process: the choice of this launch under ``auto_checkpointing`` in OUTPUT_DIR/run.json (a resumed
    run's launch replaces the previous one's) and in wandb's run config."""
    if not accelerator.is_main_process:
        return
    from .run_dir import RUN_FILE, atomic_write_json, read_run
    rec = choice_record(choice, tokens, gpu, host)
    run = read_run(args.output_dir)
    if run is not None:
        atomic_write_json(os.path.join(args.output_dir, RUN_FILE), {**run, "auto_checkpointing": rec})
    for tracker in getattr(accelerator, "trackers", None) or []:
        tracker.store_init_configuration({"auto_checkpointing": rec})


__all__ = ["local_ranks", "prepare_reserve", "agree_budgets", "rank_budgets", "apply_auto_checkpointing",
           "choice_record", "record_choice"]
