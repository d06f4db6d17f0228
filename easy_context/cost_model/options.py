"""One candidate (``Option``: mode, dp x sp, memory options, ZeRO set-up) in one setting (``Env``: GPUs, length,
batch), and whether the mode can shard that length / those heads at all."""
from __future__ import annotations

from dataclasses import dataclass

from ..mode import Mode
from ..registry import get_mode
from .shape import Shape


@dataclass
class Option:
    mode: str
    dp: int
    sp: int
    checkpointing: str
    chunked_loss: bool
    tiled_mlp: bool
    zero: str
    ring: int | None = None            # usp_attn ring degree (ulysses = sp / ring)
    kernel: str | None = None          # attention backend (None: the GPU's default; data_parallel: sdpa)
    fused_ops: bool = True             # train.py default; False = HF eager norms/RoPE (bench baseline)
    head_chunks: int = 1               # attention blocks in head groups (memory/head_chunks.py)
    selective_layers: int = 0          # offload: layers keeping their attention output (train.py --checkpointing auto)
    linear_kernel: str = "fla"         # hybrids: gated DeltaNet's chunk rule, "fla" or "torch" (the model file's)
    recurrent_tiles: int = 1           # hybrids, sp = 1: recurrent layers in tiles (configure_memory)


@dataclass
class Env:
    gpu: str
    gpus_per_node: int
    nodes: int
    seq_len: int
    batch: int = 1
    grad_accum: int = 4
    gpu_mem_gib: float | None = None   # None: the GPU's
    host_mem_gib: float | None = None  # per node; None: host_gib_per_gpu_default x gpus_per_node
    offload_every_k: int | None = None  # None: smallest k whose kept inputs fit in host memory

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


def mode_of(opt) -> Mode:
    """The ``Mode`` of a candidate (an ``Option`` or a result row; its planner hooks: ``plan_problem``,
    ``plan_traffic``): the planner's one lookup of a mode name."""
    return get_mode(opt["mode"] if isinstance(opt, dict) else opt.mode)


def layout_problem(shape: Shape, opt: Option, L: int) -> str | None:
    """Why the mode cannot shard this length / these heads over sp ranks (None: it can). A mode without a planner
    cost model says so here and is left out of the search."""
    return mode_of(opt).plan_problem(shape.heads, L, opt.sp, opt.ring)
