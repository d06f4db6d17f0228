"""``python -m easy_context plan``: which parallel layout and memory options train this model at this length?

    python -m easy_context plan --model llama-2-7b --seq-length 131072 --gpus 1
    python -m easy_context plan --model path/to/model_dir --seq-length 524288 --gpus 8 --nodes 2 --json

Offline and analytical: the config's shape (read with ``AutoConfig``, no weights; or a built-in name such as
``llama-2-7b``) -> parameter count, FLOPs per token (DESIGN §5), bytes per token on the GPU and in host memory
for each memory option, ZeRO partitioning / offload, attention and ZeRO communication over assumed link
bandwidths, kernel throughputs measured on one H200. Every constant, with its unit and source, is in
``easy_context/tools/plan_constants.json``; ``bench/plan_validation.py`` compares the predictions with every
measured single-H200 point of the README. Multi-GPU numbers rest on assumed link bandwidths (none measured).

Each candidate = parallel mode x (dp x sp [x ring x ulysses]) x checkpointing {layer, selective, offload} x
chunked loss x tiled MLP x ZeRO config; the table lists those that fit, fastest first, with the train.py flags
and accelerate config of the best. Exit status: 0 something fits, 1 nothing fits, 2 a usage error.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

PROG = "python -m easy_context plan"
GiB = 2**30
CONSTANTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_constants.json")
MODES = ("data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")
CHECKPOINTING = ("layer", "selective", "offload")
# train.py-usable DeepSpeed set-ups (bench/plan_validation.py also uses "bare": bf16 weights + gradients that
# appear during backward, no optimizer = the benches' fwd+bwd step)
ZERO = ("zero3-offload", "zero3", "zero2-offload-opt", "zero2")
RING_MODES = ("zigzag_ring_attn", "dist_flash_attn")


class PlanUsageError(ValueError):
    """Bad arguments or an unreadable config: one line on stderr, exit 2."""


# ---------------------------------------------------------------------------------------------- constants
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


# ---------------------------------------------------------------------------------------------- model shape
@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 1          # MoE: experts per layer (each a gated MLP of width moe_intermediate)
    experts_per_token: int = 1
    moe_intermediate: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False

    @property
    def d_attn(self) -> int:  # width of q and of the attention output
        return self.heads * self.head_dim

    @property
    def d_kv(self) -> int:
        return self.kv_heads * self.head_dim

    def attn_params(self) -> int:
        h = self.hidden
        p = h * self.d_attn + 2 * h * self.d_kv + self.d_attn * h
        if self.qkv_bias:
            p += self.d_attn + 2 * self.d_kv
        if self.qk_norm:
            p += 2 * self.head_dim
        return p

    def mlp_params(self, active: bool = False) -> int:
        if self.experts > 1:
            n = self.experts_per_token if active else self.experts
            return n * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts  # + router
        return 3 * self.hidden * self.intermediate  # gated MLP: gate, up, down

    def layer_params(self) -> int:
        return self.attn_params() + self.mlp_params() + 2 * self.hidden  # + two RMSNorms

    def params(self) -> int:
        emb = self.vocab * self.hidden
        return emb * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden  # + final norm

    def matmul_params_active(self) -> int:
        """Per layer, the weights each token multiplies (MoE: its experts only)."""
        return self.attn_params() + self.mlp_params(active=True)

    def mlp_width_active(self) -> int:
        return self.experts_per_token * self.moe_intermediate if self.experts > 1 else self.intermediate


def model_flops_per_token(shape: Shape, seq_len: int) -> float:
    """DESIGN §5: 6·N_params + 6·n_layers·L·d_model (causal attention, fwd+bwd, recompute excluded)."""
    return 6.0 * shape.params() + 6.0 * shape.layers * seq_len * shape.hidden


def shape_from_dict(name: str, d: dict) -> Shape:
    g = d.get
    heads = int(g("num_attention_heads"))
    hidden = int(g("hidden_size"))
    head_dim = g("head_dim") or hidden // heads
    experts = int(g("num_local_experts") or g("num_experts") or 1)
    return Shape(name=name, hidden=hidden, intermediate=int(g("intermediate_size") or 0),
                 layers=int(g("num_hidden_layers")), heads=heads,
                 kv_heads=int(g("num_key_value_heads") or heads), head_dim=int(head_dim),
                 vocab=int(g("vocab_size")), tied=bool(g("tie_word_embeddings", False)), experts=experts,
                 experts_per_token=int(g("num_experts_per_tok") or 1),
                 moe_intermediate=int(g("moe_intermediate_size") or g("intermediate_size") or 0),
                 qkv_bias=bool(g("attention_bias", False)) or g("model_type") in ("qwen2", "qwen2_moe"),
                 qk_norm=g("model_type") in ("qwen3", "qwen3_moe", "olmo2"))


def load_shape(model: str) -> Shape:
    """A built-in name (plan_constants.json "shapes"), a model directory or a config.json path."""
    shapes = load_constants()["shapes"]
    if model.lower() in shapes:
        return shape_from_dict(model.lower(), shapes[model.lower()])
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise PlanUsageError(f"--model {model!r}: not a built-in shape ({', '.join(shapes)}) and no such file or "
                             "directory (pass a model directory or its config.json; nothing is downloaded)")
    try:
        from transformers import AutoConfig
        if os.path.isdir(path):
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        else:  # a config file of any name: AutoConfig wants a directory or config.json; build from its dict
            with open(path) as f:
                raw = json.load(f)
            cfg = AutoConfig.for_model(**raw)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        d = text.to_dict()
        for key in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size"):
            if d.get(key) is None:
                raise KeyError(key)
        d["tie_word_embeddings"] = getattr(cfg, "tie_word_embeddings", d.get("tie_word_embeddings", False))
        return shape_from_dict(os.path.basename(os.path.normpath(path)), d)
    except PlanUsageError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable config is one line, exit 2
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanUsageError(f"--model {model!r}: config unreadable ({type(e).__name__}: {msg[:200]})") from None


# ---------------------------------------------------------------------------------------------- one candidate
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


def _interp(table: dict, L: int) -> float:
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


def predict(shape: Shape, opt: Option, env: Env) -> dict:
    """Per-GPU peak memory, per-node host memory, step time, tokens/s, MFU and whether it fits."""
    g = gpu_constants(env.gpu)
    L, B, N = env.seq_len, env.batch, shape.params()
    world, sp = env.world, opt.sp
    T = B * L / sp                                   # tokens this GPU holds
    d, da, H = shape.hidden, shape.d_attn, shape.heads
    kernel = opt.kernel or ("sdpa" if opt.mode == "data_parallel" else g["default_kernel"])
    if kernel not in g["attn_fwd_bwd_tflops"]:
        kernel = g["default_kernel"]
    reasons: list[str] = []

    # ---- host memory per node: process base + ZeRO offload state + offloaded checkpoints
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

    # ---- GPU memory per GPU
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
    kept_pl = {"layer": 2 * d, "selective": 2 * d + 2 * da + 4 * H, "offload": 0}[opt.checkpointing]
    kept = shape.layers * kept_pl * T + (k - 1) * 2 * d * T
    kv_eff = max(shape.kv_heads, sp) * shape.head_dim if opt.mode in ("ulysses_attn", "usp_attn") else shape.d_kv
    ws_attn = C("attn_ws_factor") * 2 * (4 * da + 4 * shape.d_kv + 4 * d) * T
    mlp_tokens = min(T, d) if opt.tiled_mlp else T
    ws_mlp = C("mlp_ws_factor") * 2 * shape.mlp_width_active() * mlp_tokens
    ws_loss = 0.0 if opt.chunked_loss else C("loss_ws_bytes_per_vocab") * shape.vocab * T
    ring_buf = C("ring_buffer_bytes_per_kv") * kv_eff * T if sp > 1 else 0.0
    ws = max(ws_attn, ws_mlp)
    gpu_peak = static + max(kept + max(ws, ws_loss), grads + ws) + ring_buf + C("fixed_gpu_gib") * GiB

    # ---- time of one micro-batch on one GPU
    r_mm = g["matmul_tflops"] * 1e12
    r_fb = _interp(g["attn_fwd_bwd_tflops"][kernel], L) * 1e12
    r_f = _interp(g["attn_fwd_tflops"][kernel], L) * 1e12
    load = C("ring_load_factor") if sp > 1 and opt.mode in RING_MODES + ("usp_attn",) else 1.0
    attn_fwd_flops = 2.0 * B * L * L * da / sp      # causal: 4·L²·d_attn / 2 per sequence, split over sp
    t_attn = 3.5 * attn_fwd_flops / r_fb * load
    t_attn_f = attn_fwd_flops / r_f * load
    t_mm = 6.0 * shape.matmul_params_active() * T / r_mm
    t_ew = C("elementwise_s_per_token_dim_fused" if opt.fused_ops else "elementwise_s_per_token_dim_hf") * d * T
    rec_ew = C("recompute_elementwise_fraction") * t_ew
    per_layer = t_attn + t_mm + t_ew
    if opt.checkpointing in ("layer", "offload"):
        per_layer += t_mm / 3 + t_attn_f + rec_ew
    else:  # selective: attention output kept, the rest recomputed
        per_layer += t_mm / 3 + rec_ew
    if opt.tiled_mlp:  # the tiled backward recomputes the MLP forward tile by tile
        per_layer += 2.0 * shape.mlp_params(active=True) * T / r_mm
    if k > 1:  # nested: the inner inputs of each group of k are recomputed once more
        per_layer += (k - 1) / k * (t_mm / 3 + t_attn_f + rec_ew)
    t_head = (6.0 + (2.0 if opt.chunked_loss else 0.0)) * shape.vocab * d * T / r_mm
    t_compute = C("step_time_factor") * (shape.layers * per_layer + t_head)

    # ---- sequence-parallel communication per micro-batch (exposed part)
    lat = C("comm_latency_s")
    intra = sp <= env.gpus_per_node
    p2p = (g["nvlink_p2p_gbs"] if intra else g["ib_gbs"]) * 1e9
    t_sp = 0.0
    fwd_passes = 2 if opt.checkpointing in ("layer", "offload") else 1
    if sp > 1 and opt.mode in RING_MODES + ("usp_attn",):
        r = sp if opt.mode != "usp_attn" else (opt.ring or sp)
        fac = C("dist_flash_comm_factor") if opt.mode == "dist_flash_attn" else 1.0
        kv_w = kv_eff if opt.mode == "usp_attn" else shape.d_kv
        if r > 1:
            f_bytes, b_bytes = fac * T * 2 * kv_w * 2, fac * T * 2 * kv_w * (2 + 4)  # bf16 k,v; + fp32 dk,dv back
            f_comp, b_comp = t_attn_f / r, (t_attn - t_attn_f) / r
            per_step = fwd_passes * (max(0.0, f_bytes / p2p - f_comp) + lat) + max(0.0, b_bytes / p2p - b_comp) + lat
            t_sp += shape.layers * (r - 1) * per_step
    if sp > 1 and opt.mode in ("ulysses_attn", "usp_attn"):
        u = sp if opt.mode == "ulysses_attn" else sp // (opt.ring or sp)
        if u > 1:
            bw = (g["nvlink_collective_gbs"] if u <= env.gpus_per_node else g["ib_gbs"]) * 1e9
            a2a = T * (2 * da + 2 * kv_eff) * 2 * (u - 1) / u / bw + 2 * lat   # q,k,v in + out back (or grads)
            t_sp += shape.layers * a2a * (fwd_passes + 1 + (1 if opt.checkpointing == "selective" else 0))

    # ---- ZeRO traffic per micro-batch (overlapped with compute; the exposed part counts) and optimizer step
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
    t_micro = t_compute + t_sp + exposed
    t_opt = {"zero3-offload": C("cpu_adam_s_per_param"), "zero2-offload-opt": C("cpu_adam_s_per_param"),
             "zero3": C("gpu_adam_s_per_param"), "zero2": C("gpu_adam_s_per_param")}.get(opt.zero, 0.0) * N / world
    if opt.zero in ("zero2", "zero2-offload-opt") and world > 1:
        t_opt += 2 * N * share / coll  # updated parameters all-gathered once per step
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
                tiled_mlp=opt.tiled_mlp, zero=opt.zero, kernel=kernel, gpu_peak_gib=round(gpu_peak / GiB, 2),
                host_peak_gib_per_node=round(host_peak / GiB, 1), step_s=round(step, 3), tokens_per_s=round(tok_s, 1),
                mfu=round(mfu, 4), fits=not reasons, why_not="; ".join(reasons),
                breakdown_s=dict(compute=round(ga * t_compute, 3), sp_comm=round(ga * t_sp, 3),
                                 zero_exposed=round(ga * exposed, 3), optimizer=round(t_opt, 3)))


# ---------------------------------------------------------------------------------------------- enumeration
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


def accelerate_command(row: dict, env: Env) -> str:
    """The launch line for a candidate: shipped accelerate config (+ DeepSpeed json), then train.py's flags."""
    world, multi = env.world, env.nodes > 1
    base = "accelerate_configs/two_node.yaml" if multi else "accelerate_configs/single_node.yaml"
    ds = {"zero3-offload": None, "zero2-offload-opt": "accelerate_configs/zero2_offload_optimizer.json",
          "zero2": "accelerate_configs/zero2_gpu.json",
          "zero3": "accelerate_configs/zero3_gpu.json"}[row["zero"]]
    if world == 1 and row["zero"] in ("zero2", "zero2-offload-opt"):
        base = "accelerate_configs/single_gpu.yaml"
        ds = None if row["zero"] == "zero2-offload-opt" else ds
    parts = ["accelerate launch", f"--config_file {base}"]
    default_procs = {"accelerate_configs/single_node.yaml": 8, "accelerate_configs/two_node.yaml": 16,
                     "accelerate_configs/single_gpu.yaml": 1}[base]
    if world != default_procs:
        parts.append(f"--num_processes {world}")
    if multi and env.nodes != 2:
        parts.append(f"--num_machines {env.nodes}")
    if ds:
        parts.append(f"--deepspeed_config_file {ds}")
    parts.append("train.py")
    parts.append(" ".join(train_flags(row, env)))
    return " ".join(parts)


