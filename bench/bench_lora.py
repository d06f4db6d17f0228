"""LoRA vs full fine-tuning of a Llama-2-7B-shaped model at 128K on one GPU: peak memory and tokens/s, one run.

    python bench/bench_lora.py                 # H200 (issue #18): 131072 tokens, LoRA rank 16 on q,k,v,o
    python bench/bench_lora.py --tiny          # CPU: code-path check on a tiny config (no numbers)

Both variants use the same EasyContext stack as bench_memory.py's "ours" (zigzag_ring_attn at W=1 -> kernel
facade, chunked LM head/loss, tiled MLP, lean fused RMSNorm, fused RoPE, checkpoint offload to pinned host
memory), batch 1, bf16 weights, random init. LoRA is applied the way train.py does it
(easy_context_train.lora.apply_lora: after the SP patch and the memory options, adapter dropout 0).
One step = forward + backward + optimizer step:
  full: every weight trains; AdamW with fp32 moments in host memory (bench_memory.CPUStateAdamW), since
        7B of fp32 moments (54 GB) plus weights and grads would crowd the GPU at 128K;
  lora: only the adapters train; torch AdamW on the GPU.
peak = torch.cuda.max_memory_allocated over the step (weights, grads, optimizer state, activations);
host = the process's peak RSS. A warm-up step at 4K precedes each variant (kernel plans, allocator).
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.bench_memory import CPUStateAdamW, configure, make_batch  # noqa: E402
from bench.common import env_line, table  # noqa: E402
from bench.llama7b import build_model, llama7b_config, model_flops_per_token, one_rank_group  # noqa: E402

GiB, KiB = 2**30, 2**10
PEAK_FLOPS = 989e12


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_args(tiny: bool) -> SimpleNamespace:
    """bench_memory's "ours" options (its argparse defaults)."""
    return SimpleNamespace(checkpointing="offload", every_k=1, host_gib=1e-4 if tiny else 40.0, probe_host_gib=72.0,
                           tiles="auto", selective=False, selective_layers=None, no_lean_norm=False,
                           no_fused_rope=False, probe_block=8192)


def step(model, base, optim, L, device):
    """One fwd+bwd+optimizer step; returns (loss, fwd_bwd seconds, optimizer seconds)."""
    from easy_context.memory import causal_lm_loss
    inp, pos, tgt = make_batch(base, L, device)
    _sync(device)
    t0 = time.perf_counter()
    loss = causal_lm_loss(base, inp, pos, tgt)
    loss.backward()
    _sync(device)
    t1 = time.perf_counter()
    optim.step()
    _sync(device)
    t2 = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    return float(loss.detach()), t1 - t0, t2 - t1


def run_variant(model, variant, args, device):
    from easy_context_train.lora import apply_lora
    configure(model, "ours", args.length, memory_args(args.tiny))
    if variant == "lora":
        model = apply_lora(model, SimpleNamespace(lora_rank=args.lora_rank, lora_alpha=None,
                                                  lora_targets=args.lora_targets, lora_train_embeddings_norms=False))
        base = model.get_base_model()
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    else:
        base = model
        optim = CPUStateAdamW(model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cfg = getattr(base, "_easy_context_offload", None)
    if cfg is not None and device.type == "cuda" and getattr(cfg, "offload", False):
        cfg.reserve(base.config.num_hidden_layers * args.length * base.config.hidden_size * 2)  # pin off the clock
    step(model, base, optim, 256 if args.tiny else 4096, device)  # warm-up (also creates the optimizer state)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    row = dict(variant=variant, L=args.length, trainable=f"{trainable / 1e6:.1f}M")
    try:
        loss, fb, opt = step(model, base, optim, args.length, device)
    except torch.OutOfMemoryError:
        row.update(status="OOM")
        return model, row
    tok_s = args.length / (fb + opt)
    row.update(status="ok", loss=round(loss, 4), fwd_bwd_s=round(fb, 1), opt_s=round(opt, 2), tok_s=round(tok_s),
               # the full-FT formula (6N + attention) for both: LoRA skips weight grads, so this overstates its work
               MFU_fullFT_formula=f"{100 * model_flops_per_token(base, args.length) * tok_s / PEAK_FLOPS:.1f}%")
    if device.type == "cuda":
        row["peak_GiB"] = round(torch.cuda.max_memory_allocated(device) / GiB, 2)
    row["host_peak_GiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB / GiB, 1)
    if isinstance(optim, CPUStateAdamW):
        optim.close()
    return model, row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="train.py's default targets")
    ap.add_argument("--tiny", action="store_true", help="tiny config; runs on CPU (code-path check)")
    args = ap.parse_args()
    if args.tiny:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.length = 1024
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_lora.py needs a CUDA GPU (use --tiny for a CPU code-path check)")
        device = torch.device("cuda")
    one_rank_group()
    model = build_model(llama7b_config(args.tiny), device)
    print(env_line(), f"| params {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B", flush=True)
    rows = []
    for variant in ("full", "lora"):  # full first: LoRA wraps the model in place
        model, row = run_variant(model, variant, args, device)
        rows.append(row)
        print(row, flush=True)
    print(f"\n## LoRA (rank {args.lora_rank}, {args.lora_targets}) vs full fine-tuning, Llama-2-7B shape, "
          f"{args.length} tokens, one GPU\n")
    print(env_line())
    print(table(rows, ["variant", "L", "trainable", "status", "loss", "fwd_bwd_s", "opt_s", "tok_s",
                       "MFU_fullFT_formula", "peak_GiB", "host_peak_GiB"]))
    ok = {r["variant"]: r for r in rows if r.get("status") == "ok"}
    if len(ok) == 2 and "peak_GiB" in ok["full"]:
        print(f"- LoRA / full: tokens/s {ok['lora']['tok_s'] / ok['full']['tok_s']:.2f}x, "
              f"peak memory {ok['lora']['peak_GiB'] / ok['full']['peak_GiB']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
