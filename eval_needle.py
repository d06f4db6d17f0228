"""Needle-in-a-haystack eval with real generation, sequence-parallel (EasyContext's eval_needle, fixed).

    # one process (tiny CPU check; without --haystack_dir a generated filler text is used)
    python eval_needle.py --model MODEL_DIR --min_context_length 1000 --max_context_length 4000 \
        --context_interval 1000 --depth_interval 0.25 --num_samples 2 --output-dir out/needle
    # 8 GPUs, zigzag ring attention over the prompt, greedy decoding over the distributed KV cache
    accelerate launch --num_processes 8 eval_needle.py --model OUT --max_context_length 1000000 \
        --min_context_length 50000 --context_interval 50000 --depth_interval 0.1 --num_samples 2 \
        --rnd_number_digits 7 --haystack_dir PaulGrahamEssays --parallel_mode zigzag_ring_attn
    # CPU, 2 ranks: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 eval_needle.py ...

--mode generate (default): SP prefill + greedy decoding (easy_context/inference.py explains how decode
attends to every rank's prompt KV); a prompt is correct when the generated text contains the number.
--mode teacher_forced: EasyContext's scoring (all argmax tokens at the answer positions equal the answer).
Outputs in --output-dir: needle_<model>.csv (length, depth, sample, expected, generated, correct),
heatmap_<model>.png (depth x length) and accuracy_<model>.txt ("Average Accuracy: x"), each written atomically.
--chat-template: the prompt becomes one user message of the tokenizer's chat template (add_generation_prompt).
"""
from __future__ import annotations

import argparse
import os
import random

import torch

from easy_context.evals import SEED, model_tag  # noqa: F401  (model_tag: kept importable from here)


def parse_args(argv=None):
    from easy_context.evals import add_common_args
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, "greedy tokens to generate (default: answer length + 8)")
    p.add_argument("--depth_interval", type=float, default=0.1, help="step between needle depths in [0, 1]")
    p.add_argument("--rnd_number_digits", type=int, default=7, help="digits of the needle number (exactly)")
    p.add_argument("--num_distractor", type=int, default=0, help="distractor needles (0-6)")
    p.add_argument("--mode", choices=("generate", "teacher_forced"), default="generate")
    return p.parse_args(argv)


def check_grid(args):
    """Lengths (haystack tokens) and depths of the grid, or a ValueError saying what is impossible."""
    from easy_context.evals import length_grid
    lengths = length_grid(args)
    if not 0 < args.depth_interval <= 1:
        raise ValueError(f"--depth_interval must be in (0, 1]; got {args.depth_interval}")
    if not 0 <= args.num_distractor <= 6:
        raise ValueError(f"--num_distractor must be between 0 and 6 (one per city); got {args.num_distractor}")
    if args.rnd_number_digits < 1:
        raise ValueError(f"--rnd_number_digits must be >= 1; got {args.rnd_number_digits}")
    steps = int(round(1 / args.depth_interval, 9) + 1e-9)
    depths = [round(i * args.depth_interval, 10) for i in range(steps + 1) if i * args.depth_interval <= 1 + 1e-9]
    return lengths, depths


def build_jobs(args, lengths, depths):
    """Every prompt of the grid with its numbers, drawn once from the seed (identical on every rank)."""
    from easy_context.haystack import DISTRACTOR_CITIES, random_number
    rng = random.Random(SEED)
    jobs = []
    for length in lengths:
        for depth in depths:
            for s in range(args.num_samples):
                number = random_number(rng, args.rnd_number_digits)
                cities = rng.sample(DISTRACTOR_CITIES, args.num_distractor)  # fresh per prompt
                distractors = [(c, random_number(rng, args.rnd_number_digits)) for c in cities]
                jobs.append(dict(length=length, depth=depth, sample=s, number=number,
                                 distractors=distractors, seed=rng.randrange(1 << 30)))
    return jobs


