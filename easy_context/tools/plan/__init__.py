"""``python -m easy_context plan``: which parallel layout and memory options train this model at this length?

    python -m easy_context plan --model llama-2-7b --seq-length 131072 --gpus 1
    python -m easy_context plan --model path/to/model_dir --seq-length 524288 --gpus 8 --nodes 2 --json

Offline and analytical: the config's shape (read with ``AutoConfig``, no weights; or a built-in name such as
``llama-2-7b``) -> parameter count, FLOPs per token (6N + 6 n_layers L d), bytes per token on the GPU and in host memory
for each memory option, ZeRO partitioning / offload, attention and ZeRO communication over assumed link
bandwidths, kernel throughputs measured on one H200. Every constant, with its unit and source, is in
``easy_context/tools/plan_constants.json``; ``bench/plan_validation.py`` compares the predictions with every
measured single-H200 point of the README. Multi-GPU numbers rest on assumed link bandwidths (none measured).

Each candidate = parallel mode x (dp x sp [x ring x ulysses]) x checkpointing {layer, selective, offload} x
chunked loss x tiled MLP x ZeRO config; the table lists those that fit, fastest first, with the train.py flags
and accelerate config of the best. Exit status: 0 something fits, 1 nothing fits, 2 a usage error.

Files: ``constants.py`` (plan_constants.json, fixed choices), ``shape.py`` (config -> shape, parameters, FLOPs),
``options.py`` (a candidate and the setting), ``memory.py`` (host and GPU peaks), ``step_time.py`` (compute,
sequence-parallel and ZeRO communication, optimizer), ``predict.py`` (one candidate's row), ``search.py`` (every
candidate), ``launch.py`` (accelerate command, train.py flags), ``cli.py`` (flags, table, ``main``).
"""
from __future__ import annotations

from .cli import MULTI_GPU_NOTE, PROG, build_parser, main, parse, rank_rows, render_table
from .constants import (CHECKPOINTING, CONSTANTS_FILE, ZERO, C, GiB, PlanUsageError,
                        gpu_constants, load_constants)
from .launch import accelerate_command, train_flags
from .memory import gpu_memory, host_memory
from .options import Env, Option, layout_problem
from .predict import predict
from .search import candidates, layouts
from .shape import Shape, load_shape, model_flops_per_token, shape_from_dict
from .step_time import compute_time, sp_comm_time, zero_time

__all__ = ["main", "build_parser", "parse", "render_table", "rank_rows", "PROG", "MULTI_GPU_NOTE", "PlanUsageError",
           "load_constants", "gpu_constants", "C", "GiB", "CONSTANTS_FILE", "CHECKPOINTING", "ZERO",
           "Shape", "shape_from_dict", "load_shape", "model_flops_per_token", "Option", "Env",
           "layout_problem", "host_memory", "gpu_memory", "compute_time", "sp_comm_time", "zero_time", "predict",
           "layouts", "candidates", "accelerate_command", "train_flags"]
