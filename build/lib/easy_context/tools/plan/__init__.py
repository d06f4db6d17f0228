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

The cost model (shape, memory, step time, one candidate's prediction, the constants) is library code in
``easy_context/cost_model/`` (memory/auto.py uses it too); here: ``search.py`` (every candidate), ``launch.py``
(accelerate command, train.py flags), ``packed.py`` (packed rows' layouts), ``cli.py`` (flags, table, ``main``).
"""
from __future__ import annotations

from .cli import MULTI_GPU_NOTE, PROG, build_parser, main, parse, rank_rows, render_table
from ...cost_model.constants import (PLANNED_CHECKPOINTING, CONSTANTS_FILE, ZERO, C, GiB, PlanUsageError,
                                     gpu_constants, load_constants)
from ...cost_model.memory import gpu_memory, host_memory
from ...cost_model.options import Env, Option, layout_problem
from ...cost_model.predict import predict
from ...cost_model.shape import Shape, load_shape, model_flops_per_token, shape_from_dict
from ...cost_model.step_time import compute_time, sp_comm_time, zero_time
from .launch import accelerate_command, train_flags
from .search import candidates, layouts

__all__ = ["main", "build_parser", "parse", "render_table", "rank_rows", "PROG", "MULTI_GPU_NOTE", "PlanUsageError",
           "load_constants", "gpu_constants", "C", "GiB", "CONSTANTS_FILE", "PLANNED_CHECKPOINTING", "ZERO",
           "Shape", "shape_from_dict", "load_shape", "model_flops_per_token", "Option", "Env",
           "layout_problem", "host_memory", "gpu_memory", "compute_time", "sp_comm_time", "zero_time", "predict",
           "layouts", "candidates", "accelerate_command", "train_flags"]
