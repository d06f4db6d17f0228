"""Which of the solver's deals holds up when the rank-time model is wrong? A CPU study (issue #28).

    python bench/packed_robust.py                      # 128K and 512K, W=8, seeds 0-7, every GPU run as a truth
    python bench/packed_robust.py --spread 2 --lengths 131072
    python bench/packed_robust.py --deep               # also: the first search vs the deeper one (absolute)

The solver (dispatch/plan.py) builds a handful of deals per row and keeps the one its fitted time model predicts fastest.
That model is ~2% right within a GPU run but its constants move from run to run (a kernel piece costs 0.04 ms in one
fit and 0.17 ms in another), and the ~5% imbalance measured at 128K is of that size. So the selection rule is tested
here against *truths*: the model re-fitted on each H200 run's per-rank times (bench/results/h200_packed_*.json,
bench/packed_fit.py), never used to pick. For every row (document lengths of bench_packed, seeds), every candidate
deal's per-rank counts (dispatch.segments.Estimate) are priced under each truth, and each rule's pick is scored by
  - regret: its slowest rank over the slowest rank of the best candidate under that truth,
  - max/mean: its slowest rank over its mean rank under that truth.
Rules (none sees the truths): ``fastest`` (the lowest predicted slowest rank: dispatch/plan.py's before 12-05),
``balanced S`` (dispatch.pick: of the options predicted within S of the fastest, the best balanced; S = BALANCE_SLACK
is the default) and ``robust`` (the lowest worst-case regret over scenarios that scale each of the model's overhead
constants by 1/spread and by spread, one at a time).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench import packed_fit  # noqa: E402
from bench.bench_packed import doc_lengths, positions, with_kinds  # noqa: E402
from bench.common import table  # noqa: E402
from easy_context.dispatch import plan as D  # noqa: E402
from easy_context.dispatch.segments import Estimate  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def runs(paths) -> dict[str, list[dict]]:
    """The bench_packed rows of each GPU run with per-rank times (older runs have summaries only), by run name."""
    out = {}
    for path in paths:
        with open(path) as f:
            rows = json.load(f).get("rows", [])
        if any(r.get("ranks") and all("ms" in c for c in r["ranks"]) for r in rows):
            name = os.path.basename(path).removeprefix("h200_packed_").removesuffix(".json")
            out[name] = with_kinds(rows)
    return out


def truths(paths) -> dict[str, dict]:
    """Constants (packed_fit units, ms) fitted on each GPU run with per-rank times."""
    return {name: packed_fit.fit(rows)[0] for name, rows in runs(paths).items()}


def held_out(paths, lengths, world, seeds, median=1500, sigma=1.5):
    """Leave one run out: the model fitted on the other runs' per-rank times (pooled) picks (dispatch.pick), and the
    pick is priced under the left-out run's own fit, beside the pick of dispatch/plan.py's constants."""
    from bench.packed_calibrate import model
    by_run = runs(paths)
    rows = []
    for name, mine in by_run.items():
        truth = packed_fit.fit(mine)[0]
        pooled = packed_fit.fit([r for other, rs in by_run.items() if other != name for r in rs])[0]
        for L in lengths:
            if not applies(name, L):
                continue
            for seed in seeds:
                pos = positions(doc_lengths(L, median, sigma, seed))
                for label, consts in (("dispatch.py's constants", None), ("pooled fit of the other runs", pooled)):
                    with (model(consts) if consts else _same()):
                        options, cands = candidates(pos, world)
                        i = options.index(D.pick(options, L // world))
                    per = [rank_times(e, truth, L // world) for _, e in cands]
                    t, best = per[i], min(max(x) for x in per)
                    rows.append(dict(L=L, seed=seed, truth=name, rule=label, pick=cands[i][0],
                                     regret=max(t) / best, max_over_mean=max(t) / (sum(t) / len(t))))
    return rows


class _same:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


RULES = ("fastest", "robust", "balanced 0.01", f"balanced {D.BALANCE_SLACK:g}", "balanced 0.03")


def applies(truth_name: str, L: int) -> bool:
    """A fit made on one length only (name tagged 128k / 512k) extrapolates badly to others: used for its own."""
    tags = {"128k": 131072, "256k": 262144, "512k": 524288}
    own = [n for t, n in tags.items() if t in truth_name]
    return not own or L in own


def candidates(pos, world, search="first"):
    """(options of the row, per option (name, Estimate)). ``search``: "first" = segment_options (the rules compare
    on these), "deeper" = with the deeper search's too (always), "auto" = dispatch.deal_options (the
    deeper search only when the first one's pick is unbalanced: the library's default)."""
    L = pos.shape[-1]
    stats = D._stats(pos, None)
    tried = D.equal_deals(pos, L, world, None, None, stats)
    prefix, restarts, start = D._arrays(pos, None, stats)
    if search == "auto":
        options = D.deal_options(pos, L, world, None, tried, stats)
    else:
        options = D.segment_options(pos, L, world, None, tried, stats)
        if search == "deeper":
            options += D.segment_options(pos, L, world, None, tried, stats, sources=min(world, D.DEEP_SOURCES))
    return options, [(f"m={o[1]} kind {o[2]}", Estimate(o[3], prefix, restarts, start, world)) for o in options]


SEARCHES = ("first", "deeper", "auto")


def search_study(lengths, world, seeds, truth, median=1500, sigma=1.5):
    """dispatch.pick over each search's options, priced under each truth: the slowest rank against the first
    search's pick (absolute, not regret: a deeper search adds candidates, so the best one moves too)."""
    rows = []
    for L in lengths:
        tokens = L // world
        for seed in seeds:
            pos = positions(doc_lengths(L, median, sigma, seed))
            picks = {}
            for search in SEARCHES:
                options, cands = candidates(pos, world, search)
                picks[search] = cands[options.index(D.pick(options, tokens))]
            for tname, consts in truth.items():
                if not applies(tname, L):
                    continue
                base = max(rank_times(picks["first"][1], consts, tokens))
                for search, (name, est) in picks.items():
                    t = rank_times(est, consts, tokens)
                    rows.append(dict(L=L, seed=seed, truth=tname, search=search, pick=name, vs_first=max(t) / base,
                                     max_over_mean=max(t) / (sum(t) / len(t))))
    out = []
    for L in lengths:
        for search in SEARCHES:
            sel = [r for r in rows if r["L"] == L and r["search"] == search]
            if not sel:
                continue
            v, mm = [r["vs_first"] for r in sel], [r["max_over_mean"] for r in sel]
            out.append(dict(L=L, search=search, cases=len(sel), vs_first_mean=f"{statistics.mean(v):.4f}",
                            vs_first_min=f"{min(v):.4f}", vs_first_max=f"{max(v):.4f}",
                            max_over_mean_mean=f"{statistics.mean(mm):.4f}", max_over_mean_max=f"{max(mm):.4f}",
                            within_5pct=f"{sum(m <= 1.05 for m in mm)}/{len(mm)}"))
    return rows, out


