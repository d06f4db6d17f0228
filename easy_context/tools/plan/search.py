"""Every candidate: mode x dp x sp (x ring x ulysses) splits that shard the length, x checkpointing x chunked loss
x tiled MLP x ZeRO set-up, each predicted."""
from __future__ import annotations

import itertools

from .constants import CHECKPOINTING, MODES, ZERO
from .options import Env, Option, layout_problem
from .predict import predict
from .shape import Shape


def layouts(shape: Shape, world: int, L: int):
    """(mode, dp, sp, ring) for every mode and dp x sp (x ring x ulysses) split of the world that shards L."""
    for sp in [s for s in range(1, world + 1) if world % s == 0]:
        dp = world // sp
        modes = ("data_parallel", "zigzag_ring_attn") if sp == 1 else MODES[1:]
        for mode in modes:
            rings = [r for r in range(2, sp) if sp % r == 0] if mode == "usp_attn" else [None]
            for ring in rings:
                opt = Option(mode, dp, sp, "layer", True, False, "zero3-offload", ring=ring)
                if layout_problem(shape, opt, L) is None:
                    yield mode, dp, sp, ring


def candidates(shape: Shape, env: Env, kernel: str | None = None) -> list[dict]:
    rows = []
    for (mode, dp, sp, ring), ckpt, chunked, tiled, zero in itertools.product(
            layouts(shape, env.world, env.seq_len), CHECKPOINTING, (True, False), (True, False), ZERO):
        if zero == "zero3" and env.world == 1:
            continue  # ZeRO-3 without offload partitions nothing on one GPU: zero2 is the same and shipped
        opt = Option(mode, dp, sp, ckpt, chunked, tiled, zero, ring=ring,
                     kernel=None if mode == "data_parallel" else kernel)
        rows.append(predict(shape, opt, env))
    return rows
