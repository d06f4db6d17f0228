"""Probe of `make demo`'s training recipe (issue #45) in plain PyTorch on one CPU process, with needle curves.

Trains the demo's tiny Llama on the demo's own packed rows (``python -m easy_context_train.toy`` output:
``tiny-llama``, ``data_256``, ``data_512``) with train.py's math: AdamW (betas 0.9/0.95, no weight decay), grad
clipping 1.0, the token-mean next-token loss over the batch, documents masked by their restarting ``position_ids``
(a block-diagonal causal mask here, ring attention in the demo). Stage 2 continues at the second length with the
second RoPE theta, like the demo. Every ``--eval-every`` steps it scores eval_needle's grid of the demo (haystacks of
64-448 tokens, depths 0-1 by 0.25, 2 samples, 2-digit numbers, the same prompts as eval_needle.py) teacher-forced:
the argmax at the answer positions equals the answer (what greedy generation then writes). Stage 2 is scored with
the saved theta (1e5). No DeepSpeed, no ranks: a stage-1 run of 2000 steps is about 5 minutes on one core, so
recipes can be compared over seeds before one goes into ``make demo`` (which confirms it with real generation).

    python -m easy_context_train.toy A --seq-lengths 256 512 ... (the flags of train_scripts/demo_cpu.sh)
    python bench/demo_recipe_probe.py A --seed 1 --s1-steps 2000 --eval-every 250
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stage_args(p, n, steps, lr, warmup, batch, theta):
    p.add_argument(f"--s{n}-steps", type=int, default=steps)
    p.add_argument(f"--s{n}-lr", type=float, default=lr)
    p.add_argument(f"--s{n}-warmup", type=int, default=warmup)
    p.add_argument(f"--s{n}-batch", type=int, default=batch)
    p.add_argument(f"--s{n}-theta", type=float, default=theta)
    p.add_argument(f"--s{n}-schedule", choices=("constant", "cosine", "linear"), default="constant")
    p.add_argument(f"--s{n}-min-lr-ratio", type=float, default=0.1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("assets", help="output dir of easy_context_train.toy (tiny-llama, data_<L>)")
    p.add_argument("--seed", type=int, default=42, help="row order (train.py's --seed)")
    p.add_argument("--lengths", type=int, nargs=2, default=[256, 512])
    stage_args(p, 1, 2000, 6e-3, 10, 8, 2e4)
    stage_args(p, 2, 150, 1e-3, 5, 4, 8e4)
    p.add_argument("--save-theta", type=float, default=1e5, help="theta stage 2 is scored (and saved) with")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--show-misses", type=int, default=0, help="print this many wrong answers (expected->argmax)")
    p.add_argument("--save", default=None, help="save the model of each stage to SAVE/stage<N>")
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from datasets import load_from_disk
    from transformers import AutoTokenizer, LlamaForCausalLM

    from easy_context.haystack import NeedleHaystack, read_haystack
    from easy_context_train.modeling import set_rope_theta
    from easy_context_train.optim import BETAS, EPS, lr_factor
    from eval_needle import build_jobs, check_grid, parse_args as needle_args

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model_dir = os.path.join(a.assets, "tiny-llama")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def set_theta(theta):
        set_rope_theta(model.config, theta)
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)

    nargs = needle_args(["--model", model_dir, "--min_context_length", "64", "--max_context_length", "448",
                         "--context_interval", "64", "--depth_interval", "0.25", "--num_samples", "2",
                         "--rnd_number_digits", "2"])
    lengths, depths = check_grid(nargs)
    hay = NeedleHaystack(tok, read_haystack(None), nargs.max_context_length)
    evset = []
    for job in build_jobs(nargs, lengths, depths):
        pr = hay.build(job["length"], job["depth"], job["number"], rng=random.Random(job["seed"]))
        evset.append((job["length"], pr.input_ids, pr.answer_ids))

    @torch.no_grad()
    def needle():
        model.eval()
        by_len, by_tok, misses = {}, {}, []
        for L, ids, ans in evset:
            logits = model(torch.tensor([ids + ans])).logits[0, len(ids) - 1:len(ids) - 1 + len(ans)]
            pred = logits.argmax(-1).tolist()
            by_len.setdefault(L, []).append(pred == ans)
            if pred != ans:
                misses.append(f"{tok.decode(ans)!r}->{tok.decode(pred)!r}")
            for j, (u, v) in enumerate(zip(pred, ans)):
                by_tok.setdefault(j, []).append(u == v)
        model.train()
        acc = sum(sum(v) for v in by_len.values()) / len(evset)
        mean = lambda v: f"{sum(v) / len(v):.2f}"  # noqa: E731
        return acc, (" ".join(mean(v) for v in by_len.values()) + "] per answer token ["
                     + " ".join(mean(v) for v in by_tok.values()) + "] misses [" + " ".join(misses[:a.show_misses]))

    def doc_mask(pos):  # (B, 1, T, T): causal inside each document (position_ids restart at 0)
        doc = torch.cumsum((pos == 0).long(), 1)
        T = pos.shape[1]
        return ((doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[:, None]

    t0 = time.time()
    opt = None
    for n, L in ((1, a.lengths[0]), (2, a.lengths[1])):
        steps, lr, warmup, batch, theta, sched, min_ratio = (getattr(a, f"s{n}_{k}") for k in (
            "steps", "lr", "warmup", "batch", "theta", "schedule", "min_lr_ratio"))
        if steps == 0:
            continue
        rows = load_from_disk(os.path.join(a.assets, f"data_{L}")).with_format("torch")
        set_theta(theta)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=0.0)
        order, losses = [], []
        g = torch.Generator().manual_seed(a.seed + n)
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor(step, warmup, steps, sched, min_ratio)
            if len(order) < batch:
                order += torch.randperm(len(rows), generator=g).tolist()
            b = rows[order[:batch]]
            order = order[batch:]
            ids, pos = b["input_ids"][:, :L + 1], b["position_ids"][:, :L + 1]
            inp, tgt, pin = ids[:, :-1], b["labels"][:, 1:L + 1].clone(), pos[:, :-1]
            tgt[pos[:, 1:] == 0] = -100
            logits = model(inp, position_ids=pin, attention_mask=doc_mask(pin)).logits
            nll = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="sum")
            loss = nll / (tgt != -100).sum().clamp(min=1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if (step + 1) % a.eval_every == 0 or step + 1 == steps:
                if n == 2 and step + 1 == steps:
                    set_theta(a.save_theta)
                acc, per_len = needle()
                print(f"seed {a.seed} stage {n} step {step + 1:5d}  loss {sum(losses) / len(losses):.3f}  "
                      f"needle {acc:.2f}  by length [{per_len}]  {time.time() - t0:.0f} s", flush=True)
                losses = []
        if a.save:
            model.save_pretrained(os.path.join(a.save, f"stage{n}"))


if __name__ == "__main__":
    main()
