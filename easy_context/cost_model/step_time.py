"""Time of one candidate: compute of one micro-batch on one GPU (kernel throughputs measured on one H200),
sequence-parallel communication and ZeRO traffic over assumed link bandwidths, and the optimizer step."""
from __future__ import annotations

import math

from .constants import C
from .memory import kv_width
from .options import Env, Option, mode_of
from .shape import Shape


def interp(table: dict, L: int) -> float:
    """Log-length interpolation of a {length: value} table, clamped at its ends."""
    pts = sorted((int(k), float(v)) for k, v in table.items())
    if L <= pts[0][0]:
        return pts[0][1]
    if L >= pts[-1][0]:
        return pts[-1][1]
    for (l0, v0), (l1, v1) in zip(pts, pts[1:]):
        if l0 <= L <= l1:
            t = (math.log(L) - math.log(l0)) / (math.log(l1) - math.log(l0))
            return v0 + t * (v1 - v0)
    raise AssertionError


def attended_pairs(L: int, window: int | None = None) -> float:
    """(query, key) pairs of one causal sequence of L tokens, each query seeing at most ``window`` keys."""
    if window is None or window >= L:
        return L * L / 2.0
    return L * window - window * (window - 1) / 2.0


def compute_time(shape: Shape, opt: Option, env: Env, g: dict, kernel: str, T: float, k: int):
    """(compute s of one micro-batch, attention fwd+bwd s per layer, attention fwd s per layer)."""
    L, B, sp, d, da = env.seq_len, env.batch, opt.sp, shape.hidden, shape.d_attn
    r_mm = g["matmul_tflops"] * 1e12
    r_fb = interp(g["attn_fwd_bwd_tflops"][kernel], L) * 1e12
    r_f = interp(g["attn_fwd_tflops"][kernel], L) * 1e12
    load = C("ring_load_factor") if sp > 1 and mode_of(opt).uses_ring else 1.0
    attn_fwd_flops = 4.0 * B * attended_pairs(L, shape.window) * da / sp  # causal: 4·L²·d_attn / 2, split over sp
    if shape.window is not None and shape.window < L:  # FA4's local kernel runs below the causal one's throughput
        r_fb, r_f = r_fb * C("window_attn_efficiency"), r_f * C("window_attn_efficiency")
    t_attn = 3.5 * attn_fwd_flops / r_fb * load
    t_attn_f = attn_fwd_flops / r_f * load
    # totals over the layers: softmax attention in n_attn of them, the recurrent layers' state math in the rest
    # (hybrids, cost_model/hybrid.py), matmuls (projections, MLPs) and elementwise work in all
    nA, n = shape.n_attn, shape.layers
    t_mm = 6.0 * shape.matmul_params_active_total() * T / r_mm
    t_ew = n * C("elementwise_s_per_token_dim_fused" if opt.fused_ops else "elementwise_s_per_token_dim_hf") * d * T
    rec_ew = C("recompute_elementwise_fraction") * t_ew
    t_rec, t_rec_f = recurrent_time(shape, opt, g, T)
    total = nA * t_attn + t_mm + t_ew + t_rec
    if opt.checkpointing in ("layer", "offload"):
        total += t_mm / 3 + nA * t_attn_f + rec_ew + t_rec_f
    else:  # selective: attention output kept, the rest (recurrent layers whole) recomputed
        total += t_mm / 3 + rec_ew + t_rec_f
    if opt.tiled_mlp:  # the tiled backward recomputes the MLP forward tile by tile
        total += shape.n_mlp * 2.0 * shape.mlp_params(active=True) * T / r_mm
    if k > 1:  # nested: the inner inputs of each group of k are recomputed once more (their attention too, unless
        # the mode's attention keeps what the rebuild computed for the layer's backward: memory/offload.py)
        kept_attn = mode_of(opt).supports_attention_cache
        total += (k - 1) / k * (t_mm / 3 + (0.0 if kept_attn else nA * t_attn_f) + rec_ew + t_rec_f)
    if opt.recurrent_tiles > 1 and opt.sp == 1:  # the tiles' chain recomputes the recurrent layers' forward once more
        total += t_rec_f + sum(r.count * r.proj_params(d) for r in shape.recurrent) * 2.0 * T / r_mm
    if opt.head_chunks > 1:  # each group's q/k/v product is rebuilt in the block's backward (memory/head_chunks.py)
        total += nA * 2.0 * d * (da + 2 * shape.d_kv) * T / r_mm
    t_head = (6.0 + (2.0 if opt.chunked_loss else 0.0)) * shape.vocab * d * T / r_mm
    # a selective layer (offload + kept attention output, memory/auto.py) skips one attention forward recompute
    skipped = min(opt.selective_layers, nA) * t_attn_f if opt.checkpointing == "offload" else 0.0
    return C("step_time_factor") * (total - skipped + t_head), t_attn, t_attn_f


def recurrent_time(shape: Shape, opt: Option, g: dict, T: float) -> tuple[float, float]:
    """(fwd+bwd s, fwd s) of every recurrent layer's state math at T local tokens (projections are matmuls):
    FLOPs (cost_model/hybrid.py) over the kernel's throughput (gated DeltaNet: ``opt.linear_kernel``, fla or the
    model file's torch rule; Mamba-2: the torch SSD), x the parallel path's overhead when sp > 1; the short conv
    per token x channel (memory-bound)."""
    fb = f = 0.0
    for r in shape.recurrent:
        if r.kind == "short_conv":
            one = C("short_conv_s_per_token_channel") * r.conv_channels * T
        else:
            key, kern = ("delta_rule_fwd_bwd_tflops", opt.linear_kernel) if r.kind == "gated_deltanet" \
                else ("ssd_fwd_bwd_tflops", "torch")
            rate = g[key][kern]
            rate = (interp(rate, int(T)) if isinstance(rate, dict) else float(rate)) * 1e12
            one = 3.0 * r.state_flops() * T / rate
            if opt.sp > 1 and r.kind == "gated_deltanet":
                one *= C(f"delta_rule_sp_factor_{kern}")
        fb += r.count * one
        f += r.count * one / 3.0
    return fb, f


