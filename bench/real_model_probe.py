"""The real model's before/after pieces that the eval scripts do not cover (issue #48; docs/real-model.md).

    python bench/real_model_probe.py generate --model DIR --out gen.json      # greedy answers to short chat prompts
    python bench/real_model_probe.py report --runs before=R0 stage1=R1 ... after=R3 --out DIR
    python bench/real_model_probe.py metrics OUT/metrics.jsonl                 # one line: loss, step time, tok/s

``generate``: each prompt of PROMPTS as one user message of the model's chat template, greedy, ``--max-new-tokens``
(default 64); JSON list of {prompt, answer}, printed too.

``report``: reads what bench/real_model_gpu.sh left in each run directory (``ppl.csv`` from eval_ppl.py,
``needle_*.csv`` from eval_needle.py, ``generations.json``, ``model.json``) and writes ``summary.md``,
``loss_by_position.png`` and ``ppl_by_length.png`` into ``--out``. Loss vs position comes from eval_ppl's nested prefixes: with ``--truncate``
and every document at least as long as the longest length, the window of length L scores the first L - 1 tokens of
every document, so the mean NLL of the tokens at positions [L' - 1, L - 1) is
(ln(ppl_L) (L - 1) - ln(ppl_L') (L' - 1)) / (L - L') (a causal model scores a prefix the same in any window).
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import sys

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "What does the Python `with` statement do? Answer in two sentences.",
    "List three primary colors.",
    "Summarize in one sentence: the committee met on Tuesday, argued for three hours about the budget, and agreed "
    "to postpone the decision until the next meeting.",
)


def generate(model_dir: str, out: str, max_new_tokens: int = 64) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    rows = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"].to(device)
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:]
        answer = tok.decode(new, skip_special_tokens=True).strip()
        rows.append({"prompt": prompt, "answer": answer})
        print(f"Q: {prompt}\nA: {answer}\n", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1, ensure_ascii=False)
    return rows


# ------------------------------------------------------------------------------------------------ report
def read_ppl(path: str) -> dict[int, float]:
    """eval_ppl.py's CSV (header ",L1,L2,...", one row per model) -> {length: ppl} of its first model."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    lengths = [int(x) for x in rows[0][1:]]
    return {L: float(v) if v not in ("", "nan") else math.nan for L, v in zip(lengths, rows[1][1:])}


def loss_by_position(ppl: dict[int, float]) -> list[tuple[int, int, float]]:
    """(start, end, mean NLL) of the positions each doubling adds (module docstring); NaN lengths end the list."""
    out, prev = [], None
    for L in sorted(ppl):
        if math.isnan(ppl[L]):
            break
        nll = math.log(ppl[L]) * (L - 1)
        if prev is None:
            out.append((0, L - 1, nll / (L - 1)))
        else:
            out.append((prev[0] - 1, L - 1, (nll - prev[1]) / (L - prev[0])))
        prev = (L, nll)
    return out