def train_flags(row: dict, env: Env) -> list[str]:
    f = [f"--seq-length {env.seq_len}", f"--batch-size {env.batch}", f"--gradient-accumulate-every {env.grad_accum}",
         f"--parallel_mode {row['mode']}"]
    if row["mode"] != "data_parallel":
        f.append(f"--sp-size {row['sp']}")
    if row["ring"]:
        f.append(f"--ring_degree {row['ring']}")
    f.append(f"--checkpointing {row['checkpointing']}")
    if row["checkpointing"] == "offload" and row["offload_every_k"] and row["offload_every_k"] > 1:
        f.append(f"--offload-every-k {row['offload_every_k']}")
    if row["chunked_loss"]:
        f.append("--chunked-loss")
    if row["tiled_mlp"]:
        f.append("--tiled-mlp")
    return f


# ---------------------------------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (no usage block)
        raise PlanUsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="exit status: 0 something fits, 1 nothing fits, 2 usage error. Constants and their sources: "
                       "easy_context/tools/plan_constants.json")
    a = p.add_argument
    a("--model", required=True, help="model directory, config.json path, or a built-in shape: "
      + ", ".join(load_constants()["shapes"]))
    a("--seq-length", type=int, required=True, help="tokens per row (train.py --seq-length)")
    a("--gpus", type=int, required=True, help="GPUs per node")
    a("--nodes", type=int, default=1)
    a("--gpu", default="h200", help="h200 (measured), h100 or a100 (assumed constants)")
    a("--gpu-mem", type=float, default=None, help="GiB of memory per GPU (default: the GPU's)")
    a("--host-mem", type=float, default=None, help="GiB of host RAM per node (default: 128 GiB per GPU)")
    a("--batch-size", type=int, default=1, help="rows per micro-batch per data-parallel rank")
    a("--gradient-accumulate-every", type=int, default=4, help="micro-batches per optimizer step")
    a("--kernel", default=None, help="attention backend for the sp modes: fa4 (default on Hopper), cudnn, flash")
    a("--top", type=int, default=10, help="rows to print")
    a("--json", action="store_true", help="machine-readable: every candidate, fitting first, fastest first")
    return p


