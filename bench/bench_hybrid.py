"""Recurrent layers of hybrid models under sequence parallelism: the parallel path and the serial chain against
the layers' own cost (issue #30).

ONE recurrent layer (not the whole model) of a real hybrid shape (gated DeltaNet of Qwen3-Next-80B-A3B: hidden
2048, 16 key / 32 value heads of 128, conv 4; short conv of LFM2-1.2B: hidden 2048, kernel 3), L tokens in total,
W sp ranks simulated on one device, one after another. Per layer, fwd+bwd (bf16 on a GPU, fp32 on the CPU):

  own/rank    the plain layer on L/W tokens from a zero state: what each rank would pay if the layer were
              perfectly parallel (the floor of any exact scheme)
  par/rank    one rank's work in the parallel path (delta_parallel.py / conv_parallel.py): its piece of L/W
              tokens through run_plan (the augmented chunk rule, the state correction, norm, out_proj); the
              ranks run at once, so this is the layer's time under SP up to the two small exchanges (par msg)
  chain       the serial chain (chain.py) over the W pieces in sequence order with state passing and the
              backward recompute: pieces run one after another, so every rank waits for it
  own/full    the plain layer on all L tokens at once (one device, no SP); --no-full skips it
  peak/rank   peak memory of one rank's fwd+bwd, own and parallel path (GPU only)
  msg KiB     per piece: the chain's state message (sent 2 x (W-1) times per layer fwd+bwd, contiguous layouts);
              the parallel path's published tail + (R, P) (to each of W-1 peers, forward and backward)

    python bench/bench_hybrid.py --length 32768                   # H200, W = 2, 4, 8
    python bench/bench_hybrid.py --length 131072 --iters 1 --no-full   # 128K within ~3 minutes (torch path)
    python bench/bench_hybrid.py --length 4096 --device cpu       # CPU: a small shape (hidden 256, heads of 64)
    python bench/bench_hybrid.py --tiny                           # CPU smoke run (seconds)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_SHAPES = {  # gated DeltaNet (hidden, key heads, value heads, head dim); short conv hidden
    "real": ((2048, 16, 32, 128), 2048),
    "small": ((256, 2, 4, 64), 256),
    "tiny": ((64, 2, 4, 8), 64),
}


def _layer(kind: str, size: str, device, dtype):
    import transformers as tf
    (hidden, hk, hv, d), conv_hidden = _SHAPES[size]
    if kind == "gated_deltanet":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
        cfg = tf.Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"], linear_conv_kernel_dim=4,
                                 hidden_size=hidden, linear_num_key_heads=hk, linear_num_value_heads=hv,
                                 linear_key_head_dim=d, linear_value_head_dim=d)
        layer = Qwen3NextGatedDeltaNet(cfg, 0)
        from easy_context.recurrent.init import slow_decay_
        slow_decay_(layer)
    else:
        from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
        cfg = tf.Lfm2Config(hidden_size=conv_hidden, num_hidden_layers=1, layer_types=["conv"], conv_L_cache=3,
                            conv_bias=False)
        layer = Lfm2ShortConv(cfg, 0)
    return layer.to(device=device, dtype=dtype), cfg.hidden_size


def _timer(device, iters):
    if device.type == "cuda":
        from bench.common import cuda_time_ms
        return lambda fn: cuda_time_ms(fn, warmup=1, iters=iters)

    def cpu_ms(fn):  # median of iters after one warm-up call
        fn()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]
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


def run(kind, length, worlds, size, device, dtype, full: bool, iters: int):
    from easy_context.recurrent.adapter import get_adapter
    from easy_context.recurrent.chain import _Chain
    from easy_context.recurrent.layout import Piece, Plan
    layer, hidden = _layer(kind, size, device, dtype)
    adapter = get_adapter(layer)
    if adapter is None:
        import transformers
        raise SystemExit(f"{type(layer).__name__}: transformers {transformers.__version__} does not pass its state "
                         "through the hybrid-cache protocol easy_context.recurrent uses (tested: 5.24); install that")
    ms = _timer(device, iters)
    params = [p for p in layer.parameters() if p.requires_grad]
    rows = []

    def fwd_bwd(n, how="own", w=1):
        x = torch.randn(1, n, hidden, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(1, n, hidden, device=device, dtype=dtype)
        m = n // w
        chain_plan = Plan(0, tuple(Piece(0, i * m, m, i * m) for i in range(w)), None)  # every piece here, in order
        one = Plan(0, (Piece(0, 0, n, 0),), None)

        def step():
            if how == "own":
                out = layer(x)
            elif how == "par":  # one rank's parallel path (run_layer would take plain autograd: one piece here)
                out = adapter.run_plan(one, layer, x)
            else:  # the multi-rank chain itself (autograd Function, recompute in backward)
                out = _Chain.apply(chain_plan, adapter, layer, x, *params)
            out.backward(dy)
            x.grad = None
            layer.zero_grad(set_to_none=True)
        return step

    state = adapter.zero_state(layer, 1, dtype, device)
    msg_bytes = sum(t.numel() * t.element_size() for t in state)
    par_bytes = state[0].numel() * state[0].element_size() + 4  # conv tail + passes flag
    if len(state) > 1:  # (R, P): H x d_k x (d_v + d_k) float32
        _, h, dk, dv = state[1].shape
        par_bytes += h * dk * (dv + dk) * 4
    with torch.no_grad():  # the simulated rank's output equals the layer's (zero incoming state)
        x = torch.randn(1, min(length, 4096), hidden, device=device, dtype=dtype)
        want = layer(x).float()
        got = adapter.run_plan(Plan(0, (Piece(0, 0, x.shape[1], 0),), None), layer, x).float()
        err = ((got - want).norm() / want.norm()).item()
    own_full = ms(fwd_bwd(length)) if full else float("nan")
    for w in worlds:
        n = length // w
        own, par = ms(fwd_bwd(n)), ms(fwd_bwd(n, "par"))
        chain = ms(fwd_bwd(n * w, "chain", w))
        rows.append({"layer": kind, "L": length, "W": w, "own/rank ms": f"{own:.1f}", "par/rank ms": f"{par:.1f}",
                     "par/own": f"{par / own:.2f}", "chain ms": f"{chain:.1f}", "chain/own": f"{chain / own:.2f}",
                     "chain/par": f"{chain / par:.2f}", "own/full ms": f"{own_full:.1f}",
                     "own peak GiB": f"{_peak(device, fwd_bwd(n)):.2f}",
                     "par peak GiB": f"{_peak(device, fwd_bwd(n, 'par')):.2f}",
                     "chain msg KiB": f"{msg_bytes / 1024:.0f}", "par msg KiB": f"{par_bytes / 1024:.0f}",
                     "par err": f"{err:.1e}"})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=32768, help="tokens in the whole sequence")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layers", nargs="+", default=["gated_deltanet", "short_conv"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--size", choices=sorted(_SHAPES), default=None,
                   help="layer shape: real (default on cuda), small (default on cpu), tiny")
    p.add_argument("--iters", type=int, default=3, help="timed calls per figure (median), after one warm-up")
    p.add_argument("--no-full", action="store_true", help="skip the plain layer on all L tokens")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny layers, 256 tokens")
    args = p.parse_args(argv)
    from bench.common import env_line, table
    if args.tiny:
        args.device, args.size, args.length = "cpu", "tiny", 256
    if args.device == "cuda":
        from bench.common import require_cuda
        require_cuda()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = args.size or ("real" if device.type == "cuda" else "small")
    rows = []
    for kind in args.layers:
        rows += run(kind, args.length, args.worlds, size, device, dtype, not args.no_full, args.iters)
    print(env_line() + f"; {args.device}, {dtype}, shape {size}; ONE layer fwd+bwd, W simulated on one device")
    print(table(rows, list(rows[0])))
    print("par/own: the parallel path's per-rank cost over the plain layer on the same L/W tokens (ranks run at "
          "once); chain/own: the serial chain over the same (W pieces one after another, plus the backward "
          "recompute); chain/par: what the parallel path saves. par err: relative error of the simulated rank vs the "
          "plain layer (forward, zero incoming state). Exchanges (msg KiB) are not timed.")


if __name__ == "__main__":
    main()
