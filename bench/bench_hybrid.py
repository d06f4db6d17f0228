"""Recurrent layers of hybrid models under sequence parallelism: the chain's cost vs the layers' own (issue #30).

One recurrent layer of a real hybrid shape (gated DeltaNet of Qwen3-Next-80B-A3B: hidden 2048, 16 key / 32 value
heads of 128, conv 4; short conv of LFM2-1.2B: hidden 2048, kernel 3), L tokens in total (default 128K), W sp
ranks simulated on one GPU. Per layer, fwd+bwd, bf16:

  own/rank    the layer on L/W tokens from a zero state: what each rank would pay if the layers were
              perfectly parallel (the floor of any exact scheme)
  chain       easy_context.recurrent's chain over the W pieces in sequence order with state passing and the
              backward recompute (what the critical path of the real chain costs: pieces run one after another,
              so every rank waits for it)
  own/full    the plain layer on all L tokens at once (one GPU, no SP), where memory allows
  msg         bytes of one state message (conv window + recurrent state), sent 2 x (W-1) times per layer
              fwd+bwd (contiguous layouts; 2 x (2W-2) under zigzag), and its device-copy time
  peak/rank   peak memory of one piece's fwd+bwd (activations of L/W tokens)

    python bench/bench_hybrid.py                          # H200: 128K, W = 2, 4, 8
    python bench/bench_hybrid.py --tiny                   # CPU smoke run (seconds)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _layer(kind: str, tiny: bool, device, dtype):
    import transformers as tf
    if kind == "gated_deltanet":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
        kw = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8) if tiny else \
            dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128)
        cfg = tf.Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"], linear_conv_kernel_dim=4, **kw)
        layer = Qwen3NextGatedDeltaNet(cfg, 0)
        from easy_context.recurrent.init import slow_decay_
        slow_decay_(layer)
    else:
        from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
        cfg = tf.Lfm2Config(hidden_size=64 if tiny else 2048, num_hidden_layers=1, layer_types=["conv"],
                            conv_L_cache=3, conv_bias=False)
        layer = Lfm2ShortConv(cfg, 0)
    return layer.to(device=device, dtype=dtype), cfg.hidden_size


def _timer(device):
    if device.type == "cuda":
        from bench.common import cuda_time_ms
        return lambda fn: cuda_time_ms(fn, warmup=1, iters=3)

    def cpu_ms(fn):
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return cpu_ms


def _peak(device, fn) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def run(kind, length, worlds, tiny, device, dtype, full: bool):
    from easy_context.recurrent.adapter import get_adapter
    from easy_context.recurrent.chain import _Chain
    from easy_context.recurrent.layout import Piece, Plan
    layer, hidden = _layer(kind, tiny, device, dtype)
    adapter = get_adapter(layer)
    if adapter is None:
        import transformers
        raise SystemExit(f"{type(layer).__name__}: transformers {transformers.__version__} does not pass its state "
                         "through the hybrid-cache protocol easy_context.recurrent uses (tested: 5.24); install that")
    ms = _timer(device)
    rows = []

    def fwd_bwd(n, plan=None):
        x = torch.randn(1, n, hidden, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(1, n, hidden, device=device, dtype=dtype)

        def step():
            # the multi-rank path itself (autograd Function, recompute in backward); run_layer would take plain
            # autograd here because every piece is on this one process
            out = layer(x) if plan is None else _Chain.apply(plan, adapter, layer, x,
                                                             *[p for p in layer.parameters() if p.requires_grad])
            out.backward(dy)
            x.grad = None
            layer.zero_grad(set_to_none=True)
        return step

    state = adapter.zero_state(layer, 1, dtype, device)
    msg_bytes = sum(t.numel() * t.element_size() for t in state)
    copy_ms = ms(lambda: [t.clone() for t in state])
    own_full = ms(fwd_bwd(length)) if full else float("nan")
    for w in worlds:
        n = length // w
        own = ms(fwd_bwd(n))
        plan = Plan(0, tuple(Piece(0, i * n, n, i * n) for i in range(w)), None)  # every piece here, in order
        chain = ms(fwd_bwd(length, plan))
        rows.append({"layer": kind, "L": length, "W": w, "own/rank ms": f"{own:.1f}", "chain ms": f"{chain:.1f}",
                     "chain/own": f"{chain / own:.2f}", "own/full ms": f"{own_full:.1f}",
                     "msg KiB": f"{msg_bytes / 1024:.0f}", "msgs": 2 * (w - 1), "msg copy ms": f"{copy_ms:.3f}",
                     "peak/rank GiB": f"{_peak(device, fwd_bwd(n)):.2f}"})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=131072)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layers", nargs="+", default=["gated_deltanet", "short_conv"])
    p.add_argument("--no-full", action="store_true", help="skip the plain layer on all L tokens")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny layers, 256 tokens")
    args = p.parse_args(argv)
    from bench.common import env_line, table
    if args.tiny:
        device, dtype, length = torch.device("cpu"), torch.float32, 256
    else:
        from bench.common import require_cuda
        require_cuda()
        device, dtype, length = torch.device("cuda"), torch.bfloat16, args.length
    rows = []
    for kind in args.layers:
        rows += run(kind, length, args.worlds, args.tiny, device, dtype, full=not args.no_full)
    print(env_line())
    print(table(rows, list(rows[0])))
    print("chain/own: the serial chain's cost per layer over the perfectly parallel per-rank cost (W pieces run one "
          "after another, plus the backward recompute); msgs: state messages per layer fwd+bwd (contiguous layouts)")


if __name__ == "__main__":
    main()
