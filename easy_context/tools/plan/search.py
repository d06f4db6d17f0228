"""Every candidate: mode x dp x sp (x ring x ulysses) splits that shard the length, x checkpointing x chunked loss
x tiled MLP x ZeRO set-up, each predicted."""
from __future__ import annotations

import itertools
from dataclasses import replace

from ...registry import mode_names
from ...cost_model.constants import PLANNED_CHECKPOINTING, ZERO
from ...cost_model.options import Env, Option, layout_problem, mode_of
from ...cost_model.predict import predict
from ...cost_model.shape import Shape


def layouts(shape: Shape, world: int, L: int):
    """(mode, dp, sp, ring) for every registered mode and dp x sp (x ring x ulysses) split of the world that shards
    L. One rank per sequence: the modes marked ``plan_at_sp1`` (the plain baseline and ours); a mode without a
    cost model is refused by its ``plan_problem``."""
    for sp in divisors(world):
        dp = world // sp
        for mode in mode_names():
            m = mode_of({"mode": mode})
            if not (m.plan_at_sp1 if sp == 1 else m.is_parallel):
                continue
            if sp > 1 and layout_problem(shape, Option(mode, dp, sp, "layer", True, False, "zero3-offload"), L):
                continue  # the mode cannot cut L over sp ranks at all: its ring splits need not be listed
            for ring in m.plan_rings(sp):
                opt = Option(mode, dp, sp, "layer", True, False, "zero3-offload", ring=ring)
                if layout_problem(shape, opt, L) is None:
                    yield mode, dp, sp, ring


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (sqrt(n) trial divisions, not n)."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidates(shape: Shape, env: Env, kernel: str | None = None, linear_kernel: str = "fla") -> list[dict]:
    rows = []
    for (mode, dp, sp, ring), ckpt, chunked, tiled, zero in itertools.product(
            layouts(shape, env.world, env.seq_len), PLANNED_CHECKPOINTING, (True, False), (True, False), ZERO):
        if zero == "zero3" and env.world == 1:
            continue  # ZeRO-3 without offload partitions nothing on one GPU: zero2 is the same and shipped
        m = mode_of({"mode": mode})
        opt = Option(mode, dp, sp, ckpt, chunked, tiled, zero, ring=ring, kernel=kernel if m.is_parallel else None,
                     linear_kernel=linear_kernel)
        here = [predict(shape, opt, env)]
        if shape.recurrent and sp == 1 and not here[0]["fits"]:  # configure_memory's recurrent_tiles
            here.append(predict(shape, replace(opt, recurrent_tiles=RECURRENT_TILES), env))
        n = head_chunks_for(shape)
        if n > 1 and m.supports_attention_cache and ckpt != "none":
            here.append(predict(shape, replace(opt, head_chunks=n), env))  # memory/head_chunks.py
        if ckpt == "offload" and chunked and tiled:  # what train.py --checkpointing auto adds: selective layers
            here += [r for r in (with_selective(shape, replace(opt, head_chunks=h["head_chunks"]), env, h)
                                 for h in here) if r]
        rows += here
    return rows


def with_selective(shape: Shape, opt: Option, env: Env, row: dict | None = None) -> dict | None:
    """The offload candidate ``opt`` (predicted as ``row``) with as many layers keeping their attention output as the
    GPU memory it leaves holds (memory/auto.py's rule: usable memory less its margin, one output + LSE per layer);
    None if it does not fit or leaves no room for one."""
    from ...memory.auto import MARGIN
    from ...cost_model.constants import C, GiB, gpu_constants
    from ...cost_model.memory import attn_output_bytes
    row = row or predict(shape, opt, env)
    gpu_mem = env.gpu_mem_gib if env.gpu_mem_gib is not None else gpu_constants(env.gpu)["memory_gib"]
    room = gpu_mem * C("usable_gpu_fraction") * (1 - MARGIN) * GiB - row["gpu_peak_gib"] * GiB
    s = min(shape.n_attn, int(room // attn_output_bytes(shape, env.batch * env.seq_len / opt.sp)))
    return predict(shape, replace(opt, selective_layers=s), env) if row["fits"] and s > 0 else None


RECURRENT_TILES = 8  # a recurrent layer's working set / 8 at sp = 1; one more forward of those layers


def head_chunks_for(shape: Shape) -> int:
    """The head groups the planner offers: 8 (measured on the H200: 96.6 -> 56.6 KB/token at 7B, 0.96x the step's
    speed at 128K), or the largest divisor of the kv heads under it (whole GQA sets)."""
    return max(c for c in (1, 2, 4, 8) if shape.kv_heads % c == 0)
