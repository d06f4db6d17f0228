"""GPU memory per token of a Llama-2-7B-shaped model on one GPU: ours vs plain Hugging Face, same run.

    python bench/bench_memory.py                      # H200: the whole run stays within --budget-s (510 s)
    python bench/bench_memory.py --tiny               # CPU: code-path check on a tiny config (no numbers)

hf:      transformers SDPA + per-layer gradient checkpointing + ``model(labels=...)`` (full fp32 logits).
ours:    EasyContext at W=1 (zigzag_ring_attn -> kernel facade, cuDNN on Hopper) + chunked LM head/loss +
         tiled MLP + lean fused RMSNorm + fused RoPE + checkpoint offload (layer inputs in pinned host memory, copies
         overlapped; one kept per k layers when the host budget --host-gib is short).
ours-off: EasyContext at W=1 with every memory option off (layer checkpointing, HF logits + loss): the
         reference for "no more than 10% tokens/s lost at 128K".
probe:   ours with attention replaced by block-local causal attention (same kernel, blocks of 8K tokens):
         the memory of a step at lengths whose full causal attention would not finish within the budget.
         A memory measurement only: not a training step, no tokens/s reported.
Each point is ONE forward+backward (batch 1, bf16 weights, random init) after a short warm-up at 4K:
peak = torch.cuda.max_memory_allocated (weights + grads included); slope = least-squares fit of peak vs
tokens over the real (non-probe) points of each implementation; projected max = where the fit meets the
GPU's memory. One optimizer step (AdamW, fp32 m/v in CPU memory, update computed on the GPU one
parameter at a time; bf16 weights updated in place) follows ours' fwd+bwd at --opt-length.
Before each point the time it would take is extrapolated (quadratic in length) and the point is skipped
if it would overrun the budget; an out-of-memory is caught and reported.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import env_line, table  # noqa: E402
from bench.llama7b import build_model, llama7b_config, model_flops_per_token, one_rank_group  # noqa: E402

PEAK_FLOPS = 989e12
GiB, KiB = 2**30, 2**10


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------
def keep_every_k(model, L, host_gib):
    """Smallest k so that the kept (offloaded) layer inputs fit in host_gib of pinned memory."""
    c = model.config
    need = c.num_hidden_layers * L * c.hidden_size * 2 / GiB
    return max(1, math.ceil(need / host_gib))


def pick_selective(n_layers: int, every_k: int, n: int) -> list[int]:
    """The ``n`` layers whose attention recompute costs most: in a nested group of k layers the j-th (0-based)
    is recomputed k - j times in the backward; ties go to later layers (their backward comes first)."""
    order = sorted(range(n_layers), key=lambda i: (-(every_k - i % every_k), -i))
    return sorted(order[:max(0, min(n, n_layers))])


def configure(model, impl, L, args):
    from easy_context import apply_seq_parallel_monkey_patch
    from easy_context.memory import configure_memory
    from easy_context.ops import apply_fused_ops, remove_fused_ops
    _restore_attention(model)
    remove_fused_ops(model)
    if impl == "hf":
        apply_seq_parallel_monkey_patch("data_parallel", model)
        return configure_memory(model, "layer")
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    if impl == "ours-off":
        return configure_memory(model, "layer")
    host = args.probe_host_gib if impl == "probe" else args.host_gib
    if getattr(args, "auto", False) and impl == "ours":  # k and selective layers from the budgets (memory/auto.py)
        from easy_context.memory.auto import auto_checkpointing
        choice, cfg = auto_checkpointing(model, L, host_budget=host * 2**30, margin=args.auto_margin,
                                         gpu_budget=None if torch.cuda.is_available() else 8 * 2**30,  # --tiny
                                         tiled_mlp="auto" if args.tiles == "auto" else int(args.tiles),
                                         lean_norm=not args.no_lean_norm,
                                         head_chunks="auto" if args.head_chunks is None else args.head_chunks)
        print("auto checkpointing:", choice.describe(), flush=True)
        if not args.no_fused_rope:
            apply_fused_ops(model, norms=False, rope=True)
        return cfg
    k = keep_every_k(model, L, host) if args.checkpointing == "offload" else args.every_k
    some = None
    if args.selective_layers is not None and impl == "ours":
        some = pick_selective(model.config.num_hidden_layers, k if args.checkpointing in ("offload", "nested") else 1,
                              args.selective_layers)
    cfg = configure_memory(model, args.checkpointing, offload_every_k=k,
                           tiled_mlp="auto" if args.tiles == "auto" else int(args.tiles),
                           selective=args.selective or some is not None, lean_norm=not args.no_lean_norm,
                           selective_layers=some,
                           keep_nested_attention=not getattr(args, "recompute_nested", False),
                           head_chunks=(getattr(args, "head_chunks", None) or 1) if impl in ("ours", "probe") else 1)
    if not args.no_fused_rope:
        apply_fused_ops(model, norms=False, rope=True)
    if impl == "probe":
        _block_attention(model, args.probe_block)
    return cfg


def _block_attention(model, block):
    """Block-local causal attention (memory stand-in for full causal attention at probe lengths)."""
    import torch.nn.functional as F
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from easy_context.attention_cache import cached_attention

    def local(query, key, value, scaling):
        b, h, s, d = query.shape
        bs = min(block, s)
        assert s % bs == 0, f"probe length {s} must be a multiple of the block {bs}"

        def blocks(x):
            return x.reshape(b, x.shape[1], s // bs, bs, d).transpose(1, 2).reshape(b * (s // bs), x.shape[1], bs, d)
        out = F.scaled_dot_product_attention(blocks(query), blocks(key), blocks(value), is_causal=True,
                                             scale=scaling, enable_gqa=key.shape[1] != h)
        return out.reshape(b, s // bs, h, bs, d).permute(0, 1, 3, 2, 4).reshape(b, s, h, d)

    class Local(torch.autograd.Function):
        """Lean like the modes' attentions (keeps q, k, v; its output goes through the attention cache), so
        selective / nested checkpointing and head groups (memory/head_chunks.py) treat it as they treat them."""

        @staticmethod
        def forward(ctx, q, k, v, scaling):
            (out,) = cached_attention(lambda: (local(q, k, v, scaling),))
            ctx.save_for_backward(q, k, v)
            ctx.scaling = scaling
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
            with torch.enable_grad():
                out = local(q, k, v, ctx.scaling)
            return (*torch.autograd.grad(out, (q, k, v), dout), None)

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        return Local.apply(query, key, value, scaling), None
    attention.supports_attention_cache = True

    AttentionInterface.register("ec_block_probe", attention)
    AttentionMaskInterface.register("ec_block_probe", lambda *a, **k: None)
    model._ec_probe_prev = model.config._attn_implementation
    model.set_attn_implementation("ec_block_probe")


def _restore_attention(model):
    prev = model.__dict__.pop("_ec_probe_prev", None)
    if prev is not None:
        model.set_attn_implementation(prev)


# ------------------------------------------------------------------------------------------------
# one optimizer step with CPU-resident AdamW states
# ------------------------------------------------------------------------------------------------
class CPUStateAdamW:
    """AdamW whose fp32 moments live in (pinned) host memory; each parameter's update runs on its device.

    Host memory 8 bytes/parameter (50 GiB for 6.7B); GPU transient: a few fp32 copies of the largest
    parameter. Weights stay bf16 (no fp32 master copy: +4 bytes/parameter on the host if wanted). Copies
    are asynchronous (pinned host buffers), so the PCIe traffic overlaps the per-parameter math.
    """

    def __init__(self, params, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.state: dict[int, tuple] = {}
        self.t = 0
        self.pinned = True
        self.registered: list = []

    def _host(self, like):
        t = torch.empty(like.shape, dtype=torch.float32)
        if self.pinned and like.is_cuda:  # page-lock exactly this tensor (torch's pinned pool rounds up)
            nbytes = t.numel() * t.element_size()
            self.pinned = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)) == 0
            if self.pinned:
                self.registered.append(t)
        else:
            self.pinned = False
        return t

    def close(self):
        """Unpin and drop the host states."""
        if self.registered:
            torch.cuda.synchronize()
            for t in self.registered:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self.registered, self.state = [], {}

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for p in self.params:
            if p.grad is None:
                continue
            st = self.state.get(id(p))
            if st is None:  # first step: moments start at zero on the device, no upload
                m = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                v = torch.zeros_like(m)
            else:
                m, v = (s.to(p.device, non_blocking=True) for s in st)
            g = p.grad.float()
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            upd = (m / bc1).div_((v / bc2).sqrt_().add_(self.eps))
            w = p.float().mul_(1 - self.lr * self.wd).add_(upd, alpha=-self.lr)
            p.copy_(w)
            if st is None:
                st = self.state[id(p)] = (self._host(m), self._host(v))
            st[0].copy_(m, non_blocking=self.pinned)
            st[1].copy_(v, non_blocking=self.pinned)
            # m, v are freed here; the caching allocator keeps them until the copies on this stream end
            del m, v, g, upd, w
        if self.params and self.params[0].is_cuda:
            torch.cuda.current_stream(self.params[0].device).synchronize()

    def host_bytes(self):
        return sum(s.numel() * s.element_size() for st in self.state.values() for s in st)


# ------------------------------------------------------------------------------------------------
# one measured point
# ------------------------------------------------------------------------------------------------
def make_batch(model, L, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, L + 1), generator=g).to(device)
    tgt = ids[:, 1:].clone()
    return ids[:, :-1], torch.arange(L, device=device).unsqueeze(0), tgt


def fwd_bwd(model, impl, L, device):
    from easy_context.memory import causal_lm_loss
    inp, pos, tgt = make_batch(model, L, device)
    if impl in ("hf", "ours-off"):
        # HF's labels= path shifts internally: labels = the inputs
        loss = model(input_ids=inp, position_ids=pos, labels=inp, use_cache=False).loss
    else:
        loss = causal_lm_loss(model, inp, pos, tgt)
    loss.backward()
    return float(loss.detach())


def cleanup(model, device):
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(model, impl, L, args, device, opt=False):
    cfg = configure(model, impl, L, args)
    row = dict(impl=impl, L=L, k=getattr(cfg, "offload_every_k", "") if impl in ("ours", "probe") else "")
    if getattr(cfg, "selective_layers", None) is not None:
        row["sel"] = len(cfg.selective_layers)
    if getattr(cfg, "head_chunks", 1) > 1:  # --auto may choose them: the row says what ran
        row["heads"] = cfg.head_chunks
    mgr = getattr(cfg, "offload", None)
    if mgr is not None and device.type == "cuda" and mgr.offload:
        # pin the host chunks off the clock (pinning is slow); the pool is reused by later lengths
        n_kept = math.ceil(model.config.num_hidden_layers / mgr.every_k)
        mgr.reserve(n_kept * L * model.config.hidden_size * 2)
    cleanup(model, device)
    if mgr is not None and device.type == "cuda" and getattr(args, "timeline", False) and impl == "ours":
        from bench.offload_timeline import Timeline
        mgr.timeline = Timeline()  # events only: no synchronisation inside the step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    try:
        loss = fwd_bwd(model, impl, L, device)
        _sync(device)
    except torch.OutOfMemoryError:
        row.update(status="OOM", secs=round(time.perf_counter() - t0, 1))
        cleanup(model, device)
        return row
    except Exception as e:  # keep the run (and the other implementations' rows) going
        row.update(status=f"error: {type(e).__name__}: {str(e)[:160]}", secs=round(time.perf_counter() - t0, 1))
        cleanup(model, device)
        return row
    dt = time.perf_counter() - t0
    row.update(status="ok", secs=round(dt, 1), loss=round(loss, 4))
    if mgr is not None and mgr.timeline is not None:
        tl, mgr.timeline = mgr.timeline, None
        summary = tl.summary()
        row["timeline"] = summary
        print(f"offload timeline {impl} L={L}: {summary}", flush=True)
        if os.environ.get("OUT"):
            tl.chrome_trace(os.path.join(os.environ["OUT"], f"offload_trace_{L}.json"))
    if device.type == "cuda":
        row["peak_GiB"] = round(torch.cuda.max_memory_allocated(device) / GiB, 2)
    row["host_peak_GiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB / GiB, 1)  # process RSS
    if impl != "probe":
        tok_s = L / dt
        row["tok_s"] = round(tok_s)
        row["MFU"] = f"{100 * model_flops_per_token(model, L) * tok_s / PEAK_FLOPS:.1f}%"
    if opt:
        if mgr is not None:
            mgr.release_pool()  # the optimizer's host states need that memory
        opt_row = optimizer_step(model, device)
        row.update(opt_row)
    cleanup(model, device)
    return row


def measure_or_retry(model, impl, L, args, device, left, opt=False):
    """``measure``; under --auto an OOM means the budgets' margin was too thin: choose again with a margin 0.04 wider
    and run again (``--auto-retries`` times, while the time budget ``left()`` allows), so a 512K device session is
    not lost to one OOM. A retried row carries the margin it ran with."""
    row = measure(model, impl, L, args, device, opt=opt)
    for _ in range(args.auto_retries if (args.auto and impl == "ours") else 0):
        if row["status"] != "OOM" or (row["secs"] > left() and not args.tiny):
            break
        args.auto_margin = round(args.auto_margin + 0.04, 2)
        print(f"OOM after {row['secs']} s: --auto again with margin {args.auto_margin}", flush=True)
        row = dict(measure(model, impl, L, args, device, opt=opt), auto_margin=args.auto_margin)
    return row


def optimizer_step(model, device):
    optim = CPUStateAdamW(model.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    try:
        optim.step()
        _sync(device)
        res = dict(opt_status="ok", opt_secs=round(time.perf_counter() - t0, 1),
                   opt_host_GiB=round(optim.host_bytes() / GiB, 1), opt_pinned=optim.pinned)
        if device.type == "cuda":
            res["opt_peak_GiB"] = round(torch.cuda.max_memory_allocated(device) / GiB, 2)
    except Exception as e:  # OOM (GPU or host pinning) must not end the run
        res = dict(opt_status=f"{type(e).__name__}: {str(e)[:120]}")
    optim.close()
    del optim
    gc.collect()
    return res


def predict_secs(points, L):
    """Step time at L from measured (length, secs): t = a·L + b·L² through the last two points (linear
    layers + causal attention), a, b >= 0; one point: scale quadratically (pessimistic)."""
    if len(points) == 1:
        (l1, t1), = points
        return t1 * (L / l1) ** 2
    (l1, t1), (l2, t2) = points[-2:]
    b = max(0.0, (t2 / l2 - t1 / l1) / (l2 - l1))
    a = max(0.0, t2 / l2 - b * l2)
    return a * L + b * L * L


def fit_slope(rows):
    """Least-squares peak = a + b·L over ok rows; returns (b in KiB/token, a in GiB) or None."""
    pts = [(r["L"], r["peak_GiB"]) for r in rows if r.get("status") == "ok" and "peak_GiB" in r]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return b * GiB / KiB, my - b * mx


# ------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-lengths", type=int, nargs="*", default=[32768, 65536, 131072])
    ap.add_argument("--ours-lengths", type=int, nargs="*", default=[32768, 65536, 131072, 262144, 524288])
    ap.add_argument("--off-lengths", type=int, nargs="*", default=[131072],
                    help="lengths for ours with every memory option off (the 10%% speed reference)")
    ap.add_argument("--opt-length", type=int, default=262144, help="ours' point followed by an optimizer step")
    ap.add_argument("--probe-lengths", type=int, nargs="*", default=[1048576, 786432, 524288],
                    help="memory probes (block-local attention), largest first; stops at the first that fits")
    ap.add_argument("--probe-block", type=int, default=8192)
    ap.add_argument("--checkpointing", default="offload", choices=["offload", "nested", "layer", "selective"])
    ap.add_argument("--every-k", type=int, default=1, help="kept input every k layers (nested/layer modes)")
    ap.add_argument("--host-gib", type=float, default=40.0,
                    help="pinned host memory for offloaded layer inputs; sets k = ceil(need / this)")
    ap.add_argument("--probe-host-gib", type=float, default=72.0,
                    help="pinned host memory for the probes (no optimizer states are held then)")
    ap.add_argument("--tiles", default="auto", help="tiled MLP: 'auto' (~hidden_size tokens/tile) or a count")
    ap.add_argument("--selective", action="store_true", help="ours also keeps attention outputs (faster)")
    ap.add_argument("--selective-layers", type=int, default=None,
                    help="ours keeps the attention output of this many layers only (those recomputed most)")
    ap.add_argument("--auto", action="store_true",
                    help="ours: offload k and selective layers chosen from free GPU memory and --host-gib "
                    "(memory/auto.py)")
    ap.add_argument("--auto-margin", type=float, default=0.06,
                    help="--auto: share of the free GPU memory left unplanned (raise it after an OOM)")
    ap.add_argument("--auto-retries", type=int, default=1,
                    help="--auto: after an OOM, choose again with a margin 0.04 wider and run again, this many times "
                    "(if the time budget allows)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="ours: run each length's step this many times in the process (min / median / max; the "
                    "median is the row's time)")
    ap.add_argument("--timeline", action="store_true",
                    help="ours: CUDA-event timeline of the offload copies, compute and stalls "
                    "($OUT/offload_trace_L.json)")
    ap.add_argument("--recompute-nested", action="store_true",
                    help="inner layers of a nested group recompute attention twice (the pre-2026-12-04 behaviour)")
    ap.add_argument("--head-chunks", type=int, default=None,
                    help="ours/probe: attention blocks in this many head groups, backward one at a time "
                    "(memory/head_chunks.py); default 1, with --auto chosen from the budgets")
    ap.add_argument("--no-lean-norm", action="store_true", help="ours without the lean (fused) RMSNorm")
    ap.add_argument("--no-fused-rope", action="store_true", help="ours with HF's RoPE instead of the fused one")
    ap.add_argument("--budget-s", type=float, default=510.0, help="whole-run wall-clock budget (seconds)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the 7B shape with this many decoder layers (e.g. 4: a real 1M-token step's per-layer time "
                         "and memory within one device call; a full 32-layer 1M step takes ~35 min)")
    ap.add_argument("--tiny", action="store_true", help="tiny config; runs on CPU (code-path check)")
    args = ap.parse_args()
    t_start = time.perf_counter()

    if args.tiny:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.hf_lengths, args.ours_lengths, args.off_lengths = [256, 512], [256, 512, 1024], [512]
        args.opt_length, args.probe_lengths, args.probe_block = 1024, [2048, 1024], 256
        args.host_gib = args.probe_host_gib = 1e-4  # force k > 1 (nested) on the tiny model
        if args.auto:  # auto refuses a host budget under one layer input: room for a few at 1024 tokens
            args.host_gib = 1e-3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_memory.py needs a CUDA GPU (use --tiny for a CPU code-path check)")
        device = torch.device("cuda")
    one_rank_group()
    config = llama7b_config(args.tiny)
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit(f"--layers {args.layers}: must be >= 1")
        config.num_hidden_layers = args.layers
    model = build_model(config, device)
    total_gib = torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else None
    print(env_line(), f"| params {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B, "
          f"layers: {model.config.num_hidden_layers}", flush=True)

    # warm-up (cuDNN plans, allocator) at a short length, off the table
    warm = 256 if args.tiny else 4096
    for impl in ("hf", "ours"):
        measure(model, impl, warm, args, device)

    plan = []
    for L in sorted(set(args.hf_lengths) | set(args.ours_lengths) | set(args.off_lengths)):
        if L in args.hf_lengths:
            plan.append(("hf", L))
        if L in args.ours_lengths:
            plan.append(("ours", L))
        if L in args.off_lengths:
            plan.append(("ours-off", L))
    rows, last, dead = [], {}, set()

    def left():
        return args.budget_s - (time.perf_counter() - t_start)

    def save(**extra):  # after every point: a crash or a kill still leaves the rows so far
        if os.environ.get("OUT"):
            os.makedirs(os.environ["OUT"], exist_ok=True)
            name = "bench_memory.json" if (args.head_chunks or 1) == 1 else f"bench_memory_heads{args.head_chunks}.json"
            with open(os.path.join(os.environ["OUT"], name), "w") as fh:
                json.dump(dict(env=env_line(), args=vars(args), rows=rows, **extra), fh, indent=1)

    for impl, L in plan:
        if impl in dead:
            rows.append(dict(impl=impl, L=L, status="skipped (failed at a shorter length)"))
            continue
        pts = last.get(impl) or last.get("ours") or []
        opt = L == args.opt_length and impl == "ours"
        if pts:
            pred = predict_secs(pts, L) + (45 if opt else 0)
            if pred > left() and not args.tiny:
                rows.append(dict(impl=impl, L=L, status=f"skipped (time: ~{pred:.0f}s > {left():.0f}s left)"))
                print(rows[-1], flush=True)
                continue
        row = measure_or_retry(model, impl, L, args, device, left, opt=opt)
        if impl == "ours" and args.repeat > 1 and row["status"] == "ok":  # the same step again, same process
            runs = [row["secs"]]
            for _ in range(args.repeat - 1):
                if runs[-1] > left() and not args.tiny:
                    break
                again = measure(model, impl, L, args, device)
                print(f"repeat {len(runs) + 1}: {again}", flush=True)
                if again["status"] != "ok":
                    break
                runs.append(again["secs"])
            ordered = sorted(runs)
            row.update(runs_s=runs, min_s=ordered[0], median_s=ordered[len(ordered) // 2], max_s=ordered[-1])
            row["secs"] = ordered[len(ordered) // 2]
            if row["secs"] > 0:
                row["tok_s"] = round(L / row["secs"])
                row["MFU"] = f"{100 * model_flops_per_token(model, L) * row['tok_s'] / PEAK_FLOPS:.1f}%"
        rows.append(row)
        print(row, flush=True)
        save()
        if row["status"] != "ok":
            dead.add(impl)
        else:
            last.setdefault(impl, []).append((L, row["secs"]))

    # memory probes: the largest length that fits, within what is left of the budget
    ours_ok = [r for r in rows if r["impl"] == "ours" and r.get("status") == "ok"]
    lin = (ours_ok[0]["secs"] / ours_ok[0]["L"]) if ours_ok else None  # s/token at the shortest length
    for L in args.probe_lengths:
        pred = (lin or 0) * L * 1.3
        if not args.tiny and pred > left():
            rows.append(dict(impl="probe", L=L, status=f"skipped (time: ~{pred:.0f}s > {left():.0f}s left)"))
            print(rows[-1], flush=True)
            continue
        row = measure(model, "probe", L, args, device)
        rows.append(row)
        print(row, flush=True)
        save()
        if row["status"] == "ok":
            break
    _restore_attention(model)

    # summary
    fits = {}
    for impl in ("hf", "ours"):
        f = fit_slope([r for r in rows if r["impl"] == impl])
        if f:
            slope, icpt = f
            proj = int((total_gib - icpt) * GiB / (slope * KiB)) if total_gib else None
            fits[impl] = dict(slope_KiB_per_token=round(slope, 1), intercept_GiB=round(icpt, 1),
                              projected_max_tokens=proj)
    longest = {impl: max([r["L"] for r in rows if r["impl"] == impl and r.get("status") == "ok"], default=None)
               for impl in ("hf", "ours", "probe")}
    speed = {}
    for r in rows:
        if r["impl"] == "ours-off" and r.get("status") == "ok":
            mine = next((o for o in rows if o["impl"] == "ours" and o["L"] == r["L"] and o.get("status") == "ok"),
                        None)
            if mine:
                speed[r["L"]] = round(mine["tok_s"] / r["tok_s"], 3)

    cols = ["impl", "L", "k", "sel", "heads", "status", "secs", "peak_GiB", "tok_s", "MFU", "opt_secs", "opt_peak_GiB",
            "opt_host_GiB", "host_peak_GiB"]
    print("\n## Memory: Llama-2-7B shape, one GPU, fwd+bwd, batch 1, bf16\n")
    print(env_line())
    print(table(rows, cols))
    for impl, f in fits.items():
        print(f"- {impl}: slope {f['slope_KiB_per_token']} KB/token, intercept {f['intercept_GiB']} GiB, "
              f"projected max {f['projected_max_tokens']} tokens on {total_gib and round(total_gib, 1)} GiB")
    print(f"- longest length reached: {longest}")
    for L, ratio in speed.items():
        print(f"- tokens/s ours / ours-off at {L}: {ratio}")
    print(f"- total wall time {time.perf_counter() - t_start:.0f}s (budget {args.budget_s:.0f}s)")
    summary = dict(fits=fits, longest=longest, speed_ratio_vs_off=speed, total_GiB=total_gib)
    save(**summary)
    return summary


if __name__ == "__main__":
    main()
