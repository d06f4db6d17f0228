"""Recurrent layers of hybrid models under sequence parallelism: the parallel path and the serial chain against
the layers' own cost (issue #30).

ONE recurrent layer (not the whole model) of a real hybrid shape (gated DeltaNet of Qwen3-Next-80B-A3B: hidden
2048, 16 key / 32 value heads of 128, conv 4; short conv of LFM2-1.2B: hidden 2048, kernel 3), L tokens in total,
W sp ranks simulated on one device, one after another. Per layer, fwd+bwd (bf16 on a GPU, fp32 on the CPU):

  own/rank    the plain layer on L/W tokens from a zero state: what each rank would pay if the layer were
              perfectly parallel (the floor of any exact scheme)
  par/rank    one rank's work in the parallel path (delta_parallel.py / conv_parallel.py): its piece of L/W
              tokens through run_plan (gated DeltaNet: the state-only pre-pass, one kernel pass from the incoming
              state, the adjoint in backward; norm, out_proj); the ranks run at once, so this is the layer's time
              under SP up to the two small exchanges (par msg)
  old/rank    gated DeltaNet only: the same through the identity-column path it replaced (bench/delta_identity.py)
  par/share   par/rank over own/full / W: the per-rank share of one process running all L tokens
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
    python bench/bench_hybrid.py --model --lengths 32768 131072 --length 131072 --worlds 8 --no-chain
    python bench/bench_hybrid.py --model --lengths 524288 --steps 1 --no-layer   # 512K (the twin: ~80 s a step)
    python bench/bench_hybrid.py --model --tiny                   # CPU smoke run of --model

--model: a Qwen3.5-9B-width text stack (hidden 4096, MLP 12288, attention 16 x 256 / 4 kv heads, gated DeltaNet
16 key / 32 value heads of 128, conv 4), --model-layers layers (default 4: 3 gated DeltaNet : 1 attention) vs the
same stack with attention in every layer; fwd+bwd tokens/s and peak memory of one training step on one GPU through
EasyContext's path on one rank (zigzag at W = 1: attention through the kernel facade, fa4 when installed; the
recurrent layers' own forward, fla when installed), chunked loss, per-layer checkpointing, tiled MLP from 256K on.
Then the per-layer rows above for the gated DeltaNet layer of that width (--worlds, default 8).

Kernels: the gated DeltaNet path logs its backend once ("gated DeltaNet: fla 0.6.0 chunk kernel ..." or "torch
reference path"); EASY_CONTEXT_DELTA_KERNEL=torch|fla forces one.
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
    "qwen35": ((4096, 16, 32, 128), 2048),  # Qwen3.5-9B's gated DeltaNet
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


def _timer(device, iters, warmup=1):
    if device.type == "cuda":
        from bench.common import cuda_time_ms
        return lambda fn: cuda_time_ms(fn, warmup=warmup, iters=iters)

    def cpu_ms(fn):  # median of iters after the warm-up calls
        for _ in range(warmup):
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


def run(kind, length, worlds, size, device, dtype, full: bool, iters: int, compare_old: bool = True,
        with_chain: bool = True):
    from easy_context.recurrent.adapter import get_adapter
    from easy_context.recurrent.chain import _Chain
    from easy_context.recurrent.pieces import Piece, Plan
    from bench.delta_identity import run_plan as identity_plan
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
            elif how == "old":  # the identity-column path the pre-pass replaced
                out = identity_plan(one, layer, x)
            else:  # the multi-rank chain itself (autograd Function, recompute in backward)
                out = _Chain.apply(chain_plan, adapter, layer, x, *params)
            out.backward(dy)
            x.grad = None
            layer.zero_grad(set_to_none=True)
        return step

    state = adapter.zero_state(layer, 1, dtype, device)
    msg_bytes = sum(t.numel() * t.element_size() for t in state)
    par_bytes = state[0].numel() * state[0].element_size() + 4  # conv tail + passes flag
    if len(state) > 1:  # (R, P) forward, D backward: H x d_k x (d_v + d_k) float32
        _, h, dk, dv = state[1].shape
        par_bytes += h * dk * (dv + dk) * 4
    with torch.no_grad():  # the simulated rank's output equals the layer's (zero incoming state)
        x = torch.randn(1, min(length, 4096), hidden, device=device, dtype=dtype)
        want = layer(x).float()
        got = adapter.run_plan(Plan(0, (Piece(0, 0, x.shape[1], 0),), None), layer, x).float()
        err = ((got - want).norm() / want.norm()).item()
    own_full = ms(fwd_bwd(length)) if full else float("nan")
    delta = kind == "gated_deltanet"
    for w in worlds:
        n = length // w
        own, par = ms(fwd_bwd(n)), ms(fwd_bwd(n, "par"))
        old = ms(fwd_bwd(n, "old")) if delta and compare_old else float("nan")
        chain = ms(fwd_bwd(n * w, "chain", w)) if with_chain else float("nan")
        own_peak, par_peak = _peak(device, fwd_bwd(n)), _peak(device, fwd_bwd(n, "par"))
        old_peak = _peak(device, fwd_bwd(n, "old")) if delta and compare_old else float("nan")
        rows.append({"layer": kind, "L": length, "W": w, "own/rank ms": f"{own:.1f}", "par/rank ms": f"{par:.1f}",
                     "par/own": f"{par / own:.2f}", "old/rank ms": f"{old:.1f}", "old/own": f"{old / own:.2f}",
                     "par/share": f"{par / (own_full / w):.2f}",
                     "chain ms": f"{chain:.1f}", "chain/own": f"{chain / own:.2f}",
                     "chain/par": f"{chain / par:.2f}", "own/full ms": f"{own_full:.1f}",
                     "own peak GiB": f"{own_peak:.2f}", "par peak GiB": f"{par_peak:.2f}",
                     "par/own peak": f"{par_peak / own_peak:.2f}", "old peak GiB": f"{old_peak:.2f}",
                     "chain msg KiB": f"{msg_bytes / 1024:.0f}", "par msg KiB": f"{par_bytes / 1024:.0f}",
                     "par err": f"{err:.1e}"})
    return rows


def qwen35_config(layers: int, attention_only: bool, tiny: bool = False):
    """Qwen3.5-9B text widths (transformers' Qwen3_5TextConfig defaults), ``layers`` layers: every 4th full
    attention (the model's pattern), or attention everywhere (the twin). ``tiny``: CPU smoke widths."""
    import transformers as tf
    kw = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              vocab_size=248320)
    if tiny:
        kw = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  vocab_size=512)
    types = ["full_attention" if attention_only or i % 4 == 3 else "linear_attention" for i in range(layers)]
    return tf.Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=types, linear_conv_kernel_dim=4,
                                max_position_embeddings=1 << 20, **kw)


