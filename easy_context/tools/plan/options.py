"""One candidate (``Option``: mode, dp x sp, memory options, ZeRO set-up) in one setting (``Env``: GPUs, length,
batch), and whether the mode can shard that length / those heads at all."""
from __future__ import annotations

from dataclasses import dataclass

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


def layout_problem(shape: Shape, opt: Option, L: int) -> str | None:
    """Why the mode cannot shard this length / these heads over sp ranks (None: it can)."""
    sp, m = opt.sp, opt.mode
    if m == "data_parallel":
        return None if sp == 1 else "data_parallel has sp = 1"
    if m == "zigzag_ring_attn" and L % (2 * sp):
        return f"zigzag needs the length divisible by 2*sp = {2 * sp}"
    if m == "dist_flash_attn" and (sp > 1 and sp % 2 or L % sp):
        return f"dist_flash needs sp even (or 1) and the length divisible by {sp}"
    if m == "ulysses_attn" and (shape.heads % sp or L % sp):
        return f"ulysses needs q heads ({shape.heads}) and the length divisible by sp = {sp}"
    if m == "usp_attn":
        r = opt.ring or sp
        u = sp // r
        if sp % r or shape.heads % u or L % (2 * sp):
            return f"usp needs ring x ulysses = sp, q heads divisible by ulysses ({u}), length by {2 * sp}"
    return None
