"""Attention sinks (gpt-oss) and MLA (DeepSeek-V3) on the kernel path at long context, on one GPU (issue #59).

    python bench/bench_contract.py --length 32768        # both; --what sinks|mla

sinks: gpt-oss-20b's attention shape (64 q / 8 kv heads of 64, one sink logit per head), bf16, causal. Ours: the
sequence-parallel function (one rank: the same code path a ring runs, the sink folded once into the final (out, lse))
vs the same call without sinks (the fold's cost). The model's own path (transformers' eager: a 64 x L x L score
tensor) is timed at the lengths where it fits. Error bound: ours (bf16) and eager against an fp32 reference computed
here by query blocks (eager's math, checkpointed per block).
mla: DeepSeek-V3's attention shape (128 heads, q/k head dim 192, values 128), bf16, causal. Ours: values zero-padded to
192 for the kernel, output sliced (hf/attention.py) vs the model's own SDPA call on the unpadded values. Error bound:
both against the fp32 query-block reference above (no sinks).
Prints one table; the JSON goes to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cuda_time_ms, env_line, require_cuda, table  # noqa: E402


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _eager_sinks(q, k, v, sinks, scale, block=None):
    """gpt-oss' eager math in (B, L, H, D), GQA by repeat; ``block``: query blocks, each checkpointed (fp32 ref)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)

    def rows(q0, q1, qb, k, v, sinks):
        s = torch.einsum("bqhd,bkhd->bhqk", qb, k[:, :q1]) * scale
        i = torch.arange(q0, q1, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(q1, device=q.device)[None, :] > i, float("-inf"))
        sink = sinks.view(1, -1, 1, 1).to(s.dtype).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        return torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v[:, :q1])
    n = q.shape[1]
    if block is None:
        return rows(0, n, q, k, v, sinks)
    return torch.cat([checkpoint(rows, a, min(a + block, n), q[:, a:a + block], k, v, sinks, use_reentrant=False)
                      for a in range(0, n, block)], dim=1)


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def bench_sinks(length: int, eager_max: int) -> list[dict]:
    from easy_context import zigzag_ring_attn_func
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (1, length, 64, 64), (1, length, 8, 64)
    q = torch.randn(shape_q, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(shape_kv, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(shape_q, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(64)
    ins = (q, k, v, sinks)

    def ours():
        return _grads(zigzag_ring_attn_func(q, k, v, softmax_scale=scale, sinks=sinks), ins, dout)

    def plain():
        return _grads(zigzag_ring_attn_func(q, k, v, softmax_scale=scale), (q, k, v), dout)
    out = zigzag_ring_attn_func(q, k, v, softmax_scale=scale, sinks=sinks)
    got = (out, *_grads(out, ins, dout))
    f32 = [t.detach().float().requires_grad_() for t in ins]
    ref_out = _eager_sinks(*f32, scale, block=1024)
    ref = (ref_out, *_grads(ref_out, f32, dout.float()))
    row = {"what": "sinks (gpt-oss-20b attention)", "L": length, "ours ms": round(cuda_time_ms(ours), 1),
           "no-sink ms": round(cuda_time_ms(plain), 1)}
    row["sink cost"] = f"{row['ours ms'] / row['no-sink ms']:.3f}x"
    row.update({f"ours rel {n}": f"{_rel(a, b):.1e}" for n, a, b in zip(("out", "dq", "dk", "dv", "dsink"), got, ref)})
    if length <= eager_max:
        def eager():
            return _grads(_eager_sinks(q, k, v, sinks, scale), ins, dout)
        e_out = _eager_sinks(q, k, v, sinks, scale)
        e = (e_out, *_grads(e_out, ins, dout))
        row["model eager ms"] = round(cuda_time_ms(eager), 1)
        row["eager rel out"] = f"{_rel(e[0], ref[0]):.1e}"
        row["eager rel dq"] = f"{_rel(e[1], ref[1]):.1e}"
    else:
        row["model eager ms"] = f"not run (score tensor {64 * length * length * 2 / 2**30:.0f} GiB)"
    return [row]


def bench_mla(length: int) -> list[dict]:
    from easy_context import zigzag_ring_attn_func
    from easy_context.hf.attention import _equal_head_dims
    g = torch.Generator(device="cuda").manual_seed(0)
    h = 128
    q, k = (torch.randn(1, h, length, 192, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    v = torch.randn(1, h, length, 128, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, length, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(192)

    def ours_out():
        qq, kk, vv, dv = _equal_head_dims(q, k, v)
        return zigzag_ring_attn_func(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                     softmax_scale=scale)[..., :dv]

    def sdpa_out(qq=q, kk=k, vv=v):
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale).transpose(1, 2)
    ins = (q, k, v)
    o = ours_out()
    got = (o, *_grads(o, ins, dout))
    s = sdpa_out()
    theirs = (s, *_grads(s, ins, dout))
    f32 = [t.detach().float().requires_grad_() for t in ins]
    no_sink = torch.full((h,), float("-inf"), device="cuda")
    r = _eager_sinks(*(t.transpose(1, 2) for t in f32), no_sink, scale, block=512)
    ref = (r, *_grads(r, f32, dout.float()))
    row = {"what": "MLA (DeepSeek-V3 attention)", "L": length,
           "ours ms": round(cuda_time_ms(lambda: _grads(ours_out(), ins, dout)), 1),
           "model sdpa ms": round(cuda_time_ms(lambda: _grads(sdpa_out(), ins, dout)), 1)}
    row["ours / sdpa"] = f"{row['ours ms'] / row['model sdpa ms']:.3f}x"
    row.update({f"ours rel {n}": f"{_rel(a, b):.1e}" for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)})
    row.update({f"sdpa rel {n}": f"{_rel(a, b):.1e}" for n, a, b in zip(("out", "dq", "dk", "dv"), theirs, ref)})
    return [row]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--what", choices=("sinks", "mla", "both"), default="both")
    p.add_argument("--eager-max", type=int, default=8192, help="longest length the eager baseline runs at")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    require_cuda()
    rows = []
    if a.what in ("sinks", "both"):
        rows += bench_sinks(a.length, a.eager_max)
    if a.what in ("mla", "both"):
        rows += bench_mla(a.length)
    print(env_line())
    for r in rows:
        print(table([r], list(r)))
    if a.out:
        Path(a.out).write_text(json.dumps({"env": env_line(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
