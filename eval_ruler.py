"""RULER-style synthetic long-context suite with real generation, sequence-parallel (same launch as eval_needle.py).

    # one process, tiny CPU check (without --haystack_dir the generated filler text is used)
    python eval_ruler.py --model MODEL_DIR --min_context_length 1000 --max_context_length 4000 \
        --context_interval 1000 --num_samples 2 --output-dir out/ruler
    # 8 GPUs, zigzag ring attention over the prompt, greedy decoding over the distributed KV cache
    accelerate launch --num_processes 8 eval_ruler.py --model OUT --min_context_length 32768 \
        --max_context_length 131072 --context_interval 32768 --num_samples 25 --parallel_mode zigzag_ring_attn
    # instruction-tuned model: --chat-template (the task text is the user message, the answer prefix follows
    # the generation prompt, as in RULER)

Tasks (--tasks, default all): niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe, fwe;
how each follows RULER (Hsieh et al. 2024) and where it differs: easy_context/ruler/tasks.py. A context
length is the whole prompt in tokens of the model's tokenizer (template and answer prefix included); the
generated tokens come on top (RULER subtracts them from the length instead).
Score per sample: fraction of the expected strings found in the generation (RULER's string_match_all).
Outputs in --output-dir, each written atomically: ruler_<model>.csv (task, length, sample, score, expected,
generated), ruler_<model>_summary.txt (the task x length table of mean scores, x100 like RULER, printed too)
and ruler_<model>.png (score vs length per task).
"""
from __future__ import annotations

import argparse
import os

from easy_context.evals import SEED


def parse_args(argv=None):
    from easy_context.evals import add_common_args
    from easy_context.ruler import TASKS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, "greedy tokens to generate (default: RULER's per task: niah 128, vt 30, cwe 120, fwe 50)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS, metavar="TASK",
                   help=f"tasks to run (default: all of {', '.join(TASKS)})")
    p.add_argument("--seed", type=int, default=SEED, help="prompts are a function of (seed, task, length, sample)")
    return p.parse_args(argv)


def build_jobs(args, lengths):
    return [dict(task=t, length=L, sample=i) for t in args.tasks for L in lengths for i in range(args.num_samples)]


def summary_table(rows, tasks, lengths) -> str:
    """Mean score x100 per task (rows) and length (columns), plus each task's and each length's average."""
    def mean(xs):
        return 100 * sum(xs) / len(xs) if xs else float("nan")
    w = max(8, *(len(t) for t in tasks)) + 2
    lines = ["task".ljust(w) + "".join(f"{L:>10}" for L in lengths) + f"{'avg':>10}"]
    for t in tasks:
        cells = [mean([r["score"] for r in rows if r["task"] == t and r["length"] == L]) for L in lengths]
        lines.append(t.ljust(w) + "".join(f"{c:>10.1f}" for c in cells)
                     + f"{mean([r['score'] for r in rows if r['task'] == t]):>10.1f}")
    cells = [mean([r["score"] for r in rows if r["length"] == L]) for L in lengths]
    lines.append("average".ljust(w) + "".join(f"{c:>10.1f}" for c in cells) + f"{mean([r['score'] for r in rows]):>10.1f}")
    return "\n".join(lines) + "\n"


def save_plot(rows, tasks, lengths, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from easy_context.evals import atomic_savefig

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for t in tasks:
        ys = []
        for L in lengths:
            sel = [r["score"] for r in rows if r["task"] == t and r["length"] == L]
            ys.append(100 * sum(sel) / len(sel) if sel else float("nan"))
        ax.plot(lengths, ys, marker="o", label=t)
    ax.set_ylim(-3, 103)
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Score (% of expected answers found)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    from easy_context.evals import (EvalSession, atomic_write_csv, atomic_write_text, check_output_dir,
                                    length_grid, model_tag)
    lengths = length_grid(args)
    check_output_dir(args.output_dir)

    from tqdm import tqdm

    from easy_context.haystack import read_haystack
    from easy_context.ruler import RulerBuilder, score_sample

    s = EvalSession(args)
    builder = RulerBuilder(s.tok, read_haystack(args.haystack_dir), args.max_context_length, wrap=s.chat)
    jobs = build_jobs(args, lengths)
    # every prompt is built (and its length checked) up front on every rank: a too-short length fails at once,
    # identically everywhere, instead of after hours of generation
    samples = [builder.build(j["task"], j["length"], j["sample"], args.seed, args.max_new_tokens) for j in jobs]
    rows = []
    for job, smp in tqdm(s.mine(list(zip(jobs, samples))), desc="ruler", disable=s.rank != 0):
        text = s.generate(smp.input_ids, smp.max_new_tokens)
        rows.append(dict(task=job["task"], length=job["length"], sample=job["sample"],
                         score=score_sample(text, smp.answers), expected="|".join(smp.answers),
                         generated=text, prompt_tokens=len(smp.input_ids)))
    order = {t: i for i, t in enumerate(args.tasks)}
    rows = s.gather(rows, key=lambda r: (order[r["task"]], r["length"], r["sample"]))
    if s.rank == 0:
        tag = model_tag(args.model)
        csv_path = os.path.join(args.output_dir, f"ruler_{tag}.csv")
        atomic_write_csv(csv_path, ["task", "length", "sample", "score", "expected", "generated", "prompt_tokens"],
                         rows)
        table = summary_table(rows, args.tasks, lengths)
        atomic_write_text(os.path.join(args.output_dir, f"ruler_{tag}_summary.txt"), table)
        png = os.path.join(args.output_dir, f"ruler_{tag}.png")
        save_plot(rows, args.tasks, lengths, png, f"RULER: {tag} ({args.parallel_mode}, {s.world} ranks"
                                                  f"{', chat template' if s.chat else ''})")
        print(table, end="")
        print(f"wrote {csv_path}")
        print(f"wrote {png}")
    s.close()
    return rows


if __name__ == "__main__":
    from easy_context.cli import run_cli
    run_cli(main, "eval_ruler.py")
