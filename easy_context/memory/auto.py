"""Checkpointing chosen from the memory there is and measured costs, not a fixed k.

For one step of ``tokens`` local tokens with offloaded checkpoints (memory/offload.py):

* host memory decides k: the smallest k whose kept layer inputs (one per k layers, 2 B x hidden per token each)
  fit the host budget;
* GPU memory left after one layer's attention backward (the planner's working set, calibrated on an H200:
  tools/plan_constants.json) and a nested group's transients is spent on selective layers (memory/selective.py):
  each keeps its attention output + LSE (2 B x q width + 4 B x heads per token) and so skips its attention
  recompute, the largest single saving per byte at long lengths (a causal attention forward at the measured
  TFLOP/s of the kernel);
* later layers first (their backward comes first).

``choose_checkpointing`` is pure (a shape, budgets in bytes); ``auto_checkpointing`` measures the budgets of this
process (free GPU memory minus the gradients still to come, MemAvailable of the host) and applies the choice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2**30
MARGIN = 0.06  # of the GPU budget: allocator slack and what the working-set model does not see
TILES = (1, 2, 4, 8, 16, 32)  # recurrent_tiles auto_checkpointing may choose


@dataclass(frozen=True)
class CheckpointChoice:
    offload_every_k: int
    selective_layers: tuple[int, ...]
    host_bytes: float        # pinned host memory for the kept inputs
    gpu_extra_bytes: float   # GPU memory of the selective outputs and nested transients
    saved_s: float           # predicted attention recompute time the selective layers skip
    reason: str
    head_chunks: int = 1     # attention blocks in head groups (memory/head_chunks.py)
    recurrent_tiles: int = 1  # a hybrid's recurrent layers in tiles (configure_memory's recurrent_tiles)

    def describe(self) -> str:
        heads = f", attention in {self.head_chunks} head groups" if self.head_chunks > 1 else ""
        heads += f", recurrent layers in {self.recurrent_tiles} tiles" if self.recurrent_tiles > 1 else ""
        return (f"offload k={self.offload_every_k} ({self.host_bytes / GiB:.1f} GiB host){heads}, "
                f"{len(self.selective_layers)} selective layers (+{self.gpu_extra_bytes / GiB:.1f} GiB GPU, "
                f"~{self.saved_s:.1f} s less recompute): {self.reason}")


def choose_checkpointing(shape, tokens: int, gpu_budget: float, host_budget: float, kernel: str = "fa4",
                         gpu: str = "h200", margin: float = MARGIN, head_chunks=(1,),
                         recurrent_tiles=(1,)) -> CheckpointChoice:
    """``shape``: a cost_model Shape; ``gpu_budget``: bytes free for activations (weights and gradients already
    counted out); ``host_budget``: bytes of host memory that may be pinned; ``margin``: the share of the GPU budget
    left unplanned (allocator slack, what the working-set model misses); ``head_chunks``: the head-group counts
    allowed (memory/head_chunks.py: same FLOPs, a smaller working set): the fewest groups that keep the most
    selective layers win. Raises ValueError when even one kept input per every layer of the model does not fit the
    host, or the working set does not fit the GPU at any allowed head-group count. A hybrid's selective layers are
    its softmax-attention layers (``shape.attn_layers``: the only ones with an output to keep); ``recurrent_tiles``
    (one process only): the tile counts allowed for its recurrent layers, the fewest that fit is taken."""
    best, no_room = None, None
    for n in sorted({int(c) for c in head_chunks}):
        try:
            c = _choose(shape, tokens, gpu_budget, host_budget, kernel, gpu, margin, n, recurrent_tiles)
        except _NoRoom as e:  # more groups may fit
            no_room = e
            continue
        if best is None or len(c.selective_layers) > len(best.selective_layers):
            best = c
    if best is None:
        raise ValueError(str(no_room))
    return best


class _NoRoom(ValueError):
    pass


def _choose(shape, tokens, gpu_budget, host_budget, kernel, gpu, margin, n, tiles=(1,)) -> CheckpointChoice:
    from ..cost_model.constants import gpu_constants
    from ..cost_model.memory import attn_output_bytes, attn_working_set, recurrent_layer_bytes
    from ..cost_model.step_time import interp
    layers_n, T, d, da = shape.layers, float(tokens), shape.hidden, shape.d_attn
    inp, out = 2 * d * T, attn_output_bytes(shape, T)
    if host_budget < inp:
        raise ValueError(f"auto checkpointing: one layer input at {tokens} tokens is {inp / GiB:.1f} GiB, more than "
                         f"the {host_budget / GiB:.1f} GiB of host memory available: shorten the sequence or use "
                         "checkpointing='nested' (inputs kept on the GPU)")
    k = max(1, math.ceil(layers_n * inp / host_budget))
    if k > layers_n:
        raise ValueError(f"auto checkpointing: {layers_n} layers need at least {inp / GiB:.1f} GiB of host memory")
    attn = shape.attn_layers
    recurrent = max((recurrent_layer_bytes(r, shape, T) for r in shape.recurrent), default=0.0)
    ws_attn = attn_working_set(shape, kernel, "offload", T, n)
    for n_tiles in sorted(tiles):  # the fewest recurrent tiles that fit (each costs a forward of those layers)
        work = max(ws_attn, recurrent / n_tiles) + (k - 1) * (inp + out)
        room = gpu_budget * (1 - margin) - work
        if room >= 0:
            break
    if room < 0:
        heads = f" (attention in {n} head groups)" if n > 1 else ""
        raise _NoRoom(f"auto checkpointing: one layer's backward needs ~{work / GiB:.1f} GiB at {tokens} tokens"
                      f"{heads}, more than the {gpu_budget / GiB:.1f} GiB free: use more sequence-parallel ranks")
    s = min(len(attn), int(room // out))
    rate = interp(gpu_constants(gpu)["attn_fwd_tflops"].get(kernel, gpu_constants(gpu)["attn_fwd_tflops"]["cudnn"]),
                   tokens) * 1e12
    t_fwd = 2.0 * T * T * da / rate  # causal attention forward of one layer
    layers = attn[len(attn) - s:]  # the last ones: their backward comes first
    why = (f"host {host_budget / GiB:.0f} GiB -> k={k}; GPU {gpu_budget / GiB:.0f} GiB - working set "
           f"{work / GiB:.1f} GiB -> {s} x {out / GiB:.2f} GiB attention outputs")
    if n > 1:
        less = attn_working_set(shape, kernel, "offload", T) - attn_working_set(shape, kernel, "offload", T, n)
        why += f" (attention in {n} head groups: {less / GiB:.1f} GiB less working set)"
    return CheckpointChoice(k, layers, math.ceil(layers_n / k) * inp, s * out + (k - 1) * (inp + out), s * t_fwd,
                            why, n, n_tiles)


def _host_available() -> float:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return float(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0.0


def measure_budgets(model, gpu_budget: float | None = None, host_budget: float | None = None) -> tuple[float, float]:
    """(GPU, host) bytes for ``choose_checkpointing``; a budget given is kept, a missing one measured in this process:
    free GPU memory minus the gradients still to come (``model``'s trainable parameters without a .grad), and 80% of
    the host's MemAvailable (the whole node's: processes sharing it must split it)."""
    import torch
    if gpu_budget is None:
        if not torch.cuda.is_available():
            raise ValueError("auto checkpointing needs gpu_budget= on a machine without CUDA")
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)
        gpu_budget = torch.cuda.mem_get_info()[0] - grads
    if host_budget is None:
        host_budget = 0.8 * _host_available()
    return float(gpu_budget), float(host_budget)


def auto_checkpointing(model, tokens: int, gpu_budget: float | None = None, host_budget: float | None = None,
                       kernel: str | None = None, tiled_mlp=True, lean_norm: bool = True, margin: float = MARGIN,
                       head_chunks="auto", recurrent_tiles="auto"):
    """Choose (``choose_checkpointing``) and apply (``configure_memory``) offloaded checkpointing for ``tokens``
    local tokens. Budgets default to this process's: free GPU memory minus the bf16 gradients still to come, and
    80% of the host's MemAvailable. ``head_chunks``: "auto" (any count the model allows, memory/head_chunks.py; 1
    when it cannot be chunked), a count, or counts to choose from. Returns (CheckpointChoice, MemoryConfig)."""
    import torch

    from ..cost_model.shape import shape_from_dict
    from ..recurrent.patch import tiles_reach
    from .configure import configure_memory
    shape = shape_from_dict(type(model).__name__, model.config.to_dict())
    gpu_budget, host_budget = measure_budgets(model, gpu_budget, host_budget)
    if kernel is None:
        from ..kernels import fa4
        kernel = "fa4" if torch.cuda.is_available() and fa4.usable(torch.cuda.current_device()) else "cudnn"
    if head_chunks == "auto":
        from .head_chunks import head_chunk_options
        head_chunks = head_chunk_options(model)
    choice = choose_checkpointing(shape, tokens, gpu_budget, host_budget, kernel, margin=margin,
                                  head_chunks=(head_chunks,) if isinstance(head_chunks, int) else tuple(head_chunks),
                                  recurrent_tiles=(TILES if tiles_reach(model) else (1,)) if recurrent_tiles == "auto"
                                  else (int(recurrent_tiles),))
    cfg = configure_memory(model, "offload", offload_every_k=choice.offload_every_k, tiled_mlp=tiled_mlp,
                           selective=bool(choice.selective_layers), lean_norm=lean_norm,
                           selective_layers=choice.selective_layers or None, head_chunks=choice.head_chunks,
                           recurrent_tiles=choice.recurrent_tiles)
    return choice, cfg


__all__ = ["CheckpointChoice", "choose_checkpointing", "measure_budgets", "auto_checkpointing"]