def rank_times(est: Estimate, consts: dict, tokens: int) -> list[float]:
    """Per-rank ms of a deal under packed_fit constants (the dispatch: one full-size pass, then pieces)."""
    c = consts
    fixed = (c.get("ring_step_16K", 0.0) + c.get("tokens_16K", 0.0)) * tokens / 16384
    return [c["Melem"] * w / 1e6 + c.get("pieces", 0.0) * p + c.get("dense", 0.0) * d + c.get("varlen", 0.0) * v
            + c.get("extra_steps", 0.0) * (n - 1) + fixed
            for w, p, d, v, n in zip(est.work, est.pieces, est.dense, est.varlen, est.steps)]


def scenarios(spread: float) -> list[dict]:
    """dispatch.py's constants, and each overhead constant scaled by 1/spread and by spread (one at a time)."""
    base = packed_fit.current()
    out = [base]
    for name in ("pieces", "dense", "extra_steps", "ring_step_16K"):
        for f in (1 / spread, spread):
            out.append({**base, name: base[name] * f})
    return out


def pick(options, tokens, times_by_scenario: list[list[list[float]]], rule: str) -> int:
    """Index of the option a rule keeps. "fastest" / "balanced S": dispatch.pick with slack 0 / S; "robust": the
    lowest worst-case regret over the scenarios (``times_by_scenario[s][i]``: option i's rank times under
    scenario s)."""
    if rule == "fastest":
        return options.index(D.pick(options, tokens, 0.0))
    if rule.startswith("balanced"):
        return options.index(D.pick(options, tokens, float(rule.split(" ")[1])))
    worst = [1.0] * len(times_by_scenario[0])
    for per in times_by_scenario:
        slow = [max(t) for t in per]
        best = min(slow)
        worst = [max(w, s / best) for w, s in zip(worst, slow)]
    return min(range(len(worst)), key=lambda i: (worst[i], i))


