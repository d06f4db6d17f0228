"""One before/after report of the extension runs (issue #64): every probe by length in one table, heatmaps per kind.

    python -m easy_context_train.real_model.summary --runs before=R0 stage3=R3 after=R4 --out DIR [--title T]

Reads what bench/real_model_gpu.sh's evals leave in each run directory: ``needle_*.csv`` here or one folder below
(eval_needle.py; with ``--templates heldout|both`` its ``kind`` column tells own from each held-out probe kind),
``ruler_*.csv`` (eval_ruler.py), ``ppl.csv`` (eval_ppl.py --truncate, nested prefixes), ``generations.json``, ``model.json``. Writes into ``--out``:
``summary.md`` (the table: rows = run x probe, columns = lengths; needle own, each held-out kind and their mean, every
RULER task, perplexity of the first L tokens; then loss by position, the issue's goals as measured, the short
answers), ``summary.json`` (the same numbers) and ``probes_<run>.png`` (a depth x length heatmap per needle kind
and a task x length one for RULER). Loss by position: with --truncate and every document longer than the longest
length, the window of length L scores the first L - 1 tokens, so positions [L' - 1, L - 1) have mean NLL
(ln ppl_L (L - 1) - ln ppl_L' (L' - 1)) / (L - L').
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import sys


def _csv(run_dir: str, pattern: str) -> list[dict]:
    """Rows of every file matching ``pattern`` in ``run_dir`` or one folder below (needle_own/, needle_heldout/)."""
    files = sorted(glob.glob(os.path.join(run_dir, pattern)) + glob.glob(os.path.join(run_dir, "*", pattern)))
    return [r for f in files for r in csv.DictReader(open(f, newline="", encoding="utf-8"))]


def read_run(run_dir: str) -> dict:
    """{probe: {length: score}} plus the raw rows for heatmaps and {length: ppl}."""
    probes: dict[str, dict[int, list[float]]] = {}
    needle = _csv(run_dir, "needle_*.csv")
    for r in needle:
        probes.setdefault(f"needle {r.get('kind') or 'own'}", {}).setdefault(int(r["length"]), []).append(
            float(r["correct"]))
    held = [r for r in needle if r.get("templates") == "heldout"]
    for r in held:
        probes.setdefault("needle held-out (mean)", {}).setdefault(int(r["length"]), []).append(float(r["correct"]))
    ruler = _csv(run_dir, "ruler_*.csv")
    for r in ruler:
        probes.setdefault(f"RULER {r['task']}", {}).setdefault(int(r["length"]), []).append(float(r["score"]))
    ppl = {}
    p = os.path.join(run_dir, "ppl.csv")
    if os.path.exists(p):
        rows = list(csv.reader(open(p, newline="")))
        ppl = {int(L): float(v) for L, v in zip(rows[0][1:], rows[1][1:]) if v not in ("", "nan")}
    return {"probes": {k: {L: sum(v) / len(v) for L, v in sorted(d.items())} for k, d in probes.items()},
            "needle_rows": needle, "ruler_rows": ruler, "ppl": ppl}


def loss_by_position(ppl: dict[int, float]) -> list[tuple[int, int, float]]:
    out, prev = [], None
    for L in sorted(ppl):
        nll = math.log(ppl[L]) * (L - 1)
        out.append((0 if prev is None else prev[0] - 1, L - 1,
                    nll / (L - 1) if prev is None else (nll - prev[1]) / (L - prev[0])))
        prev = (L, nll)
    return out


def _rank(probe: str) -> int:
    """Table order: own needle, held-out mean, each held-out kind, RULER."""
    return 0 if probe == "needle own" else 1 if probe.endswith("(mean)") else 2 if probe.startswith("needle") else 3


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _mean_from(d: dict[int, float], lo: int) -> float:
    xs = [v for L, v in d.items() if L >= lo]
    return sum(xs) / len(xs) if xs else math.nan


def goals(runs: dict, final: str, raw: str | None) -> list[list[str]]:
    """The issue's goals at 16K and above, measured on ``final`` (perplexity against the raw-text run ``raw``)."""
    p, out = runs[final]["probes"], []
    for probe, goal in (("needle held-out (mean)", 0.9), ("needle own", 0.95), ("RULER niah_single", 0.8),
                        ("RULER niah_multikey", 0.8), ("RULER vt", 0.5)):
        v = _mean_from(p.get(probe, {}), 16384)
        out.append([probe + " (16K+)", f">= {goal}", "not measured" if math.isnan(v) else f"{v:.2f}",
                    "" if math.isnan(v) else ("met" if v >= goal else "NOT met")])
    a, b = runs[final]["ppl"], (runs[raw]["ppl"] if raw in runs else {})
    L = max(set(a) & set(b), default=None)
    if L:
        r = a[L] / b[L] - 1
        out.append([f"perplexity at {_k(L)} vs {raw}", "within +10 %", f"{a[L]:.3f} vs {b[L]:.3f} ({100 * r:+.1f} %)",
                    "met" if r <= 0.10 else "NOT met"])
    return out