def recurrent_exchange(shape: Shape, opt: Option, batch: int) -> tuple[float, int]:
    """(bytes a rank sends in one pass over the layers, messages per pass): every piece's summary to every other
    rank (recurrent/exchange.py), per recurrent layer; zigzag-type cuts hold 2 pieces a rank, contiguous 1.
    The backward sends as much (gradients), and a checkpointed layer's recompute exchanges again."""
    if opt.sp <= 1 or not shape.recurrent:
        return 0.0, 0
    mine = 2 if mode_of(opt).packed_pairs else 1
    sent = sum(r.count * mine * (opt.sp - 1) * batch * sum(r.piece_bytes()) for r in shape.recurrent)
    return float(sent), sum(r.count * len(r.piece_bytes()) for r in shape.recurrent)


def recurrent_comm_time(shape: Shape, opt: Option, env: Env, g: dict) -> float:
    """Exposed time of the recurrent state exchange in one micro-batch (not overlapped: the layer waits for it):
    forward, recompute (every candidate checkpoints) and backward."""
    sent, msgs = recurrent_exchange(shape, opt, env.batch)
    if not msgs:
        return 0.0
    p2p = (g["nvlink_p2p_gbs"] if opt.sp <= env.gpus_per_node else g["ib_gbs"]) * 1e9
    return 3 * (sent / p2p + msgs * C("comm_latency_s"))


def sp_comm_time(shape: Shape, opt: Option, env: Env, g: dict, T: float, t_attn: float, t_attn_f: float) -> float:
    """Exposed sequence-parallel communication of one micro-batch (ring p2p beyond the overlapped compute,
    Ulysses all-to-alls): what the mode's ``plan_traffic`` says it moves (a mode without one is refused)."""
    sp, da = opt.sp, shape.d_attn
    traffic = mode_of(opt).plan_traffic(sp, opt.ring)
    kv_eff = kv_width(shape, opt, sp)
    lat = C("comm_latency_s")
    intra = sp <= env.gpus_per_node
    p2p = (g["nvlink_p2p_gbs"] if intra else g["ib_gbs"]) * 1e9
    t_sp = 0.0
    fwd_passes = 2 if opt.checkpointing in ("layer", "offload") else 1
    if sp > 1 and traffic.ring > 1:
        r = traffic.ring
        fac = C(traffic.ring_comm_factor) if traffic.ring_comm_factor else 1.0
        kv_w = kv_eff if traffic.ring_kv_replicated else shape.d_kv
        f_bytes, b_bytes = fac * T * 2 * kv_w * 2, fac * T * 2 * kv_w * (2 + 4)  # bf16 k,v; + fp32 dk,dv back
        f_comp, b_comp = t_attn_f / r, (t_attn - t_attn_f) / r
        per_step = fwd_passes * (max(0.0, f_bytes / p2p - f_comp) + lat) + max(0.0, b_bytes / p2p - b_comp) + lat
        t_sp += shape.n_attn * (r - 1) * per_step
    if sp > 1 and traffic.ulysses > 1:
        u = traffic.ulysses
        bw = (g["nvlink_collective_gbs"] if u <= env.gpus_per_node else g["ib_gbs"]) * 1e9
        a2a = T * (2 * da + 2 * kv_eff) * 2 * (u - 1) / u / bw + 2 * lat   # q,k,v in + out back (or grads)
        t_sp += shape.n_attn * a2a * (fwd_passes + 1 + (1 if opt.checkpointing == "selective" else 0))
    return t_sp


def zero_time(shape: Shape, opt: Option, env: Env, g: dict, t_compute: float):
    """(exposed ZeRO traffic s per micro-batch, optimizer step s): gathers overlap compute, the excess counts."""
    N, world = shape.params(), env.world
    coll = (g["nvlink_collective_gbs"] if world <= env.gpus_per_node else g["ib_gbs"]) * 1e9
    pcie = g["pcie_gbs"] * 1e9
    share = (world - 1) / world
    passes = 3  # forward, checkpoint recompute, backward: ZeRO-3 gathers the parameters for each
    t_z = 0.0
    if opt.zero in ("zero3", "zero3-offload"):
        t_z = passes * 2 * N * share / coll + 2 * N * share / coll
        if opt.zero == "zero3-offload":
            t_z += (passes * 2 * N + 2 * N) / world / pcie
    elif opt.zero in ("zero2", "zero2-offload-opt"):
        t_z = 2 * N * share / coll
    exposed = max(0.0, t_z - t_compute) + C("comm_exposed_fraction") * t_z
    t_opt = {"zero3-offload": C("cpu_adam_s_per_param"), "zero2-offload-opt": C("cpu_adam_s_per_param"),
             "zero3": C("gpu_adam_s_per_param"), "zero2": C("gpu_adam_s_per_param")}.get(opt.zero, 0.0) * N / world
    if opt.zero in ("zero2", "zero2-offload-opt") and world > 1:
        t_opt += 2 * N * share / coll  # updated parameters all-gathered once per step
    return exposed, t_opt
