"""The 512K single-GPU step's runs gathered over device sessions: each run, then min / median / max (CPU, no GPU).

One 7B fwd+bwd at 512K takes ~10 minutes and a device session has 30, so the three runs of the median are made in
separate sessions (`bash bench/h200_fa4.sh m512-start 1`, then `m512-wait`; the JSON comes back as `$OUT/m512.json`,
saved as bench/results/<gpu>_m512_<date>[_<n>].json, e.g. h200_m512_2026-12-05_1.json). Runs are grouped by what
was run: the options that shape the step (k, selective layers, head groups), the GPU and the software line; a group's
spread is the run-to-run stability.

    python bench/m512_runs.py                       # every bench/results/*_m512_*.json (H200 and H100 runs apart)
    python bench/m512_runs.py --since 2026-12-05    # only runs of that date or later (the current code)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))


def runs_of(path: str) -> list[dict]:
    """One dict per timed 512K step in a bench_memory JSON (``--repeat`` rows carry every run in ``runs_s``)."""
    with open(path) as f:
        data = json.load(f)
    env, args = data.get("env", ""), data.get("args", {})
    out = []
    for row in data.get("rows", []):
        if row.get("impl") != "ours" or row.get("L") != 524288 or row.get("status") != "ok":
            continue
        heads = row.get("heads", args.get("head_chunks") or 1)
        for s in row.get("runs_s", [row["secs"]]):
            out.append(dict(file=os.path.basename(path), date=env.rsplit(", ", 1)[-1], env=env,
                            k=row.get("k"), sel=row.get("sel", ""), heads=heads, secs=float(s),
                            peak=row.get("peak_GiB"), host=row.get("host_peak_GiB")))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="bench_memory JSONs (default: bench/results/*_m512_*.json)")
    ap.add_argument("--since", default="", help="only runs dated this day or later (YYYY-MM-DD)")
    ap.add_argument("--target", type=float, default=540.0, help="the median to meet, seconds")
    a = ap.parse_args(argv)
    files = a.files or sorted(glob.glob(os.path.join(HERE, "results", "*_m512_*.json")))
    runs = [r for f in files for r in runs_of(f) if r["date"] >= a.since]
    if not runs:
        raise SystemExit("no 512K run in " + (", ".join(files) or "bench/results/*_m512_*.json"))
    print("| file | date | k | sel | heads | secs | GPU peak GiB | host GiB |\n|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['file']} | {r['date']} | {r['k']} | {r['sel']} | {r['heads']} | {r['secs']:.1f} | {r['peak']} "
              f"| {r['host']} |")
    groups: dict[tuple, list[float]] = {}
    for r in runs:
        groups.setdefault((r["k"], r["sel"], r["heads"], r["env"].rsplit(", ", 1)[0]), []).append(r["secs"])
    print()
    for (k, sel, heads, env), secs in groups.items():
        med = statistics.median(secs)
        verdict = "" if len(secs) >= 3 else f" (needs {3 - len(secs)} more run(s) for a median of 3)"
        print(f"k={k} sel={sel} heads={heads} [{env}]: {len(secs)} run(s), min {min(secs):.1f} s, median {med:.1f} s, "
              f"max {max(secs):.1f} s; target {a.target:.0f} s: {'met' if med <= a.target else 'not met'}{verdict}")


if __name__ == "__main__":
    main()