def report(pairs: list[tuple[str, str]], out: str, title: str, final: str = "after", raw: str = "stage3") -> str:
    os.makedirs(out, exist_ok=True)
    runs = {n: read_run(d) for n, d in pairs}
    lengths = sorted({L for r in runs.values() for d in list(r["probes"].values()) + [r["ppl"]] for L in d})
    rows = []
    for n, r in runs.items():
        for probe, d in sorted(r["probes"].items(), key=lambda kv: _rank(kv[0])):
            rows.append([n, probe] + [f"{d[L]:.2f}" if L in d else "" for L in lengths]
                        + [f"{sum(d.values()) / len(d):.2f}"])
        if r["ppl"]:
            rows.append([n, "perplexity"] + [f"{r['ppl'][L]:.3f}" if L in r["ppl"] else "" for L in lengths] + [""])
            pos = {b + 1: x for _, b, x in loss_by_position(r["ppl"])}  # the positions each length adds
            rows.append([n, "loss by position (nats)"] + [f"{pos[L]:.3f}" if L in pos else "" for L in lengths] + [""])
    md = [f"# {title}", ""]
    for n, d in pairs:
        m = os.path.join(d, "model.json")
        if os.path.exists(m):
            md.append(f"- {n}: {json.load(open(m))}")
    md += ["", "## Every probe by length (needle / RULER: fraction correct; perplexity of the first L tokens; loss by "
           "position: mean NLL of the positions between the previous length and L)", ""]
    md += _table(["run", "probe"] + [_k(L) for L in lengths] + ["mean"], rows) + [""]
    lbp = {n: loss_by_position(r["ppl"]) for n, r in runs.items() if r["ppl"]}
    if lbp:
        spans = sorted({(a, b) for v in lbp.values() for a, b, _ in v})
        md += ["## Mean loss (nats) by token position", ""]
        md += _table(["run"] + [f"{_k(a + 1) if a else 0}-{_k(b + 1)}" for a, b in spans],
                     [[n] + [next((f"{x:.3f}" for a2, b2, x in v if (a2, b2) == s), "") for s in spans]
                      for n, v in lbp.items()]) + [""]
    if final in runs:
        md += [f"## Goals of issue #64 on `{final}` (16K and above)", ""]
        md += _table(["probe", "goal", "measured", ""], goals(runs, final, raw)) + [""]
    for n, r in runs.items():
        if r["needle_rows"] or r["ruler_rows"]:
            png = f"probes_{n}.png"
            heatmaps(r, os.path.join(out, png), f"{title}: {n}")
            md += [f"![{n}]({png})", ""]
    gens = {n: json.load(open(os.path.join(d, "generations.json"))) for n, d in pairs
            if os.path.exists(os.path.join(d, "generations.json"))}
    if gens:
        md += ["## Greedy answers to short chat prompts", ""]
        for i, g in enumerate(next(iter(gens.values()))):
            md += [f"**{g['prompt']}**", ""] + [f"- {n}: {' '.join(v[i]['answer'].split())[:400]}"
                                                for n, v in gens.items()] + [""]
    text = "\n".join(md)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({n: {"probes": r["probes"], "ppl": r["ppl"]} for n, r in runs.items()}, f, indent=1)
    return text


def heatmaps(run: dict, path: str, title: str) -> None:
    """A depth x length grid per needle kind (own first), and RULER's task x length grid."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grids = []
    kinds = sorted({r.get("kind") or "own" for r in run["needle_rows"]}, key=lambda k: (k != "own", k))
    for k in kinds:
        sel = [r for r in run["needle_rows"] if (r.get("kind") or "own") == k]
        grids.append((f"needle {k}", sel, "depth", "correct"))
    if run["ruler_rows"]:
        grids.append(("RULER", run["ruler_rows"], "task", "score"))
    fig, axes = plt.subplots(1, len(grids), figsize=(4.2 * len(grids), 4), squeeze=False)
    for ax, (name, sel, ykey, vkey) in zip(axes[0], grids):
        xs = sorted({int(r["length"]) for r in sel})
        ys = sorted({r[ykey] for r in sel}, key=lambda y: float(y) if ykey == "depth" else y)
        cell: dict = {}
        for r in sel:
            cell.setdefault((ys.index(r[ykey]), xs.index(int(r["length"]))), []).append(float(r[vkey]))
        grid = [[sum(cell.get((i, j), [math.nan])) / len(cell.get((i, j), [1])) for j in range(len(xs))]
                for i in range(len(ys))]
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(xs)), [_k(x) for x in xs], rotation=45, fontsize=7)
        ax.set_yticks(range(len(ys)), [f"{100 * float(y):g}%" if ykey == "depth" else y for y in ys], fontsize=7)
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="NAME=DIR, in order (missing directories are skipped)")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="SmolLM2-135M-Instruct, 8K -> 64K: before / after (bench/real_model_gpu.sh)")
    p.add_argument("--final", default="after", help="the run the goals are checked on")
    p.add_argument("--raw", default="stage3", help="the raw-text run the final perplexity is compared with")
    a = p.parse_args(argv)
    pairs = [tuple(x.split("=", 1)) for x in a.runs]
    if any(len(x) != 2 for x in pairs):
        print("summary: error: --runs takes NAME=DIR", file=sys.stderr)
        return 2
    print(report([(n, d) for n, d in pairs if os.path.isdir(d)], a.out, a.title, a.final, a.raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
