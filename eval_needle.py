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
heatmap_<model>.png (depth x length) and accuracy_<model>.txt ("Average Accuracy: x").
"""
from __future__ import annotations

import argparse
import csv
import os
import random

import torch
import torch.distributed as dist

SEED = 24242424  # EasyContext's seed


def parse_args(argv=None):
    from easy_context import SEQ_ALGOS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="PY007/Llama2-7B-64K", help="local model directory (save_pretrained) or Hub id")
    p.add_argument("--max_context_length", type=int, default=100000, help="haystack tokens, largest length")
    p.add_argument("--min_context_length", type=int, default=1000, help="haystack tokens, smallest length")
    p.add_argument("--context_interval", type=int, default=1000, help="step between lengths (tokens)")
    p.add_argument("--depth_interval", type=float, default=0.1, help="step between needle depths in [0, 1]")
    p.add_argument("--num_samples", type=int, default=10, help="prompts (random numbers) per (length, depth)")
    p.add_argument("--rope_theta", "--rope-theta", dest="rope_theta", type=float, default=None,
                   help="override the config's RoPE theta")
    p.add_argument("--rnd_number_digits", type=int, default=7, help="digits of the needle number (exactly)")
    p.add_argument("--haystack_dir", default=None, help="folder of *.txt (sorted); default: generated filler")
    p.add_argument("--num_distractor", type=int, default=0, help="distractor needles (0-6)")
    p.add_argument("--parallel_mode", default="zigzag_ring_attn", choices=SEQ_ALGOS,
                   help="sequence parallelism over the launched ranks; data_parallel splits prompts instead")
    p.add_argument("--ring_degree", type=int, default=None, help="usp_attn only: ring size (ring x ulysses = world)")
    p.add_argument("--mode", choices=("generate", "teacher_forced"), default="generate")
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help="greedy tokens to generate (default: answer length + 8)")
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", default="data")
    return p.parse_args(argv)


def check_grid(args):
    """Lengths and depths of the grid, or a ValueError saying what is impossible."""
    if args.min_context_length < 1 or args.context_interval < 1:
        raise ValueError(f"--min_context_length ({args.min_context_length}) and --context_interval "
                         f"({args.context_interval}) must be >= 1")
    if args.max_context_length < args.min_context_length:
        raise ValueError(f"impossible length grid: --max_context_length {args.max_context_length} < "
                         f"--min_context_length {args.min_context_length}")
    if not 0 < args.depth_interval <= 1:
        raise ValueError(f"--depth_interval must be in (0, 1]; got {args.depth_interval}")
    if args.num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1; got {args.num_samples}")
    if not 0 <= args.num_distractor <= 6:
        raise ValueError(f"--num_distractor must be between 0 and 6 (one per city); got {args.num_distractor}")
    if args.rnd_number_digits < 1:
        raise ValueError(f"--rnd_number_digits must be >= 1; got {args.rnd_number_digits}")
    lengths = list(range(args.min_context_length, args.max_context_length + 1, args.context_interval))
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


def model_tag(path: str) -> str:
    return os.path.basename(os.path.normpath(path)).replace("/", "_") or "model"


def save_heatmap(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

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
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    lengths, depths = check_grid(args)
    from easy_context.training.errors import UsageError
    from easy_context.training.run_dir import check_writable_dir
    try:  # before the model loads: results are never lost at the end
        check_writable_dir(args.output_dir)
    except UsageError as e:
        raise ValueError(str(e)) from None

    from tqdm import tqdm

    from easy_context.haystack import NeedleHaystack, read_haystack
    from easy_context.inference import SeqParallelLM, init_distributed, load_model

    rank, world, device = init_distributed()
    torch.manual_seed(SEED)
    model, tok = load_model(args.model, rope_theta=args.rope_theta, device=device)
    engine = SeqParallelLM(model, args.parallel_mode, ring_degree=args.ring_degree)
    # data_parallel: each rank takes every world-th prompt; sp modes: all ranks run every prompt together
    dp_split = engine.world == 1 and world > 1
    hay = NeedleHaystack(tok, read_haystack(args.haystack_dir), args.max_context_length)
    jobs = build_jobs(args, lengths, depths)
    mine = [j for i, j in enumerate(jobs) if not dp_split or i % world == rank]
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)

    rows = []
    for job in tqdm(mine, desc="needle", disable=rank != 0):
        prompt = hay.build(job["length"], job["depth"], job["number"], job["distractors"],
                           rng=random.Random(job["seed"]))
        ids = torch.tensor([prompt.input_ids], device=device)
        if args.mode == "generate":
            n_new = args.max_new_tokens or len(prompt.answer_ids) + 8
            new = engine.generate(ids, n_new, eos_token_id=eos, pad_id=pad)
            text = tok.decode(new, skip_special_tokens=True)
            correct = job["number"] in text
        else:
            ans = torch.tensor([prompt.answer_ids], device=device)
            pred = engine.teacher_forced(ids, ans, pad_id=pad)[0].tolist()
            text = tok.decode(pred, skip_special_tokens=True)
            correct = pred == prompt.answer_ids
        rows.append(dict(length=job["length"], depth=job["depth"], sample=job["sample"],
                         expected=job["number"], generated=text, correct=int(correct)))
        if not correct and rank == 0:
            tqdm.write(f"[miss] length={job['length']} depth={job['depth']} expected={job['number']} "
                       f"got={text!r} distractors={job['distractors']}")
    if dp_split:
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        rows = sorted((r for part in gathered for r in part),
                      key=lambda r: (r["length"], r["depth"], r["sample"]))
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        tag = model_tag(args.model)
        csv_path = os.path.join(args.output_dir, f"needle_{tag}.csv")
        with open(csv_path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=["length", "depth", "sample", "expected", "generated", "correct"])
            w.writeheader()
            w.writerows(rows)
        acc = sum(r["correct"] for r in rows) / max(1, len(rows))
        save_heatmap(rows, os.path.join(args.output_dir, f"heatmap_{tag}.png"),
                     f"{tag} ({args.mode}, {args.parallel_mode}, {world} ranks)")
        with open(os.path.join(args.output_dir, f"accuracy_{tag}.txt"), "w") as f:
            f.write(f"Average Accuracy: {acc}\n")
        print(f"Average Accuracy: {acc}")
        print(f"wrote {csv_path}")
    engine.close()
    return rows


if __name__ == "__main__":
    from easy_context.cli import run_cli
    run_cli(main, "eval_needle.py")
