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
--templates own|heldout|both (default own): heldout asks the probes of easy_context/haystack/heldout.py (needle kinds,
wordings and frames no training generator emits; --probe_kinds picks some) over the prose haystack and, for the code
probe, --code_haystack_dir (default generated code); generate mode only. Their rows add the columns templates, kind,
template_id to the CSV, and each kind gets its own heatmap_<model>_<kind>.png; a held-out answer that names a
distractor's number is wrong.
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
    p.add_argument("--templates", choices=("own", "heldout", "both"), default="own",
                   help="own: EasyContext's needle and question; heldout: the held-out probe kinds; both")
    p.add_argument("--probe_kinds", nargs="+", default=None, metavar="KIND",
                   help="held-out kinds to ask (default all: frame word passkey distract kv code)")
    p.add_argument("--code_haystack_dir", default=None,
                   help="folder of *.txt code files for the held-out code probe (default: generated code)")
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
    from easy_context.haystack.heldout import KINDS
    bad = sorted(set(args.probe_kinds or ()) - set(KINDS))
    if bad:
        raise ValueError(f"--probe_kinds: unknown {', '.join(bad)}; choose from {', '.join(KINDS)}")
    if args.templates != "own" and args.mode != "generate":
        raise ValueError("--templates heldout|both scores generated text: use --mode generate")
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
    if args.templates == "heldout":
        jobs = []
    if args.templates != "own":  # their own RNG: the own jobs stay what they were without them
        from easy_context.haystack import heldout
        hrng = random.Random(SEED + 1)
        for kind in args.probe_kinds or heldout.KINDS:
            for length in lengths:
                for depth in depths:
                    for s in range(args.num_samples):
                        key, value, distractors = heldout.draw(kind, hrng)
                        jobs.append(dict(length=length, depth=depth, sample=s, number=value, key=key, kind=kind,
                                         distractors=distractors, seed=hrng.randrange(1 << 30)))
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
    from easy_context.evals import EvalSession, check_output_dir
    check_output_dir(args.output_dir)

    from tqdm import tqdm

    from easy_context.haystack import NeedleHaystack, read_haystack

    s = EvalSession(args)
    tok, rank, world = s.tok, s.rank, s.world
    jobs = build_jobs(args, lengths, depths)
    hay = probes = None
    if any("kind" not in j for j in jobs):
        hay = NeedleHaystack(tok, read_haystack(args.haystack_dir), args.max_context_length)
    if any("kind" in j for j in jobs):
        from easy_context.haystack.heldout import HeldoutProbes
        code = read_haystack(args.code_haystack_dir) if args.code_haystack_dir else None
        probes = HeldoutProbes(tok, read_haystack(args.haystack_dir), code, args.max_context_length)

    rows = []
    for job in tqdm(s.mine(jobs), desc="needle", disable=rank != 0):
        row = _run_job(args, s, hay, probes, job)
        rows.append(row)
        if not row["correct"] and rank == 0:
            tqdm.write(f"[miss] {row.get('kind', 'own')} length={job['length']} depth={job['depth']} "
                       f"expected={job['number']} got={row['generated']!r} distractors={job['distractors']}")
    order = {k: i for i, k in enumerate(["own"] + list(args.probe_kinds or ()))}
    rows = s.gather(rows, key=lambda r: (order.get(r.get("kind", "own"), len(order)), r.get("kind", ""),
                                         r["length"], r["depth"], r["sample"]))
    if rank == 0:
        _write_outputs(args, s, rows, lengths)
    s.close()
    return rows


def _run_job(args, s, hay, probes, job) -> dict:
    """One prompt: built, generated (or teacher-forced), scored; the CSV row."""
    tok = s.tok
    if "kind" in job:  # a held-out probe: content ids, then the chat template or the BOS
        from easy_context.haystack.heldout import correct
        p = probes.build(job["kind"], job["length"], job["depth"], job["key"], job["number"], job["distractors"],
                         rng=random.Random(job["seed"]))
        bos = [tok.bos_token_id] if tok.bos_token_id is not None and tok("a")["input_ids"][:1] == [tok.bos_token_id] \
            else []
        ids = s.chat(p.input_ids) if s.chat is not None else bos + p.input_ids
        text = s.generate(ids, args.max_new_tokens or len(tok(job["number"])["input_ids"]) + 24)
        return dict(length=job["length"], depth=job["depth"], sample=job["sample"], expected=job["number"],
                    generated=text, correct=int(correct(text, p)), templates="heldout", kind=job["kind"],
                    template_id=p.template_id)
    prompt = hay.build(job["length"], job["depth"], job["number"], job["distractors"], rng=random.Random(job["seed"]))
    ids, answer_ids = prompt.input_ids, prompt.answer_ids
    if s.chat is not None:  # the whole needle prompt is the user message; the reply starts the answer
        ids = s.chat(ids)
        answer_ids = list(tok(job["number"], add_special_tokens=False)["input_ids"])
    if args.mode == "generate":
        text = s.generate(ids, args.max_new_tokens or len(answer_ids) + 8)
        ok = job["number"] in text
    else:
        ans = torch.tensor([answer_ids], device=s.device)
        pred = s.engine.teacher_forced(torch.tensor([ids], device=s.device), ans, pad_id=s.pad)[0].tolist()
        text = tok.decode(pred, skip_special_tokens=True)
        ok = pred == answer_ids
    row = dict(length=job["length"], depth=job["depth"], sample=job["sample"], expected=job["number"],
               generated=text, correct=int(ok))
    if args.templates != "own":
        row.update(templates="own", kind="own", template_id="eval_needle/own")
    return row


def _write_outputs(args, s, rows, lengths) -> None:
    from easy_context.evals import atomic_write_csv, atomic_write_text, model_tag
    tag = model_tag(args.model)
    csv_path = os.path.join(args.output_dir, f"needle_{tag}.csv")
    cols = ["length", "depth", "sample", "expected", "generated", "correct"]
    atomic_write_csv(csv_path, cols + (["templates", "kind", "template_id"] if args.templates != "own" else []), rows)
    acc = sum(r["correct"] for r in rows) / max(1, len(rows))
    what = f"{args.mode}, {args.parallel_mode}, {s.world} ranks{', chat template' if s.chat else ''}"
    groups = {}
    for r in rows:
        groups.setdefault(r.get("kind", "own"), []).append(r)
    for kind, sel_rows in groups.items():
        png = os.path.join(args.output_dir, f"heatmap_{tag}.png" if kind == "own" else f"heatmap_{tag}_{kind}.png")
        save_heatmap(sel_rows, png, f"{tag} ({what})" + ("" if kind == "own" else f" held-out probe: {kind}"))
        for length in lengths:
            sel = [r["correct"] for r in sel_rows if r["length"] == length]
            print(f"{'' if kind == 'own' else kind + ' '}length {length}: accuracy "
                  f"{sum(sel) / max(1, len(sel)):.3f} ({sum(sel)}/{len(sel)})")
        print(f"wrote {png}")
    text = f"Average Accuracy: {acc}\n" + "".join(
        f"{k}: {sum(r['correct'] for r in v) / len(v)}\n" for k, v in groups.items() if len(groups) > 1)
    atomic_write_text(os.path.join(args.output_dir, f"accuracy_{tag}.txt"), text)
    print(f"Average Accuracy: {acc}")
    print(f"wrote {csv_path}")


if __name__ == "__main__":
    from easy_context.cli import run_cli
    run_cli(main, "eval_needle.py")