def study(lengths, world, seeds, spread, truth, median=1500, sigma=1.5):
    rows = []
    scen = scenarios(spread)
    for L in lengths:
        tokens = L // world
        for seed in seeds:
            pos = positions(doc_lengths(L, median, sigma, seed))
            options, cands = candidates(pos, world)
            by_s = [[rank_times(e, c, tokens) for _, e in cands] for c in scen]
            picks = {rule: pick(options, tokens, by_s, rule) for rule in RULES}
            for tname, consts in truth.items():
                if not applies(tname, L):
                    continue
                per = [rank_times(e, consts, tokens) for _, e in cands]
                best = min(max(t) for t in per)
                for rule, i in picks.items():
                    t = per[i]
                    rows.append(dict(L=L, seed=seed, truth=tname, rule=rule, pick=cands[i][0],
                                     regret=max(t) / best, max_over_mean=max(t) / (sum(t) / len(t))))
    return rows


def summary(rows, rules=RULES):
    out = []
    for L in sorted({r["L"] for r in rows}):
        for rule in rules:
            sel = [r for r in rows if r["L"] == L and r["rule"] == rule]
            reg = [r["regret"] for r in sel]
            mm = [r["max_over_mean"] for r in sel]
            out.append(dict(L=L, rule=rule, cases=len(sel), regret_mean=f"{statistics.mean(reg):.4f}",
                            regret_max=f"{max(reg):.4f}", max_over_mean_mean=f"{statistics.mean(mm):.4f}",
                            max_over_mean_max=f"{max(mm):.4f}",
                            within_5pct=f"{sum(m <= 1.05 for m in mm)}/{len(mm)}"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    ap.add_argument("--spread", type=float, default=2.0, help="scenarios scale each overhead by 1/spread and spread")
    ap.add_argument("--runs", nargs="*", default=None, help="GPU JSONs (default: every h200_packed_*.json here)")
    ap.add_argument("--detail", action="store_true", help="one line per (row, truth, rule)")
    ap.add_argument("--deep", action="store_true",
                    help="also: the first search, always the deeper one, and the deeper one for unbalanced rows only")
    ap.add_argument("--held-out", action="store_true",
                    help="also: the model fitted on all runs but one picks, priced under the one left out")
    args = ap.parse_args()
    if args.spread < 1:
        ap.error(f"--spread {args.spread}: must be >= 1")
    truth = truths(args.runs or sorted(glob.glob(os.path.join(RESULTS, "h200_packed_*.json"))))
    if not truth:
        raise SystemExit("no GPU run with per-rank times found (bench/results/h200_packed_*.json)")
    print(f"truths: {', '.join(truth)}; scenarios: dispatch/plan.py's constants and each overhead x{1 / args.spread:g} / "
          f"x{args.spread:g}")
    rows = study(args.lengths, args.world, args.seeds, args.spread, truth)
    if args.detail:
        print(table(rows, ["L", "seed", "truth", "rule", "pick", "regret", "max_over_mean"]))
    cols = ["L", "rule", "cases", "regret_mean", "regret_max", "max_over_mean_mean", "max_over_mean_max", "within_5pct"]
    print(table(summary(rows), cols))
    if args.deep:
        rows, out = search_study(args.lengths, args.world, args.seeds, truth)
        print("\n## Searches: dispatch.pick over the first search's options, with the deeper search's always, and "
              "with them for unbalanced rows only (auto, the default); slowest rank / the first search's\n")
        if args.detail:
            print(table(rows, ["L", "seed", "truth", "search", "pick", "vs_first", "max_over_mean"]))
        print(table(out, ["L", "search", "cases", "vs_first_mean", "vs_first_min", "vs_first_max",
                          "max_over_mean_mean", "max_over_mean_max", "within_5pct"]))
    if args.held_out:
        rows = held_out(args.runs or sorted(glob.glob(os.path.join(RESULTS, "h200_packed_*.json"))), args.lengths,
                        args.world, args.seeds)
        print("\n## Leave one run out: dispatch/plan.py's constants vs the pooled fit of the other runs "
              "(both dispatch.pick)\n")
        if args.detail:
            print(table(rows, ["L", "seed", "truth", "rule", "pick", "regret", "max_over_mean"]))
        print(table(summary(rows, ("dispatch.py's constants", "pooled fit of the other runs")), cols))


if __name__ == "__main__":
    main()
