"""Attention kernels on one GPU: correctness of every facade backend vs float64, then TFLOP/s.

    python bench/bench_kernels.py [--lengths 8192 32768 131072] [--heads 32] [--head-dim 128]
                                  [--window 4096 --window-length 131072]   # sliding-window section

Causal, bf16, batch 1. Every backend of easy_context.kernels next to F.scaled_dot_product_attention
(PyTorch's own dispatch) in the same run; TFLOP/s counts causal matmul FLOPs (fwd+bwd = 3.5 × fwd).
Sliding window: the facade's document/window path (packing.Window pieces) with the window kernel (fa4's
window_size) vs the tiled path kernels without one take (band edges on the math kernel) vs full causal attention,
one document and a packed row; TFLOP/s of useful work (the (query, key) pairs the mask keeps).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import attn_flops, cuda_time_ms, env_line, require_cuda, table  # noqa: E402
from easy_context import kernels  # noqa: E402


def check_correctness():
    rows = []
    torch.manual_seed(0)
    for (lq, lk, hq, hkv, d, causal) in [(1024, 1024, 8, 8, 128, True), (1000, 1000, 6, 2, 64, True),
                                          (512, 1536, 8, 2, 128, False), (768, 768, 4, 2, 256, True)]:
        q = torch.randn(2, lq, hq, d, device="cuda", dtype=torch.float64)
        k = torch.randn(2, lk, hkv, d, device="cuda", dtype=torch.float64)
        v = torch.randn(2, lk, hkv, d, device="cuda", dtype=torch.float64)
        do = torch.randn_like(q)
        ro, rl = kernels.attn_forward(q, k, v, causal, backend="math")
        rg = kernels.attn_backward(do, q, k, v, ro, rl, causal, backend="math")
        for be in kernels.available_backends("cuda"):
            if be == "math":
                continue
            try:
                t = [x.bfloat16() for x in (q, k, v, do)]
                o, l = kernels.attn_forward(*t[:3], causal, backend=be)
                g = kernels.attn_backward(t[3], *t[:3], o, l, causal, backend=be)
                errs = [((a.double() - b).norm() / b.norm()).item() for a, b in
                        zip((o, l, *g), (ro, rl, *rg))]
                ok = all(e < 2e-2 for e in errs)
                rows.append(dict(backend=be, shape=f"{lq}x{lk} h{hq}/{hkv} d{d} causal={causal}",
                                 max_rel_err=f"{max(errs):.2e}", ok="yes" if ok else "NO"))
            except Exception as e:  # report, keep benchmarking the others
                rows.append(dict(backend=be, shape=f"{lq}x{lk}", max_rel_err=repr(e)[:80], ok="NO"))
    return rows


def bench(lengths, heads, head_dim):
    rows = []
    for L in lengths:
        q, k, v = (torch.randn(1, L, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        fwd_f, all_f = attn_flops(1, heads, L, L, head_dim, True), attn_flops(1, heads, L, L, head_dim, True, "fwd_bwd")
        iters = 3 if L >= 65536 else 10

        def sdpa_fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

        def sdpa_all():
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            torch.autograd.grad(o, (q, k, v), do.transpose(1, 2))
        t_f, t_a = cuda_time_ms(sdpa_fwd, 1, iters), cuda_time_ms(sdpa_all, 1, iters)
        base = fwd_f / t_f / 1e9, all_f / t_a / 1e9
        rows.append(dict(L=L, backend="F.sdpa (baseline)", fwd_TFLOPs=f"{base[0]:.0f}", fwd_bwd_TFLOPs=f"{base[1]:.0f}",
                         vs_sdpa="1.00"))
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        for be in kernels.available_backends("cuda"):
            if be == "math":
                continue
            try:
                def f():
                    return kernels.attn_forward(qd, kd, vd, True, backend=be)
                o, l = f()

                def fb():
                    o, l = kernels.attn_forward(qd, kd, vd, True, backend=be)
                    kernels.attn_backward(do, qd, kd, vd, o, l, True, backend=be)
                tf, ta = cuda_time_ms(f, 1, iters), cuda_time_ms(fb, 1, iters)
                rows.append(dict(L=L, backend=be, fwd_TFLOPs=f"{fwd_f / tf / 1e9:.0f}",
                                 fwd_bwd_TFLOPs=f"{all_f / ta / 1e9:.0f}", vs_sdpa=f"{(all_f / ta / 1e9) / base[1]:.2f}"))
            except Exception as e:
                rows.append(dict(L=L, backend=be, fwd_TFLOPs="error", fwd_bwd_TFLOPs=repr(e)[:60]))
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


def _windowed_rows(L, w, heads, head_dim, packed):
    """Fwd+bwd of one (L, L) block under a window w: window kernel, tiled fallback, and full causal attention."""
    from easy_context import packing
    from easy_context.kernels import documents
    g = torch.Generator().manual_seed(0)
    if packed:  # log-normal documents (median 3K tokens), the same row every run
        lens, left = [], L
        while left > 0:
            n = min(left, max(1, int(torch.empty(1).log_normal_(8.0, 1.0, generator=g).item())))
            lens.append(n)
            left -= n
        pos = torch.cat([torch.arange(n) for n in lens])[None]
    else:
        pos = torch.arange(L)[None]
    docs = packing.documents(pos, window=w)
    full = packing.documents(pos)
    idx = torch.arange(L)
    ids = docs.doc_ids[0]
    i = torch.arange(L)
    start = torch.zeros(L, dtype=torch.long)
    start[1:] = (ids[1:] != ids[:-1]).long()
    first = torch.cummax(torch.where(start.bool() | (i == 0), i, torch.zeros_like(i)), 0).values
    window_pairs = float(torch.minimum(i - first + 1, torch.full_like(i, w)).sum())
    causal_pairs = float((i - first + 1).sum())
    q, k, v, do = (torch.randn(1, L, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    rows = []

    def run(blk):
        o, l = kernels.attn_forward(q, k, v, True, docs=blk)
        kernels.attn_backward(do, q, k, v, o, l, True, docs=blk)

    def dense():
        o, l = kernels.attn_forward(q, k, v, True)
        kernels.attn_backward(do, q, k, v, o, l, True)
    def path(rev=True, local=True):
        def wrapped():
            old_rev, old_win = documents._reversed_causal, dict(documents.WINDOWED)
            if not rev:
                documents._reversed_causal = lambda *a: False
            if not local:
                documents.WINDOWED.clear()
            try:
                run(docs.block(idx, idx))
            finally:
                documents._reversed_causal = old_rev
                documents.WINDOWED.update(old_win)
        return wrapped
    cases = [("window kernel (fa4 window_size, default)", path()),
             ("tiles + reversed band squares (no window kernel)", path(local=False)),
             ("tiles, band edges on math (12-03 code)", path(rev=False, local=False)),
             ("full causal" + (" (documents)" if packed else ""),
              (lambda: run(full.block(idx, idx))) if full is not None else dense)]
    base = None
    for name, fn in cases:
        ms = cuda_time_ms(fn, 2, 3)  # two warm-ups: the first-timed path read ~2x slow with one (docs/memory.md)
        base = base or ms
        flops = 4.0 * heads * head_dim * (causal_pairs if name.startswith("full") else window_pairs) * 3.5
        rows.append(dict(L=L, window=w, row="packed" if packed else "one document", path=name, ms=f"{ms:.1f}",
                         useful_TFLOPs=f"{flops / ms / 1e9:.0f}", vs_default=f"{ms / base:.2f}x time"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=0, help="also time a sliding window of this many keys")
    ap.add_argument("--window-length", type=int, default=131072)
    ap.add_argument("--skip-dense", action="store_true", help="only the sliding-window section")
    args = ap.parse_args()
    require_cuda()
    print(env_line())
    corr, rows, wrows = [], [], []
    if not args.skip_dense:
        corr = check_correctness()
        print("\n## Correctness (bf16 vs float64 math, out/lse/dq/dk/dv, max relative error)\n")
        print(table(corr, ["backend", "shape", "max_rel_err", "ok"]))
        rows = bench(args.lengths, args.heads, args.head_dim)
        print(f"\n## Causal attention, {args.heads} heads x {args.head_dim}, bf16, batch 1\n")
        print(table(rows, ["L", "backend", "fwd_TFLOPs", "fwd_bwd_TFLOPs", "vs_sdpa"]))
    if args.window:
        for packed in (False, True):
            wrows += _windowed_rows(args.window_length, args.window, args.heads, args.head_dim, packed)
        print(f"\n## Sliding window {args.window}, fwd+bwd, {args.heads} heads x {args.head_dim}, bf16, "
              f"backend {kernels.choose_backend(torch.empty(1, 1, 1, args.head_dim, device='cuda', dtype=torch.bfloat16))}"
              "\n")
        print(table(wrows, ["L", "window", "row", "path", "ms", "useful_TFLOPs", "vs_default"]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_kernels.json"), "w") as f:
            json.dump(dict(env=env_line(), correctness=corr, rows=rows, window=wrows), f, indent=1)


if __name__ == "__main__":
    main()
