"""How to run a candidate: the shipped accelerate config (+ DeepSpeed json) and train.py's flags."""
from __future__ import annotations

from ...cost_model.options import Env, mode_of


def accelerate_command(row: dict, env: Env) -> str:
    """The launch line for a candidate: shipped accelerate config (+ DeepSpeed json), then train.py's flags."""
    world, multi = env.world, env.nodes > 1
    base = "accelerate_configs/two_node.yaml" if multi else "accelerate_configs/single_node.yaml"
    ds = {"zero3-offload": None, "zero2-offload-opt": "accelerate_configs/zero2_offload_optimizer.json",
          "zero2": "accelerate_configs/zero2_gpu.json",
          "zero3": "accelerate_configs/zero3_gpu.json"}[row["zero"]]
    if world == 1 and row["zero"] in ("zero2", "zero2-offload-opt"):
        base = "accelerate_configs/single_gpu.yaml"
        ds = None if row["zero"] == "zero2-offload-opt" else ds
    parts = ["accelerate launch", f"--config_file {base}"]
    default_procs = {"accelerate_configs/single_node.yaml": 8, "accelerate_configs/two_node.yaml": 16,
                     "accelerate_configs/single_gpu.yaml": 1}[base]
    if world != default_procs:
        parts.append(f"--num_processes {world}")
    if multi and env.nodes != 2:
        parts.append(f"--num_machines {env.nodes}")
    if ds:
        parts.append(f"--deepspeed_config_file {ds}")
    parts.append("train.py")
    parts.append(" ".join(train_flags(row, env)))
    return " ".join(parts)


def train_flags(row: dict, env: Env) -> list[str]:
    f = [f"--seq-length {env.seq_len}", f"--batch-size {env.batch}", f"--gradient-accumulate-every {env.grad_accum}",
         f"--parallel_mode {row['mode']}"]
    if mode_of(row).is_parallel:
        f.append(f"--sp-size {row['sp']}")
    if row["ring"]:
        f.append(f"--ring_degree {row['ring']}")
    if row.get("selective_layers"):  # offload + selective layers: what --checkpointing auto chooses from the budgets
        f.append("--checkpointing auto")
    else:
        f.append(f"--checkpointing {row['checkpointing']}")
    if row["checkpointing"] == "offload" and not row.get("selective_layers") and row["offload_every_k"] and \
            row["offload_every_k"] > 1:
        f.append(f"--offload-every-k {row['offload_every_k']}")
    if row["chunked_loss"]:
        f.append("--chunked-loss")
    if row["tiled_mlp"]:
        f.append("--tiled-mlp")
    if row.get("head_chunks", 1) > 1:
        f.append(f"--head-chunks {row['head_chunks']}")
    if row.get("recurrent_tiles", 1) > 1:
        f.append(f"--recurrent-tiles {row['recurrent_tiles']}")
    return f
