"""Peak memory of one candidate: host memory per node (ZeRO offload state, offloaded checkpoints) and GPU memory
per GPU (ZeRO partitioning, kept activations per checkpointing choice, working sets, ring buffers)."""
from __future__ import annotations

import math

from .constants import GiB, C
from .options import Env, Option, mode_of
from .shape import Shape


def kv_width(shape: Shape, opt: Option, sp: int) -> int:
    """Width of the k/v a rank exchanges: Ulysses/USP replicate kv heads up to the Ulysses degree."""
    replicated = mode_of(opt).plan_traffic(sp, opt.ring).kv_replicated
    return max(shape.kv_heads, sp) * shape.head_dim if replicated else shape.d_kv


def host_memory(shape: Shape, opt: Option, env: Env, g: dict, T: float, reasons: list[str]):
    """(offload every k, host peak bytes per node, host GiB per node); appends why the host memory is short."""
    N, world, d = shape.params(), env.world, shape.hidden
    ranks_node = min(env.gpus_per_node, world)
    host_node = env.host_mem_gib if env.host_mem_gib is not None else g["host_gib_per_gpu_default"] * env.gpus_per_node
    zero_host = {"zero3-offload": C("host_bytes_per_param_zero3_offload"),
                 "zero2-offload-opt": C("host_bytes_per_param_zero3_offload") - 2.0}.get(opt.zero, 0.0) * N / world
    host_fixed = ranks_node * (C("host_base_gib") * GiB + zero_host)
    ckpt_host_rank = shape.layers * 2 * d * T if opt.checkpointing == "offload" else 0.0
    k = 1
    if opt.checkpointing == "offload":
        avail = host_node * GiB - host_fixed
        if env.offload_every_k:
            k = env.offload_every_k
        elif avail <= 0:
            k = shape.layers + 1
        else:
            k = max(1, math.ceil(ranks_node * ckpt_host_rank / avail))
        if k > shape.layers:
            reasons.append("host memory: no room for the offloaded layer inputs")
            k = shape.layers
    host_peak = host_fixed + ranks_node * ckpt_host_rank / k
    return k, host_peak, host_node


