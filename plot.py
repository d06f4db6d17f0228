"""Perplexity vs context length from an eval_ppl.py CSV.

    python plot.py ppl.csv [--xmin 0 --xmax 32768 --ymin 3 --ymax 10]   # writes ppl.csv.png and ppl.csv.pdf

The y axis is logarithmic: perplexities of an untrained and a trained model differ by orders of magnitude
(the CPU demo's go from ~300 to ~3), and log-perplexity is the loss, so equal steps mean equal loss changes.
"""
from __future__ import annotations

import argparse
import csv
import math


def read_csv(path: str):
    """{model: ([lengths], [ppl])} from eval_ppl.py's CSV (header ",len1,...", rows "model,ppl1,...")."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise ValueError(f"{path}: expected a header and at least one model row")
    lengths = [int(float(x)) for x in rows[0][1:]]
    out = {}
    for row in rows[1:]:
        if row:
            vals = [float(x) if x not in ("", "nan") else math.nan for x in row[1:]]
            out[row[0]] = (lengths, vals)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("--xmin", type=float, default=0)
    p.add_argument("--xmax", type=float, default=32768)
    p.add_argument("--ymin", type=float, default=3)
    p.add_argument("--ymax", type=float, default=10)
    args = p.parse_args(argv)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (xs, ys) in read_csv(args.csv).items():
        ax.plot(xs, ys, marker="o", label=name.replace("NousResearch/", ""))
    ax.set_xlim(args.xmin, args.xmax)
    ax.set_yscale("log")
    ax.set_ylim(args.ymin if args.ymin > 0 else 1.0, args.ymax)  # a log axis cannot start at 0; perplexity >= 1
    ax.set_xlabel("Context Window")
    ax.set_ylabel("Perplexity (lower is better)")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    from easy_context.evals import atomic_savefig
    for ext in ("png", "pdf"):
        atomic_savefig(fig, f"{args.csv}.{ext}")
    plt.close(fig)
    print(f"wrote {args.csv}.png and {args.csv}.pdf")


if __name__ == "__main__":
    main()
