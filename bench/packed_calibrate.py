"""Does a rank-time model fitted on one batch pick a better deal for the next batches? (issue #28, GPU)

    python bench/packed_calibrate.py [--lengths 131072] [--seeds 1 2 3] [--rounds 3]
    python bench/packed_calibrate.py --check      # CPU: the code path at a tiny size (timings are placeholders)

Why: fitted on one run's per-rank times, the model is within ~2% of that run, but a fit does not carry over from
one run to another. Re-fits across days moved the 128K picks the wrong way (docs/packed_dispatch.md, 12-05). If a
fit holds *within* a run, a training job could calibrate the model on its first steps (time each rank's attention
and fit) and deal the later batches with it. This bench measures that on one GPU:
  1. the rows of seed 0 (every table's rows): the usual layouts are timed per rank (zigzag / k pairs, the dispatch
     deals m = 2, 4, 8 and the picks), and ``bench/packed_fit.py`` fits the model's constants to them;
  2. new rows (other seeds, same length distribution): the pick of dispatch/plan.py's constants and the pick of the
     fitted ones, each timed per rank, beside the default ring layout.
Same process, same GPU state: what a training run would see. The table gives both picks' slowest-rank ms and max/mean;
the JSON ($OUT/packed_calibrate.json) gives the per-rank times and counts.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench import bench_packed as B  # noqa: E402
from bench import packed_fit  # noqa: E402
from bench.common import env_line, table  # noqa: E402
from easy_context.dispatch import plan as D  # noqa: E402

# dispatch/plan.py's constant per packed_fit feature (the inverse of packed_fit.current(): ms -> score elements)
_PER_16K = {"ring_step_16K": "STEP_TIME_PER_TOKEN", "tokens_16K": "TOKEN_TIME"}
_PLAIN = {"pieces": "PIECE_TIME", "dense": "DENSE_TIME", "varlen": "VARLEN_TIME", "extra_steps": "STEP_TIME"}


def to_dispatch(consts: dict) -> dict:
    """packed_fit constants (ms per feature unit) -> dispatch/plan.py's module constants (score elements, MS_PER_ELEM)."""
    ms_per_elem = consts["Melem"] / 1e6
    if ms_per_elem <= 0:
        raise ValueError(f"a fitted model needs a positive cost per score element; got {consts['Melem']} ms per M")
    out = {"MS_PER_ELEM": ms_per_elem}
    out.update({name: consts.get(f, 0.0) / ms_per_elem for f, name in _PLAIN.items()})
    out.update({name: consts.get(f, 0.0) / 16384 / ms_per_elem for f, name in _PER_16K.items()})
    return out


@contextlib.contextmanager
def model(consts: dict):
    """dispatch.py planning with ``consts`` (packed_fit units) instead of its constants, its table cache emptied on
    entry and exit (a cached table was planned with the other constants). Single process, bench only."""
    new = to_dispatch(consts)
    old = {k: getattr(D, k) for k in new}
    D._CACHE.clear()
    try:
        for k, v in new.items():
            setattr(D.MODEL, k, v)  # the fitted model every solver reads (dispatch.cost.MODEL)
        yield
    finally:
        for k, v in old.items():
            setattr(D.MODEL, k, v)
        D._CACHE.clear()


def run(L, world, heads, dim, seeds, rounds, iters, device="cuda", per_rank=("old", "prev", "new", 2, 4, 8),
        median=1500, sigma=1.5):
    """(fitted constants, the fit's errors, the seed-0 rows it was fitted on, one result row per (seed, model))."""
    sim = dict(world=world, heads=heads, dim=dim, median=median, sigma=sigma, iters=iters, device=device,
               rounds=rounds)
    base = B.simulate(L, per_rank=per_rank, seed=0, **sim)
    if device == "cpu":  # no timings on CPU: the current model's per-rank predictions stand in for them
        for r in base:
            for c, ms in zip(r["ranks"], B.predicted_ms(r["ranks"])):
                c["ms"] = ms
    consts, res = packed_fit.fit(base)
    errs = [abs(float(r["rel_err"])) for r in res]
    out = []
    for seed in seeds:
        default = B.simulate(L, per_rank=("new",), seed=seed, **sim)  # the default ring layout + dispatch/plan.py's pick
        with model(consts):
            fitted = B.simulate(L, per_rank=("new",), seed=seed, pairs=(), **sim)
        ring = next(r for r in default if not r["layout"].startswith("dispatch"))
        k_def = B.zigzag_pairs(L, world)
        ring = next((r for r in default if r["layout"].endswith(f"k={k_def}")), ring)
        picks = [("dispatch.py's constants", default[-1]), ("fitted on seed 0", fitted[-1])]
        slow_ring = float(ring["slowest_rank_ms"])
        for name, r in picks:
            out.append(dict(L=L, seed=seed, model=name, layout=r["layout"], slowest_rank_ms=r["slowest_rank_ms"],
                            max_over_mean=r["max_over_mean"], rounds=r["rounds_max_over_mean"],
                            vs_default=f"{slow_ring / float(r['slowest_rank_ms']):.2f}x", rank_ms=r["rank_ms"],
                            same_pick=picks[0][1]["layout"] == picks[1][1]["layout"], ranks=r["ranks"]))
    return consts, dict(mean_rel_err=sum(errs) / len(errs), max_rel_err=max(errs), points=len(errs)), base, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="rows to deal with the fitted model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="CPU float32 smoke of the code path at 4096 tokens, W=4")
    args = ap.parse_args()
    if args.rounds < 1 or args.iters < 1:
        ap.error(f"--rounds {args.rounds} / --iters {args.iters}: each must be >= 1")
    if 0 in args.seeds:
        ap.error("--seeds: 0 is the rows the model is fitted on; give other seeds (e.g. 1 2 3)")
    if args.check:
        consts, fit, _, rows = run(4096, 4, 4, 32, [1], 1, 1, device="cpu", per_rank=("new", 2), median=300, sigma=1.0)
        print(to_dispatch(consts), fit)
        print(table(rows, ["L", "seed", "model", "layout", "slowest_rank_ms", "max_over_mean"]))
        return
    if not torch.cuda.is_available():
        raise SystemExit("timings need a CUDA GPU (--check runs the code path on CPU)")
    print(env_line(), flush=True)
    every, fits = [], []
    for L in args.lengths:
        consts, fit, base, rows = run(L, args.world, args.heads, args.head_dim, args.seeds, args.rounds, args.iters)
        print(f"\n{L}: fitted on seed 0 ({fit['points']} per-rank points, |rel err| mean {fit['mean_rel_err']:.3f}, "
              f"max {fit['max_rel_err']:.3f}): " + ", ".join(f"{k}={v:.4g}" for k, v in consts.items() if v), flush=True)
        every += rows
        fits.append(dict(L=L, consts=consts, fit=fit, rows=base))
    print("\n## The next batches: dispatch/plan.py's pick vs the pick of the model fitted on seed 0 (slowest rank, W=8)\n")
    print(table(every, ["L", "seed", "model", "layout", "slowest_rank_ms", "max_over_mean", "rounds", "vs_default",
                        "same_pick"]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "packed_calibrate.json"), "w") as f:
            json.dump(dict(env=env_line(), fits=fits, rows=every), f, indent=1)


if __name__ == "__main__":
    main()