def attn_working_set(shape: Shape, kernel: str, checkpointing: str, T: float, head_chunks: int = 1) -> float:
    """Bytes of one layer's attention backward (q, k, v, out, dout, dq, dk, dv, the layer input and its gradient,
    kernel workspace) at T local tokens. ``head_chunks`` > 1 (memory/head_chunks.py): q, k, v, dout, dq, dk, dv of
    one head group at a time; the block's output (all groups) stays whole, and the hidden-sized tensors around the
    block (input, its gradient and their partial sums) count 7 x hidden, as bench/trace_memory.py finds them at 4 and 8
    groups (73.4 / 61.3 KB/token at 7B scale vs 93.3 without, CPU census)."""
    d, da, dkv, n = shape.hidden, shape.d_attn, shape.d_kv, max(1, int(head_chunks))
    per_token = 4 * da + 4 * dkv + 4 * d if n == 1 else (3 * da + 4 * dkv) / n + da + 7 * d
    ws = C("attn_ws_factor") * 2 * per_token * T
    if checkpointing == "offload":  # the previous input comes back after the attention backward, not during it
        ws -= 2 * d * T
    if kernel == "fa4":  # its fp32 dq accumulator (one call's heads), in head groups past EASY_CONTEXT_FA4_BWD_ACCUM_MB
        from ..kernels.fa4 import accumulator_groups
        acc = 4 * da / n * T
        ws -= 4 * da * T - acc / accumulator_groups(acc, max(1, shape.kv_heads // n))
    return ws


def attn_output_bytes(shape: Shape, T: float) -> float:
    """One layer's attention output (bf16) and LSE (fp32) at T tokens: what a selective layer keeps."""
    return (2 * shape.d_attn + 4 * shape.heads) * T


def gpu_memory(shape: Shape, opt: Option, env: Env, T: float, k: int) -> float:
    """Peak GPU bytes per GPU."""
    N, world, sp = shape.params(), env.world, opt.sp
    d = shape.hidden
    live_zero3 = C("zero3_live_layers") * shape.layer_params() * 4 + shape.vocab * d * 4 * (1 if shape.tied else 2)
    extra2 = C("zero2_extra_bytes_per_param")
    adam = C("adam_bytes_per_param_gpu")
    # static = resident all step; grads = what builds up during backward (bare: the full bf16 gradients appear
    # while the kept activations are freed, so the peak is the larger of start-of-backward and end-of-backward)
    static, grads = {
        "bare": (2 * N, 2 * N),
        "zero2": (2 * N + (2 + adam + extra2) * N / world, 0),
        "zero2-offload-opt": (2 * N + (2 + extra2) * N / world, 0),
        "zero3": ((4 + adam) * N / world + live_zero3, 0),
        "zero3-offload": (live_zero3, 0),
    }[opt.zero]
    out = attn_output_bytes(shape, T)
    kept_pl = {"layer": 2 * d * T, "selective": 2 * d * T, "offload": 0}[opt.checkpointing]
    kept = shape.layers * kept_pl + (k - 1) * 2 * d * T
    if opt.checkpointing == "selective":  # the softmax layers keep their attention output (recurrent ones do not)
        kept += shape.n_attn * out
    if opt.checkpointing == "offload":  # layers keeping their attention output + LSE (memory/auto.py)
        kept += opt.selective_layers * out
    if k > 1 and mode_of(opt).supports_attention_cache:  # a nested group's rebuilt attention outputs (+ LSE), kept
        kept += (k - 1) * out  # until their layer's backward (memory/offload + attention_cache)
    if opt.checkpointing == "offload" and k > 1:  # calibrated beyond the nested terms at k >= 2 (its source)
        kept += C("offload_nested_extra_bytes_per_token_dim") * d * T
    kv_eff = kv_width(shape, opt, sp)
    ws_attn = attn_working_set(shape, opt.kernel, opt.checkpointing, T, opt.head_chunks) if shape.n_attn else 0.0
    mlp_tokens = min(T, d) if opt.tiled_mlp else T
    ws_mlp = C("mlp_ws_factor") * 2 * shape.mlp_width_active() * mlp_tokens if shape.n_mlp else 0.0
    ws_loss = 0.0 if opt.chunked_loss else C("loss_ws_bytes_per_vocab") * shape.vocab * T
    ring_buf = C("ring_buffer_bytes_per_kv") * kv_eff * T if sp > 1 and shape.n_attn else 0.0
    ws = max(ws_attn, ws_mlp, recurrent_working_set(shape, opt, T, env.batch))
    return static + max(kept + max(ws, ws_loss), grads + ws) + ring_buf + C("fixed_gpu_gib") * GiB


def recurrent_working_set(shape: Shape, opt: Option, T: float, batch: int) -> float:
    """Bytes of the largest recurrent layer's backward at T local tokens (cost_model/hybrid.py's per-token formula
    x recurrent_ws_factor; one tile's at sp = 1 with ``opt.recurrent_tiles``), plus every piece's exchanged summary
    held on every rank (sp > 1)."""
    if not shape.recurrent:
        return 0.0
    pieces = (2 if mode_of(opt).packed_pairs else 1) * opt.sp if opt.sp > 1 else 0
    tiles = opt.recurrent_tiles if opt.sp == 1 else 1
    return max(recurrent_layer_bytes(r, shape, T) / tiles + pieces * batch * sum(r.piece_bytes())
               for r in shape.recurrent)


def recurrent_layer_bytes(r, shape: Shape, T: float) -> float:
    """One recurrent layer's backward of kind ``r`` at T local tokens (its exchanged summaries not counted)."""
    return C("recurrent_ws_factor") * r.working_set_per_token(shape.hidden) * T