def save_heatmap(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    from easy_context.evals import atomic_savefig

    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = torch.zeros(len(depths), len(lengths), dtype=torch.float64)
    count = torch.zeros_like(grid)
    for r in rows:
        i, j = depths.index(r["depth"]), lengths.index(r["length"])
        grid[i, j] += float(r["correct"])
        count[i, j] += 1
    grid = (grid / count.clamp_min(1)).numpy()
    cmap = LinearSegmentedColormap.from_list("easy_context", ["#F0496E", "#EBB839", "#0CD79F"])
    fig, ax = plt.subplots(figsize=(17.5, 8))
    im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], rotation=45)
    ax.set_yticks(range(len(depths)), [f"{100 * d:g}" for d in depths])  # no rounding to tens
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("Token Limit")
    ax.set_ylabel("Depth Percent")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="Score")
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    lengths, depths = check_grid(args)
    from easy_context.evals import EvalSession, atomic_write_csv, atomic_write_text, check_output_dir, model_tag
    check_output_dir(args.output_dir)

    from tqdm import tqdm

    from easy_context.haystack import NeedleHaystack, read_haystack

    s = EvalSession(args)
    tok, rank, world = s.tok, s.rank, s.world
    hay = NeedleHaystack(tok, read_haystack(args.haystack_dir), args.max_context_length)
    jobs = build_jobs(args, lengths, depths)

    rows = []
    for job in tqdm(s.mine(jobs), desc="needle", disable=rank != 0):
        prompt = hay.build(job["length"], job["depth"], job["number"], job["distractors"],
                           rng=random.Random(job["seed"]))
        ids, answer_ids = prompt.input_ids, prompt.answer_ids
        if s.chat is not None:  # the whole needle prompt is the user message; the reply starts the answer
            ids = s.chat(ids)
            answer_ids = list(tok(job["number"], add_special_tokens=False)["input_ids"])
        if args.mode == "generate":
            n_new = args.max_new_tokens or len(answer_ids) + 8
            text = s.generate(ids, n_new)
            correct = job["number"] in text
        else:
            ans = torch.tensor([answer_ids], device=s.device)
            pred = s.engine.teacher_forced(torch.tensor([ids], device=s.device), ans, pad_id=s.pad)[0].tolist()
            text = tok.decode(pred, skip_special_tokens=True)
            correct = pred == answer_ids
        rows.append(dict(length=job["length"], depth=job["depth"], sample=job["sample"],
                         expected=job["number"], generated=text, correct=int(correct)))
        if not correct and rank == 0:
            tqdm.write(f"[miss] length={job['length']} depth={job['depth']} expected={job['number']} "
                       f"got={text!r} distractors={job['distractors']}")
    rows = s.gather(rows, key=lambda r: (r["length"], r["depth"], r["sample"]))
    if rank == 0:
        tag = model_tag(args.model)
        csv_path = os.path.join(args.output_dir, f"needle_{tag}.csv")
        atomic_write_csv(csv_path, ["length", "depth", "sample", "expected", "generated", "correct"], rows)
        acc = sum(r["correct"] for r in rows) / max(1, len(rows))
        png = os.path.join(args.output_dir, f"heatmap_{tag}.png")
        save_heatmap(rows, png, f"{tag} ({args.mode}, {args.parallel_mode}, {world} ranks"
                                f"{', chat template' if s.chat else ''})")
        atomic_write_text(os.path.join(args.output_dir, f"accuracy_{tag}.txt"), f"Average Accuracy: {acc}\n")
        for length in lengths:
            sel = [r["correct"] for r in rows if r["length"] == length]
            print(f"length {length}: accuracy {sum(sel) / max(1, len(sel)):.3f} ({sum(sel)}/{len(sel)})")
        print(f"Average Accuracy: {acc}")
        print(f"wrote {csv_path}")
        print(f"wrote {png}")
    s.close()
    return rows


if __name__ == "__main__":
    from easy_context.cli import run_cli
    run_cli(main, "eval_needle.py")
