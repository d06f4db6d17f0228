"""One candidate's prediction: memory (``memory.py``) and time (``step_time.py``) put together, tokens/s, MFU,
and whether it fits."""
from __future__ import annotations

from .constants import GiB, C, gpu_constants
from .memory import gpu_memory, host_memory
from .options import Env, Option, mode_of
from .shape import Shape, model_flops_per_token
from .step_time import compute_time, recurrent_comm_time, recurrent_exchange, sp_comm_time, zero_time


def predict(shape: Shape, opt: Option, env: Env) -> dict:
    """Per-GPU peak memory, per-node host memory, step time, tokens/s, MFU and whether it fits."""
    g = gpu_constants(env.gpu)
    L, B = env.seq_len, env.batch
    world, sp = env.world, opt.sp
    T = B * L / sp                                   # tokens this GPU holds
    mode_of(opt).plan_traffic(sp, opt.ring)  # a mode without a cost model is refused here, never costed as zero
    kernel = opt.kernel or (g["default_kernel"] if mode_of(opt).is_parallel else "sdpa")
    if kernel not in g["attn_fwd_bwd_tflops"]:
        kernel = g["default_kernel"]
    if shape.head_dim > 128 and kernel in ("fa4", "cudnn"):  # fa4 runs up to head dim 128, cuDNN above it
        kernel = "cudnn_d256" if "cudnn_d256" in g["attn_fwd_bwd_tflops"] else "cudnn"  # (kernels/backends.py)
    reasons: list[str] = []

    k, host_peak, host_node = host_memory(shape, opt, env, g, T, reasons)
    gpu_peak = gpu_memory(shape, opt, env, T, k)
    t_compute, t_attn, t_attn_f = compute_time(shape, opt, env, g, kernel, T, k)
    t_sp = sp_comm_time(shape, opt, env, g, T, t_attn, t_attn_f)
    t_rec = recurrent_comm_time(shape, opt, env, g)  # hybrids: the recurrent layers' state exchange
    exposed, t_opt = zero_time(shape, opt, env, g, t_compute)
    t_micro = t_compute + t_sp + t_rec + exposed
    ga = env.grad_accum if not opt.zero.startswith("bare") else 1
    step = ga * t_micro + t_opt
    tokens = ga * B * L * opt.dp
    tok_s = tokens / step
    mfu = model_flops_per_token(shape, L) * tok_s / (world * g["peak_tflops"] * 1e12)

    gpu_mem = env.gpu_mem_gib if env.gpu_mem_gib is not None else g["memory_gib"]
    usable = gpu_mem * C("usable_gpu_fraction")
    if gpu_peak / GiB > usable:
        reasons.append(f"GPU memory: {gpu_peak / GiB:.1f} GiB > {usable:.1f} usable of {gpu_mem:g}")
    if host_peak / GiB > host_node and not any(r.startswith("host") for r in reasons):
        reasons.append(f"host memory: {host_peak / GiB:.0f} GiB per node > {host_node:g}")
    return dict(mode=opt.mode, dp=opt.dp, sp=opt.sp, ring=opt.ring, checkpointing=opt.checkpointing,
                offload_every_k=k if opt.checkpointing == "offload" else None, chunked_loss=opt.chunked_loss,
                tiled_mlp=opt.tiled_mlp, head_chunks=opt.head_chunks, selective_layers=opt.selective_layers,
                recurrent_tiles=opt.recurrent_tiles, zero=opt.zero, kernel=kernel,
                gpu_peak_gib=round(gpu_peak / GiB, 2),
                host_peak_gib_per_node=round(host_peak / GiB, 1), step_s=round(step, 3), tokens_per_s=round(tok_s, 1),
                mfu=round(mfu, 4), fits=not reasons, why_not="; ".join(reasons),
                breakdown_s=dict(compute=round(ga * t_compute, 3), sp_comm=round(ga * t_sp, 3),
                                 zero_exposed=round(ga * exposed, 3), optimizer=round(t_opt, 3),
                                 **({"recurrent_comm": round(ga * t_rec, 4)} if shape.recurrent else {})),
                **({"linear_kernel": opt.linear_kernel,
                    "recurrent_exchange_mib_per_micro": round(3 * recurrent_exchange(shape, opt, B)[0] / 2**20, 2)}
                   if shape.recurrent else {}))
