"""The cost model's constants: easy_context/tools/plan_constants.json (every value with its unit and source; the one
constants file: the planner's, memory/auto.py's and the packed-row dispatch's) and the planner's fixed choices."""
from __future__ import annotations

import json
import os

GiB = 2**30
CONSTANTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                              "plan_constants.json")
PLANNED_CHECKPOINTING = ("layer", "selective", "offload")  # what the planner searches (a subset of memory.CHECKPOINTING)
# train.py-usable DeepSpeed set-ups (bench/plan_validation.py also uses "bare": bf16 weights + gradients that
# appear during backward, no optimizer = the benches' fwd+bwd step)
ZERO = ("zero3-offload", "zero3", "zero2-offload-opt", "zero2")


class PlanUsageError(ValueError):
    """Bad arguments or an unreadable config: one line on stderr, exit 2."""


_CACHE: dict = {}


def load_constants(path: str = CONSTANTS_FILE) -> dict:
    if path not in _CACHE:
        with open(path) as f:
            _CACHE[path] = json.load(f)
    return _CACHE[path]


def gpu_constants(gpu: str, data: dict | None = None) -> dict:
    """The plain values of one GPU's entries, inherited entries filled in from the GPU named by _inherits."""
    data = data or load_constants()
    gpus = data["gpus"]
    if gpu not in gpus:
        raise PlanUsageError(f"--gpu {gpu!r} is unknown; known: {', '.join(gpus)}")
    entry = gpus[gpu]
    base = gpu_constants(entry["_inherits"], data) if "_inherits" in entry else {}
    return {**base, **{k: v["value"] for k, v in entry.items() if not k.startswith("_")}}


def C(name: str) -> float:
    return load_constants()["constants"][name]["value"]
