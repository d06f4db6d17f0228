"""Which per-rank features explain the measured rank times of bench_packed.py (issue #28 residual study, CPU only).

    python bench/packed_features.py bench/results/h200_packed_dispatch_2026-12-04_run2.json [more JSONs: pooled]

Rebuilds every timed layout of the JSON (same rows and seed: bench_packed is deterministic), checks its per-rank
counts against the stored ones, computes candidate features from each rank's kernel pieces (tile-rounded work,
causal vs rectangle elements, launches by kind, short pieces, rows merged per piece, kv rows received) and fits
feature sets to the measured per-rank ms (non-negative least squares on relative errors, as packed_fit.py).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench import bench_packed as B  # noqa: E402
from bench.packed_fit import _solve  # noqa: E402


def columns(f, tokens):
    """Regressors (ms-scale units) of a rank: M elements, k tiles, counts, 16K-token units."""
    k = tokens / 16384
    return dict(Melem=(f["causal"] + f["rect"]) / 1e6, Mcausal=f["causal"] / 1e6, Mrect=f["rect"] / 1e6,
                ktf=f["tf"] / 1e3, ktb=f["tb"] / 1e3, ktf_causal=f["tf_causal"] / 1e3, ktf_rect=f["tf_rect"] / 1e3,
                pieces=f["pieces"], short=f["short"], launches=f["launches"], varlen=f["varlen"], dense=f["dense"],
                extra_steps=0 if f["ring"] else f["steps"] - 1, ring_step_16K=(f["steps"] if f["ring"] else 1) * k,
                rows_16K=f["rows"] / 16384, recv_16K=f["recv"] / 16384, Msmall=f["small"] / 1e6, Mdeep=f["deep"] / 1e6)


SETS = {
    "model (elements, pieces, steps)": ("Melem", "pieces", "extra_steps", "ring_step_16K"),
    "causal/rect elements": ("Mcausal", "Mrect", "pieces", "extra_steps", "ring_step_16K"),
    "fwd tiles 128x128": ("ktf", "pieces", "extra_steps", "ring_step_16K"),
    "bwd tiles 64x128": ("ktb", "pieces", "extra_steps", "ring_step_16K"),
    "tiles causal/rect": ("ktf_causal", "ktf_rect", "pieces", "extra_steps", "ring_step_16K"),
    "elements + short pieces": ("Melem", "pieces", "short", "extra_steps", "ring_step_16K"),
    "elements + launches by kind": ("Melem", "dense", "varlen", "pieces", "extra_steps", "ring_step_16K"),
    "elements + piece rows": ("Melem", "pieces", "rows_16K", "extra_steps", "ring_step_16K"),
    "elements + kv received": ("Melem", "pieces", "recv_16K", "extra_steps", "ring_step_16K"),
    "elements + small-piece elements": ("Melem", "Msmall", "pieces", "extra_steps", "ring_step_16K"),
    "elements + long-kv rectangles": ("Melem", "Mdeep", "pieces", "extra_steps", "ring_step_16K"),
    "all": ("Melem", "ktf", "ktb", "Mcausal", "Msmall", "Mdeep", "pieces", "short", "dense", "varlen", "rows_16K",
            "recv_16K", "extra_steps", "ring_step_16K"),
}


def main(paths):
    """Fit every feature set on the per-rank times of one or more bench_packed JSONs (runs pooled)."""
    rows = [r for path in paths for r in json.load(open(path))["rows"] if r.get("ranks") and "ms" in r["ranks"][0]]
    pts, cache = [], {}
    for row in rows:
        L, W = row["L"], row["W"]
        seed = row.get("seed", 0)  # runs before --seeds: seed 0
        lens = cache.setdefault((L, seed), B.doc_lengths(L, 1500, 1.5, seed))
        feats = B.layout_features(L, W, lens, row["layout"])
        for i, (f, c) in enumerate(zip(feats, row["ranks"])):
            got, want = (f["causal"] + f["rect"], f["pieces"], f["steps"]), (c["causal"] + c["rect"], c["pieces"],
                                                                            c["steps"])
            if abs(got[0] - want[0]) > 1e-4 * want[0] or got[1:] != want[1:]:
                print(f"warning: {L} {row['layout']} rank {i}: rebuilt counts {got} differ from the JSON's {want}")
            pts.append((columns(f, c["tokens"]), c["ms"], L, row["layout"], i))
    y = np.array([p[1] for p in pts])
    for name, use in SETS.items():
        x = np.array([[p[0][u] for u in use] for p in pts])
        coef = _solve(x, y, range(len(use)))
        err = x @ coef / y - 1
        picks = [" ".join(f"{err[j]:+.3f}" for j, p in enumerate(pts) if p[2] == n and "time-balanced" in p[3])
                 for n in (131072, 524288)]
        print(f"{name:<32s} mean {np.abs(err).mean():.3f} max {np.abs(err).max():.3f}\n    128K pick {picks[0]}\n"
              f"    512K pick {picks[1]}")
        print("    " + ", ".join(f"{u}={c:.4g}" for u, c in zip(use, coef)))
        # leave one layout out: is the gain real or fitted noise?
        cv, groups = [], sorted({(p[2], p[3]) for p in pts})
        for g in groups:
            out = np.array([(p[2], p[3]) == g for p in pts])
            c = _solve(x[~out], y[~out], range(len(use)))
            cv += list(np.abs(x[out] @ c / y[out] - 1))
        mm = []
        for n in (131072, 524288):
            sel = [j for j, p in enumerate(pts) if p[2] == n and "time-balanced" in p[3]]
            if not sel:
                mm.append("-")
                continue
            t, m = np.array([x[j] @ coef for j in sel]), y[sel]
            mm.append(f"{t.max() / t.mean():.3f} (measured {m.max() / m.mean():.3f})")
        print(f"    leave-one-layout-out mean {np.mean(cv):.3f}; predicted max/mean of the picks (all runs pooled) "
              f"128K {mm[0]}, 512K {mm[1]}")
    return pts


if __name__ == "__main__":
    main(sys.argv[1:])