def parse(argv) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name, low in (("seq_length", 1), ("gpus", 1), ("nodes", 1), ("batch_size", 1),
                      ("gradient_accumulate_every", 1), ("top", 1)):
        if getattr(args, name) < low:
            raise PlanUsageError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    for name in ("gpu_mem", "host_mem"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise PlanUsageError(f"--{name.replace('_', '-')} must be a positive number of GiB, got {v}")
    args.gpu = args.gpu.lower()
    g = gpu_constants(args.gpu)  # raises for an unknown GPU
    if args.kernel is not None and args.kernel not in g["attn_fwd_bwd_tflops"]:
        raise PlanUsageError(f"--kernel {args.kernel!r} has no measured throughput for {args.gpu}; "
                             f"known: {', '.join(g['attn_fwd_bwd_tflops'])}")
    return args


def _fmt_row(i, r) -> list[str]:
    lay = f"{r['dp']}x{r['sp']}" + (f" (R{r['ring']}xU{r['sp'] // r['ring']})" if r["ring"] else "")
    ck = r["checkpointing"] + (f" k={r['offload_every_k']}" if r["checkpointing"] == "offload" else "")
    return [str(i), r["mode"], lay, ck, "yes" if r["chunked_loss"] else "no", "yes" if r["tiled_mlp"] else "no",
            r["zero"], f"{r['gpu_peak_gib']:.1f}", f"{r['host_peak_gib_per_node']:.0f}", f"{r['step_s']:.2f}",
            f"{r['tokens_per_s']:.0f}", f"{100 * r['mfu']:.1f}%", "yes" if r["fits"] else "no: " + r["why_not"]]


def render_table(rows: list[dict]) -> str:
    head = ["#", "mode", "dp x sp", "checkpointing", "chunked", "tiled", "zero", "GPU GiB", "host GiB/node",
            "step s", "tok/s", "MFU", "fits"]
    body = [_fmt_row(i + 1, r) for i, r in enumerate(rows)]
    w = [max(len(x[j]) for x in [head] + body) for j in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w[j]) for j, c in enumerate(cells)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * x for x in w])] + [line(b) for b in body])


