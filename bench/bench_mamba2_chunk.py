"""Mamba-2 mixer on one GPU: easy_context's run_chunk (recurrent/mamba2.py) vs the layer's own forward.

    python bench/bench_mamba2_chunk.py [--lengths 4096 16384 32768] [--doc 2048] [--pieces 4 8]

A Nemotron-H-8B-shaped NemotronHMamba2Mixer (hidden 4096, 128 heads x 64, d_state 128, 8 groups, conv 4, SSD chunk
128), bf16, batch 1, forward + backward. Columns, all from this one run:
  * hf: the layer's own forward (its torch path: mamba_ssm / causal_conv1d are not installed on this machine);
  * ours: run_chunk on the whole row from a zero state (what one rank runs per piece) and its ratio to hf;
  * docs: run_chunk with a document start every --doc tokens (the per-document masks and conv fix-up);
  * chain xW: the serial chain's compute for W pieces on one GPU: W pieces of L/W run one after another,
    forward without a graph, then each piece's forward again with autograd + backward (the chain recomputes
    in backward: easy_context/recurrent/chain.py). This is the latency of one recurrent layer under SP on W
    ranks with the state messages left out (they are B x (conv window + heads x 64 x 128) floats per piece);
  * piece L/W: one piece of L/W tokens, forward + backward: what each rank computes in the parallel path
    (recurrent/mamba2_parallel.py; its output correction, one einsum over the piece, is left out) — the
    per-rank latency to compare with the serial chain's.
Peak memory is torch.cuda.max_memory_allocated during each case (the layer's weights included).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import cuda_time_ms, env_line, require_cuda, table  # noqa: E402


def build_mixer(device, dtype, tiny=False):
    import transformers as tf
    dims = dict(hidden_size=64, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8) \
        if tiny else dict(hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
                          chunk_size=128)
    cfg = tf.NemotronHConfig(vocab_size=256, num_hidden_layers=1, hybrid_override_pattern="M", num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=256, conv_kernel=4, **dims)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    layer = next(m for m in model.modules() if type(m).__name__ == "NemotronHMamba2Mixer")
    with torch.no_grad():  # a decay that keeps the state alive (A in [0.05, 0.5])
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.05, 0.5).log())
    return layer.to(device=device, dtype=dtype).train()


def chain_grads(layer, x, dy, w):
    """The serial chain's work on one device: d(input) and d(params) of W pieces chained through the state."""
    from easy_context.recurrent.mamba2 import run_chunk, zero_state
    params = list(layer.parameters())
    n = x.shape[1] // w
    states = [zero_state(layer, x.shape[0], x.dtype, x.device)]
    with torch.no_grad():
        for i in range(w):
            states.append(run_chunk(layer, x[:, i * n:(i + 1) * n], states[-1], None)[1])
    d_state, d_x, d_p = None, [], [torch.zeros_like(p) for p in params]
    for i in reversed(range(w)):  # recompute + backward, the state gradient handed down
        xg = x[:, i * n:(i + 1) * n].detach().requires_grad_(True)
        s_in = tuple(s.detach().requires_grad_(True) for s in states[i])
        out, s_out = run_chunk(layer, xg, s_in, None)
        outs, grads = [out], [dy[:, i * n:(i + 1) * n]]
        if d_state is not None:
            outs += list(s_out)
            grads += list(d_state)
        got = torch.autograd.grad(outs, [xg, *s_in, *params], grads)
        d_x.insert(0, got[0])
        d_state = got[1:1 + len(s_in)]
        d_p = [a + b for a, b in zip(d_p, got[1 + len(s_in):])]
    return torch.cat(d_x, 1), d_p


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--doc", type=int, default=2048, help="tokens per packed document in the 'docs' column")
    ap.add_argument("--pieces", type=int, nargs="+", default=[4, 8], help="W of the serial-chain columns")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny layer on CPU: checks the script runs (no timings)")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.lengths, args.doc = [64], 16
    else:
        require_cuda()
    from easy_context.recurrent.mamba2 import run_chunk, zero_state
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    dt = torch.float32 if args.cpu_smoke else torch.bfloat16
    layer = build_mixer(dev, dt, tiny=args.cpu_smoke)
    hidden = layer.hidden_size
    params = list(layer.parameters())

    def fwd_bwd(fn, x, dy):
        def step():
            xg = x.detach().requires_grad_(True)
            torch.autograd.grad(fn(xg), [xg] + params, dy)
        return step

    def chain(x, dy, w):
        return lambda: chain_grads(layer, x, dy, w)

    def measure(step):
        if args.cpu_smoke:  # runs the step; the number is not a timing anyone should quote
            t = time.perf_counter()
            step()
            return round(1e3 * (time.perf_counter() - t), 1) + 0.1, "-"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        try:
            ms = cuda_time_ms(step, warmup=1, iters=3)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return "OOM", "-"
        return round(ms, 1), round(torch.cuda.max_memory_allocated() / 2**30, 2)

    print(env_line() if not args.cpu_smoke else "cpu smoke (no timings)")
    rows = []
    for L in args.lengths:
        x = torch.randn(1, L, hidden, device=dev, dtype=dt)
        dy = torch.randn_like(x)
        starts = torch.zeros(1, L, dtype=torch.bool, device=dev)
        starts[0, ::args.doc] = True
        with torch.no_grad():  # the adapter equals the layer (bf16, same dtype steps)
            ref = layer(x)
            ours = run_chunk(layer, x, zero_state(layer, 1, dt, dev), None)[0]
            err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
        del ref, ours
        row = {"L": L, "rel err vs hf": f"{err:.1e}"}
        row["hf ms"], row["hf GiB"] = measure(fwd_bwd(lambda t: layer(t), x, dy))
        row["ours ms"], row["ours GiB"] = measure(
            fwd_bwd(lambda t: run_chunk(layer, t, zero_state(layer, 1, dt, dev), None)[0], x, dy))
        row["docs ms"], row["docs GiB"] = measure(
            fwd_bwd(lambda t: run_chunk(layer, t, zero_state(layer, 1, dt, dev), starts)[0], x, dy))
        if isinstance(row["hf ms"], float) and isinstance(row["ours ms"], float):
            row["ours/hf"] = round(row["ours ms"] / row["hf ms"], 3)
            row["docs/hf"] = round(row["docs ms"] / row["hf ms"], 3) if isinstance(row["docs ms"], float) else "-"
        for w in args.pieces:
            ms, gib = measure(chain(x, dy, w))
            row[f"chain x{w} ms"], row[f"chain x{w} GiB"] = ms, gib
            n = L // w
            piece_ms, _ = measure(fwd_bwd(lambda t: run_chunk(layer, t, zero_state(layer, 1, dt, dev), None)[0],
                                          x[:, :n].contiguous(), dy[:, :n].contiguous()))
            row[f"piece L/{w} ms"] = piece_ms
            if isinstance(ms, float) and isinstance(piece_ms, float):
                row[f"chain x{w} / piece"] = round(ms / piece_ms, 2)
        rows.append(row)
        print(row, flush=True)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print(table(rows, cols))


if __name__ == "__main__":
    main()