def read_needle(run_dir: str) -> dict[int, float]:
    """{haystack length: accuracy} from eval_needle.py's needle_*.csv in ``run_dir``."""
    files = sorted(glob.glob(os.path.join(run_dir, "needle_*.csv")))
    if not files:
        return {}
    acc: dict[int, list[int]] = {}
    with open(files[0], newline="") as f:
        for r in csv.DictReader(f):
            acc.setdefault(int(r["length"]), []).append(int(r["correct"]))
    return {L: sum(v) / len(v) for L, v in sorted(acc.items())}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def report(runs: list[tuple[str, str]], out: str) -> str:
    os.makedirs(out, exist_ok=True)
    md = ["# SmolLM2-135M-Instruct, 8K -> 64K: before / after (bench/real_model_gpu.sh)", ""]
    models = {}
    for name, d in runs:
        p = os.path.join(d, "model.json")
        models[name] = json.load(open(p)) if os.path.exists(p) else {}
    rows = [[n, m.get("path", "?"), f"{m.get('rope_theta', math.nan):g}", str(m.get("max_position_embeddings", "?")),
             m.get("trained", "")] for n, m in models.items()]
    md += [_table(["run", "model", "rope theta", "max positions", "trained"], rows), ""]
    needle = {n: read_needle(d) for n, d in runs}
    lengths = sorted({L for v in needle.values() for L in v})
    if lengths:
        md += ["## Needle accuracy by haystack length (chat template, prose haystack, depths 0..1)", "",
               _table(["run"] + [_k(L) for L in lengths] + ["mean"],
                      [[n] + [f"{needle[n][L]:.2f}" if L in needle[n] else "" for L in lengths]
                       + [f"{sum(needle[n].values()) / len(needle[n]):.2f}"] for n, _ in runs if needle[n]]),
               ""]
    ppl = {n: read_ppl(os.path.join(d, "ppl.csv")) for n, d in runs if os.path.exists(os.path.join(d, "ppl.csv"))}
    if ppl:
        plen = sorted({L for v in ppl.values() for L in v})
        md += ["## Perplexity of the first L tokens of held-out long documents (eval_ppl --truncate)", "",
               _table(["run"] + [_k(L) for L in plen], [[n] + [f"{v.get(L, math.nan):.3f}" for L in plen]
                                                      for n, v in ppl.items()]), ""]
        buckets = {n: loss_by_position(v) for n, v in ppl.items()}
        spans = sorted({(a, b) for v in buckets.values() for a, b, _ in v})
        md += ["## Mean loss (nats) by token position", "",
               _table(["run"] + [f"{_k(a + 1) if a else 0}-{_k(b + 1)}" for a, b in spans],
                      [[n] + [next((f"{x:.3f}" for a2, b2, x in v if (a2, b2) == s), "") for s in spans]
                       for n, v in buckets.items()]), ""]
        _plot({n: [((a + b) / 2, x) for a, b, x in v] for n, v in buckets.items()},
              os.path.join(out, "loss_by_position.png"), "token position (middle of each doubling)",
              "mean NLL (nats)", "loss by position")
        _plot({n: [(L, v[L]) for L in sorted(v) if not math.isnan(v[L])] for n, v in ppl.items()},
              os.path.join(out, "ppl_by_length.png"), "tokens (first L of each held-out long document)",
              "perplexity", "perplexity by length", log_y=True)
        md += ["![loss by position](loss_by_position.png) ![perplexity by length](ppl_by_length.png)", ""]
    gens = {n: json.load(open(os.path.join(d, "generations.json"))) for n, d in runs
            if os.path.exists(os.path.join(d, "generations.json"))}
    if gens:
        md += ["## Greedy answers to short chat prompts", ""]
        first = next(iter(gens.values()))
        for i, g in enumerate(first):
            md += [f"**{g['prompt']}**", ""]
            for n, v in gens.items():
                md += [f"- {n}: {' '.join(v[i]['answer'].split())[:400]}"]
            md += [""]
    text = "\n".join(md)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


def _plot(series: dict, path: str, xlabel: str, ylabel: str, title: str, log_y: bool = False) -> None:
    """One line per run: ``series`` = {name: [(x, y), ...]}, x on a log2 axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in series.items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"SmolLM2-135M on held-out long documents: {title}")
    ax.grid(alpha=0.3, which="both" if log_y else "major")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def metrics_summary(path: str) -> str:
    """One line from a train.py metrics.jsonl: steps, loss first -> last (mean of the last 10), median step time,
    tokens/s, MFU (steps after the first two: compile and allocator warm-up), peak memory."""
    import statistics
    rows = [json.loads(x) for x in open(path) if x.strip()]
    steady = rows[2:] or rows
    med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
    mem = next((k for k in rows[-1] if k.startswith("peak_mem")), None)
    tail = [r["loss"] for r in rows[-10:]]
    return (f"{path}: {rows[-1]['step']} steps, loss {rows[0]['loss']:.4f} (step 1) -> {sum(tail) / len(tail):.4f} "
            f"(last {len(tail)}), median step {med('step_time_s'):.2f} s, {med('tokens_per_s'):.0f} tok/s, "
            f"MFU {100 * med('mfu'):.1f}%, peak {rows[-1][mem]:.1f} GiB, {sum(r['step_time_s'] for r in rows):.0f} s "
            "in steps")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--model", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    m = sub.add_parser("metrics")
    m.add_argument("path")
    r = sub.add_parser("report")
    r.add_argument("--runs", nargs="+", required=True, help="NAME=DIR, in order")
    r.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "generate":
        generate(args.model, args.out, args.max_new_tokens)
    elif args.cmd == "metrics":
        print(metrics_summary(args.path))
    else:
        runs = [tuple(x.split("=", 1)) for x in args.runs]
        runs = [(n, d) for n, d in runs if os.path.isdir(d)]
        print(report(runs, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