def rank_rows(rows: list[dict]) -> list[dict]:
    """Fitting first, fastest first; the misses by how far they overshoot (closest first)."""
    shipped = lambda r: r["zero"] != "zero3"  # noqa: E731 - on a tie, a config the repo ships first
    return sorted(rows, key=lambda r: (not r["fits"], -r["tokens_per_s"] if r["fits"] else r["gpu_peak_gib"],
                                       not shipped(r), r["gpu_peak_gib"]))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv)
        shape = load_shape(args.model)
    except PlanUsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    env = Env(gpu=args.gpu, gpus_per_node=args.gpus, nodes=args.nodes, seq_len=args.seq_length, batch=args.batch_size,
              grad_accum=args.gradient_accumulate_every, gpu_mem_gib=args.gpu_mem, host_mem_gib=args.host_mem)
    rows = rank_rows(candidates(shape, env, args.kernel))
    for r in rows:
        r["command"] = accelerate_command(r, env)
    fits = [r for r in rows if r["fits"]]
    g = gpu_constants(args.gpu)
    host = args.host_mem if args.host_mem is not None else g["host_gib_per_gpu_default"] * args.gpus
    if args.json:
        print(json.dumps(dict(model=asdict(shape), params=shape.params(),
                              flops_per_token=model_flops_per_token(shape, args.seq_length),
                              env=asdict(env), host_mem_gib_per_node=host,
                              gpu_mem_gib=args.gpu_mem or g["memory_gib"], fits=len(fits), candidates=rows,
                              notes=[MULTI_GPU_NOTE]), indent=1))
        return 0 if fits else 1
    print(f"{shape.name}: {shape.params() / 1e9:.2f}B params, {shape.layers} layers, d={shape.hidden}, "
          f"heads {shape.heads}/{shape.kv_heads} kv, vocab {shape.vocab}; L={args.seq_length}, "
          f"{args.nodes} x {args.gpus} {args.gpu.upper()} ({args.gpu_mem or g['memory_gib']:g} GiB each, "
          f"host {host:g} GiB/node), batch {args.batch_size}, GA {args.gradient_accumulate_every}")
    print(f"model FLOPs/token (DESIGN §5) {model_flops_per_token(shape, args.seq_length):.3e}; "
          f"{len(fits)} of {len(rows)} candidates fit")
    shown = fits[:args.top] if fits else rows[:args.top]
    if not fits:
        print("nothing fits; the closest candidates and why:")
    print(render_table(shown))
    if fits:
        best = fits[0]
        print(f"\nrecommended (predicted {best['tokens_per_s']:.0f} tok/s, {100 * best['mfu']:.1f}% MFU, "
              f"GPU {best['gpu_peak_gib']:.1f} GiB, host {best['host_peak_gib_per_node']:.0f} GiB/node):")
        print("  " + best["command"])
    if env.world > 1:
        print("note: " + MULTI_GPU_NOTE)
    print("note: predictions, not measurements; single-H200 points are checked by bench/plan_validation.py")
    return 0 if fits else 1


MULTI_GPU_NOTE = ("multi-GPU times use assumed NVLink / InfiniBand / PCIe bandwidths (plan_constants.json), not "
                  "measurements: no multi-GPU run has been made with this project")


if __name__ == "__main__":
    sys.exit(main())
