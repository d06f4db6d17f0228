"""FlashAttention-4's JIT cost, and what its on-disk kernel cache saves a second process (one GPU).

    python bench/bench_fa4_jit.py [--length 8192]

Runs the same fwd+bwd (causal and non-causal, bf16, 32 q / 8 kv heads x 128) in three fresh processes:
cache off, cache on + empty directory, cache on + the directory the previous process filled. Reports each
process's first-call and steady-state times. The second cached process stands for rank 1..7 of a node, or the
next run: with EASY_CONTEXT_FA4_CACHE (on by default) they load kernels instead of compiling them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import env_line, require_cuda, table  # noqa: E402


def child(length):
    import torch
    from easy_context import kernels
    from easy_context.kernels import fa4
    assert fa4.usable(0), "flash-attn-4 is not usable here"
    q = torch.randn(1, length, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, length, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    res = {}
    for causal, kv in ((True, (k, v)), (False, (k[:, : length // 2], v[:, : length // 2]))):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o, lse = kernels.attn_forward(q, *kv, causal, backend="fa4")
            kernels.attn_backward(o, q, *kv, o, lse, causal, backend="fa4")
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res["causal" if causal else "non-causal"] = times
    print("RESULT " + json.dumps(res))


def run_child(length, env):
    p = subprocess.run([sys.executable, __file__, "--child", "--length", str(length)], env=env,
                       capture_output=True, text=True)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not line:
        raise SystemExit(f"child failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[0][7:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args.length)
    require_cuda()
    print(env_line())
    cache = tempfile.mkdtemp(prefix="fa4cache")
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_ATTENTION_CUTE_DSL_CACHE")}
    rows = []
    for name, extra in (("cache off", {"EASY_CONTEXT_FA4_CACHE": "0"}),
                        ("cache on, empty dir", {"EASY_CONTEXT_FA4_CACHE": cache}),
                        ("cache on, filled by the previous process", {"EASY_CONTEXT_FA4_CACHE": cache})):
        t0 = time.perf_counter()
        res = run_child(args.length, {**base, **extra})
        wall = time.perf_counter() - t0
        for kind, times in res.items():
            rows.append(dict(process=name, case=kind, first_call_s=f"{times[0]:.2f}",
                             steady_ms=f"{1e3 * min(times[1:]):.1f}", process_wall_s=f"{wall:.1f}"))
    print(f"\n## FA4 JIT cost, L={args.length}, fwd+bwd, bf16\n")
    print(table(rows, ["process", "case", "first_call_s", "steady_ms", "process_wall_s"]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_fa4_jit.json"), "w") as f:
            json.dump(dict(env=env_line(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
