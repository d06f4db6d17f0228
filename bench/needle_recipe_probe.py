"""Probe for a demo recipe that learns eval_needle's passkey (issue #19), in plain PyTorch on one CPU process.

Trains a tiny Llama on eval_needle's exact prompts (NeedleHaystack, the default haystack) and prints, every
``--eval-every`` steps, exact-match accuracy per context length and per answer-token accuracy (teacher-forced
argmax over the answer = greedy decoding for exact match). No DeepSpeed, no ranks: minutes per try, so recipes
can be compared before one goes into ``make demo``.

Knobs that mattered (2026-12-03/04, 2 CPU cores; see the closing notes of issue #19):
* ``--digit-tokenizer``: byte-level BPE whose numbers split as " 4" "8" "2" "1" (space-digit first, bare digits
  after). The toy tokenizer's default gives a bare " " before the digits, which occurs everywhere in the
  haystack, so the first digit cannot be found by matching the previous token.
* ``--drill-frac``: share of rows that are "The pass key is N. Remember it. N is the pass key." with 6-16
  digit N: dense digit-copy targets, which grow the induction heads that the needle's later digits need.
* ``--ans-weight``: loss weight of the answer tokens (train.py has no such weight; 1 = what train.py does).
* ``--digits 2``, ``--lr 6e-3``: both answer tokens of a 2-digit needle are then read within ~1200 steps.
  What ``make demo`` finally uses (train.py, not this probe): 2-digit needles and drills, width 128 and 4 KV heads
  (with 2 KV heads about half the seeds learned only one of the two digits in 2000 steps).

Example: ``python bench/needle_recipe_probe.py --digit-tokenizer --drill-frac 0.5 --steps 2000``
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-context", type=int, default=256, help="haystack tokens of training prompts: 0..this")
    p.add_argument("--digits", type=int, default=4)
    p.add_argument("--ans-weight", type=float, default=1.0)
    p.add_argument("--drill-frac", type=float, default=0.0)
    p.add_argument("--digit-tokenizer", action="store_true")
    p.add_argument("--vocab", type=int, default=768)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-lengths", type=int, nargs="+", default=[64, 128, 192, 256, 320])
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from easy_context.haystack import NeedleHaystack, filler_text, random_number
    from easy_context_train.toy import build_tokenizer, make_corpus, make_needle_corpus

    torch.manual_seed(0)
    texts = make_corpus(400) + make_needle_corpus(3000, 0, 6) + [filler_text(300)]
    tdir = tempfile.mkdtemp(prefix="needle_probe_tok_")
    tok = build_tokenizer(texts, tdir, a.vocab, split_digits=a.digit_tokenizer)
    nh = NeedleHaystack(tok, filler_text(), max(a.eval_lengths + [a.max_context]))
    print("answer tokens of 4821:", [tok.decode([i]) for i in nh.answer_ids("4821")])

    def prompt(length, depth, r):
        pr = nh.build(length, depth, random_number(r, a.digits))
        return pr.input_ids, pr.answer_ids

    def drill(r):
        n = random_number(r, r.randint(6, 16))
        return tok(f"The pass key is {n}. Remember it. {n} is the pass key.", add_special_tokens=False)["input_ids"]

    def batch(r):
        rows = []
        for _ in range(a.batch):
            if r.random() < a.drill_frac:
                ids = drill(r)
                rows.append((ids, len(ids)))
            else:
                ids, ans = prompt(r.randint(0, a.max_context), r.random(), r)
                rows.append((ids + ans, len(ids)))
        T = max(len(s) for s, _ in rows)
        x = torch.full((len(rows), T), tok.eos_token_id)
        y = torch.full((len(rows), T), -100)
        w = torch.zeros(len(rows), T)
        for i, (s, q) in enumerate(rows):
            x[i, :len(s)] = torch.tensor(s)
            y[i, :len(s) - 1] = torch.tensor(s[1:])
            w[i, :len(s) - 1] = 1.0
            w[i, q - 1:len(s) - 1] = a.ans_weight
        return x, y, w

    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=len(tok),
                      max_position_embeddings=4096, rope_theta=2e4, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    er = random.Random(123)
    evset = [(L, *prompt(L, d, er)) for L in a.eval_lengths for d in (0, .25, .5, .75, 1.0) for _ in range(2)]

    @torch.no_grad()
    def evaluate():
        model.eval()
        exact, per_tok = {}, {}
        for L, ids, ans in evset:
            pred = model(torch.tensor([ids + ans])).logits[0, len(ids) - 1:len(ids) - 1 + len(ans)].argmax(-1)
            exact.setdefault(L, []).append(pred.tolist() == ans)
            for j, (u, v) in enumerate(zip(pred.tolist(), ans)):
                per_tok.setdefault(j, []).append(u == v)
        model.train()
        mean = lambda v: round(sum(v) / len(v), 2)  # noqa: E731
        return {L: mean(v) for L, v in exact.items()}, {j: mean(v) for j, v in per_tok.items()}

    r, t0 = random.Random(1), time.time()
    for step in range(1, a.steps + 1):
        x, y, w = batch(r)
        logits = model(x).logits
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
        loss = (nll * w.reshape(-1)).sum() / w.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % a.eval_every == 0 or step == a.steps:
            exact, per_tok = evaluate()
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:5.0f} s  "
                  f"exact by length {exact}  per answer token {per_tok}", flush=True)


if __name__ == "__main__":
    main()