def model_rows(lengths, layers, device, steps, checkpointing, tiny, tiles=1, stacks=("hybrid", "attention"),
               warmup=1, lean_norm=True):
    """Rows of --model: the hybrid stack and its attention-only twin, fwd+bwd of one step at each length."""
    from bench.llama7b import build_model, one_rank_group
    from easy_context import apply_seq_parallel_monkey_patch
    from easy_context.loss import causal_lm_loss
    from easy_context.memory import configure_memory
    from easy_context.recurrent.init import slow_decay_
    one_rank_group()
    timer = _timer(device, steps, warmup)
    res = {(w, L): (float("nan"), float("nan")) for w in ("hybrid", "attention") for L in lengths}
    for which in stacks:
        torch.manual_seed(0)
        model = build_model(qwen35_config(layers, which == "attention", tiny), device)
        if which == "hybrid":
            slow_decay_(model)
        else:  # the twin has no recurrent layer, but its config still names a hybrid model type, which the
            model.config.model_type = "qwen3"  # refusal of unknown recurrent layers reads (recurrent/detect.py)
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
        for L in lengths:
            configure_memory(model, checkpointing=checkpointing, tiled_mlp=L >= 262144, lean_norm=lean_norm,
                             recurrent_tiles=tiles if which == "hybrid" else 1)  # lean norms: train.py's default
            ids = torch.randint(0, model.config.vocab_size, (1, L + 1), device=device)
            pos = torch.arange(L, device=device)[None]

            def step(model=model, ids=ids, pos=pos):
                causal_lm_loss(model, ids[:, :-1], pos, ids[:, 1:]).backward()
                for p in model.parameters():
                    p.grad = None
            peak = float("nan")
            try:
                if device.type == "cuda":  # the peak of the timed steps themselves (no extra step)
                    torch.cuda.empty_cache()
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                ms = timer(step)
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated() / 2**30
            except torch.OutOfMemoryError:
                ms, peak = float("nan"), float("inf")
            except Exception as e:  # e.g. an attention kernel refusing a shape: the other rows still print
                print(f"{which} at {L}: {type(e).__name__}: {str(e)[:300]}")
                ms = float("nan")
            res[(which, L)] = (ms, peak)
        del model
    rows = []
    for L in lengths:
        (hm, hp), (am, ap) = res[("hybrid", L)], res[("attention", L)]
        rows.append({"L": L, "layers": f"{layers} ({layers - layers // 4} GDN + {layers // 4} attn)",
                     "hybrid tok/s": f"{L / hm * 1e3:.0f}", "attn-only tok/s": f"{L / am * 1e3:.0f}",
                     "hybrid/attn speed": f"{am / hm:.2f}", "hybrid peak GiB": f"{hp:.1f}",  # inf: out of memory
                     "attn-only peak GiB": f"{ap:.1f}", "hybrid step s": f"{hm / 1e3:.2f}",
                     "attn-only step s": f"{am / 1e3:.2f}"})
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
    p.add_argument("--no-old", action="store_true", help="skip the identity-column path (old/rank)")
    p.add_argument("--no-chain", action="store_true", help="skip the serial chain")
    p.add_argument("--model", action="store_true", help="the Qwen3.5-shape stack vs its attention-only twin")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 524288], help="--model: tokens")
    p.add_argument("--model-layers", type=int, default=4, help="--model: layers (every 4th attention)")
    p.add_argument("--checkpointing", default="layer", help="--model: configure_memory's checkpointing")
    p.add_argument("--steps", type=int, default=2, help="--model: timed steps (median), after one warm-up")
    p.add_argument("--no-layer", action="store_true", help="--model: skip the per-layer rows")
    p.add_argument("--recurrent-tiles", type=int, default=1, help="--model: configure_memory's recurrent_tiles")
    p.add_argument("--stacks", nargs="+", default=["hybrid", "attention"], choices=["hybrid", "attention"],
                   help="--model: which of the pair to run")
    p.add_argument("--warmup", type=int, default=1, help="--model: untimed steps first")
    p.add_argument("--lean-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="--model: lean RMSNorms (train.py's --fused-ops default); --no-lean-norm: HF's")
    args = p.parse_args(argv)
    from bench.common import env_line, table
    if args.tiny:
        args.device, args.size, args.length = "cpu", "tiny", 256
        if args.model:
            args.lengths, args.worlds = [256, 512], [8]
    if args.device == "cuda":
        from bench.common import require_cuda
        require_cuda()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = args.size or ("real" if device.type == "cuda" else "small")
    if args.model:
        mrows = model_rows(args.lengths, args.model_layers, device, args.steps, args.checkpointing, args.tiny,
                           args.recurrent_tiles, args.stacks, args.warmup, args.lean_norm)
        print(env_line() + f"; {args.device}, {dtype}; Qwen3.5-9B widths, {args.model_layers} layers, one training "
              f"step fwd+bwd (chunked loss, checkpointing {args.checkpointing}, tiled MLP from 256K, recurrent tiles "
              f"{args.recurrent_tiles}, {'lean' if args.lean_norm else 'HF'} norms)")
        print(table(mrows, list(mrows[0])))
        size, args.layers = ("tiny" if args.tiny else "qwen35"), ([] if args.no_layer else ["gated_deltanet"])
        args.length = max(args.lengths) if args.tiny else args.length
        if args.no_layer:
            return
    rows = []
    for kind in args.layers:
        rows += run(kind, args.length, args.worlds, size, device, dtype, not args.no_full, args.iters,
                    compare_old=not args.no_old, with_chain=not args.no_chain)
    from easy_context.recurrent.delta_kernels import kernels_for
    kern = kernels_for(_layer("gated_deltanet", "tiny", device, dtype)[0], device).name
    print(env_line() + f"; {args.device}, {dtype}, shape {size}; ONE layer fwd+bwd, W simulated on one device; "
          f"gated DeltaNet kernels: {kern}")
    print(table(rows, list(rows[0])))
    print("par/own: the parallel path's per-rank cost over the plain layer on the same L/W tokens (ranks run at "
          "once); chain/own: the serial chain over the same (W pieces one after another, plus the backward "
          "recompute); chain/par: what the parallel path saves. par err: relative error of the simulated rank vs the "
          "plain layer (forward, zero incoming state). Exchanges (msg KiB) are not timed. old: the identity-column "
          "path the state-only pre-pass replaced; par/share: par/rank over own/full / W.")


if __name__ == "__main__":
    main()
