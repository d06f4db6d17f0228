"""Chat-formatted retrieval conversations over a real haystack, packed into training rows (issue #48).

    python -m easy_context retrieval-data --tokenizer MODEL --haystack DIR/train.jsonl --seq-length 65536 \
        --rows 120 --output data/retrieval_65536

Why: a small instruct model fine-tuned only on raw long text keeps its perplexity but loses the habit of answering
a question about a long prompt (SmolLM2-135M after 12M tokens of CPython sources: needle 0.00 at every length, the
reply empty or continuing the haystack). A short last stage on these rows teaches it back, at every length up to
the new one. Each conversation is what eval_needle.py --chat-template asks, with other texts and other numbers:

    user:      PREFIX + haystack with 1-4 needles "The special magic {city} number is: {n}." + a question on one
    assistant: "The special magic {city} number is: {n}."
    (then one follow-up user/assistant turn per other needle: "What is the special magic {city} number?")

* haystack: slices at random offsets of the given jsonl documents (the training split: CPython's sources) or, for a
  ``--prose-share`` of the conversations, of generated prose (``haystack.filler_text``); never eval_needle's
  haystack (the held-out ``pydoc_data`` topics). Needles go after a token that ends a line or a sentence.
* cities: 40 (Singapore, which eval_needle asks for, among them), numbers of 5-9 digits, the question in one of
  three wordings (eval_needle's own, with the city changed, one of them).
* rows: ``seq_length + 1`` tokens, 1-4 conversations each (lengths from a random split of the row: every length
  from ``--min-length`` to the whole row), positions restarting per conversation, the rest a pad document.
  Labels only on the assistant replies and their end-of-turn token (the rows' token-mean loss is the answers').
* the chat markup is the tokenizer's template rendered around placeholder contents and tokenized on its own, the
  way ``evals.ChatWrap`` builds eval_needle's prompts, so training and eval see the same token boundaries.
"""
from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import random
import sys

from easy_context.haystack import PREFIX, ending_ids, filler_text, random_number
from easy_context.loss import IGNORE_INDEX

PROG = "python -m easy_context retrieval-data"
CITIES = ("Singapore", "Oslo", "Lima", "Cairo", "Madrid", "Dublin", "Seoul", "Quito", "Vienna", "Nairobi",
          "New York", "London", "Paris", "Tokyo", "Beijing", "Berlin", "Sydney", "Toronto", "Mumbai", "Lagos",
          "Prague", "Lisbon", "Athens", "Havana", "Manila", "Hanoi", "Santiago", "Bogota", "Warsaw", "Helsinki",
          "Montreal", "Chicago", "Denver", "Kyoto", "Osaka", "Dakar", "Tunis", "Riga", "Zagreb", "Bern")
NEEDLE = "\nThe special magic {city} number is: {n}.\n"
ANSWER = "The special magic {city} number is: {n}."
QUESTIONS = (  # the first turn's question, after the haystack (eval_needle's QUESTION_STR first, city changed)
    "</book>.\n Based on the content of the book, Question: What is the special magic {city} number? Answer: "
    "The special magic {city} number is:",
    "</book>.\n Question: What is the special magic number for {city} mentioned in the book?",
    "</book>.\nWhat is the special magic {city} number?",
)
FOLLOW_UP = "What is the special magic {city} number?"
_S = "\uE000S{}\uE000"  # placeholder contents (private-use characters: never in a real template)


class ChatMarkup:
    """The template's markup as ids around user / assistant turns, rendered once with placeholder contents."""

    def __init__(self, tok):
        if not getattr(tok, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: retrieval-data needs an instruct model's tokenizer")
        msgs = [{"role": "user", "content": _S.format(0)}, {"role": "assistant", "content": _S.format(1)},
                {"role": "user", "content": _S.format(2)}, {"role": "assistant", "content": _S.format(3)}]
        text = tok.apply_chat_template(msgs, tokenize=False)
        parts, rest = [], text
        for i in range(4):
            if rest.count(_S.format(i)) != 1:
                raise ValueError("the chat template does not render message contents verbatim")
            head, rest = rest.split(_S.format(i))
            parts.append(head)
        ids = lambda s: list(tok(s, add_special_tokens=False)["input_ids"]) if s else []  # noqa: E731
        # head: (system +) user start; to_assistant: user end + assistant start; to_user: assistant end + user start
        self.head, self.to_assistant, self.to_user, self.end = ids(parts[0]), ids(parts[1]), ids(parts[2]), ids(rest)
        if parts[3] != parts[1]:
            raise ValueError("the chat template renders the second user turn's end unlike the first")
        self.eot = self.end[:1]  # the end-of-turn token the model must learn to emit (trained after each reply)
        if self.to_user[:1] != self.eot:
            raise ValueError("the chat template ends an assistant turn differently before a user turn")


_W: dict = {}  # per worker: tokenizer, markup, haystack streams (set by _init; fork keeps the parent's copy)


def _ids(text: str) -> list[int]:
    return list(_W["tok"](text, add_special_tokens=False)["input_ids"])


def _stream(texts, limit: int, tok) -> tuple[list[int], list[int]]:
    """Token ids of the texts joined by blank lines (up to ``limit``) and the positions after a line/sentence end."""
    ids: list[int] = []
    for t in texts:
        ids += list(tok(t + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= limit:
            break
    ends = ending_ids(tok, ids, ("\n", ".", "!", "?"), strip=" \t")
    return ids, [j + 1 for j, t in enumerate(ids) if t in ends]


def _init(tok_path: str, streams) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_path)
    _W.update(tok=tok, markup=ChatMarkup(tok), streams=streams)
    _W["prefix"] = _ids(PREFIX)


def _conversation(rng: random.Random, budget: int, prose_share: float) -> tuple[list[int], list[int]] | None:
    """(input_ids, labels) of one conversation of exactly ``budget`` tokens, or None if it cannot fit."""
    m = _W["markup"]
    n_needles = rng.choice((1, 1, 2, 2, 3, 4))
    cities = rng.sample(CITIES, n_needles)
    nums = [random_number(rng, rng.randint(5, 9)) for _ in cities]
    needles = [_ids(NEEDLE.format(city=c, n=n)) for c, n in zip(cities, nums)]
    answers = [_ids(ANSWER.format(city=c, n=n)) + m.eot for c, n in zip(cities, nums)]
    question = _ids(rng.choice(QUESTIONS).format(city=cities[0]))
    follow = [m.to_user[len(m.eot):] + _ids(FOLLOW_UP.format(city=c)) + m.to_assistant for c in cities[1:]]
    fixed = (len(m.head) + len(_W["prefix"]) + sum(map(len, needles)) + len(question) + len(m.to_assistant)
             + sum(map(len, answers)) + sum(map(len, follow)) + len(m.end) - len(m.eot))
    n_hay = budget - fixed
    if n_hay < 16:
        return None
    ids, ends = _W["streams"][1 if rng.random() < prose_share else 0]
    if n_hay > len(ids):
        raise ValueError(f"the haystack holds {len(ids)} tokens, fewer than one conversation needs ({n_hay})")
    start = rng.randrange(len(ids) - n_hay + 1)
    hay = ids[start:start + n_hay]
    cuts = [_needle_at(rng, ends, start, n_hay) for _ in needles]
    body, prev = [], 0
    for cut, needle in sorted(zip(cuts, needles), key=lambda x: x[0]):
        body += hay[prev:cut] + needle
        prev = cut
    body += hay[prev:]
    inp = m.head + _W["prefix"] + body + question + m.to_assistant
    lab = [IGNORE_INDEX] * len(inp)
    for i, ans in enumerate(answers):
        inp, lab = inp + ans, lab + ans
        if i + 1 < len(answers):
            inp, lab = inp + follow[i], lab + [IGNORE_INDEX] * len(follow[i])
    inp, lab = inp + m.end[len(m.eot):], lab + [IGNORE_INDEX] * (len(m.end) - len(m.eot))
    assert len(inp) == budget, (len(inp), budget)
    return inp, lab


def _needle_at(rng: random.Random, ends: list[int], start: int, n: int) -> int:
    """A random depth in the slice [start, start + n), moved to the next line / sentence end inside it."""
    k = bisect.bisect_left(ends, start + rng.randrange(n + 1))
    return ends[k] - start if k < len(ends) and ends[k] - start <= n else rng.randrange(n + 1)


def _row(job) -> dict:
    seed, row, row_len, min_len, prose_share, pad = job
    rng = random.Random(seed * 1_000_003 + row)
    k = rng.choices((1, 2, 3, 4), weights=(35, 30, 20, 15))[0]
    k = max(1, min(k, row_len // min_len))
    free = row_len - k * min_len  # split at random over the k conversations, each min_len + its share
    cuts = sorted(rng.randint(0, free) for _ in range(k - 1))
    spans = [b - a for a, b in zip([0] + cuts, cuts + [free])]
    ids, labels, pos = [], [], []
    for span in spans:
        conv = _conversation(rng, span + min_len, prose_share)
        if conv is None:
            continue
        ids += conv[0]
        labels += conv[1]
        pos += range(len(conv[0]))
    fill = row_len - len(ids)
    return {"input_ids": ids + [pad] * fill, "labels": labels + [IGNORE_INDEX] * fill,
            "position_ids": pos + list(range(fill))}


def build_rows(tok_path: str, haystack_jsonl: list[str], seq_length: int, rows: int, seed: int = 0,
               prose_share: float = 0.3, min_length: int = 512, workers: int = 1) -> list[dict]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_path)
    ChatMarkup(tok)  # fail here, not in a worker
    texts = []
    for path in haystack_jsonl:
        with open(path, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    random.Random(seed).shuffle(texts)
    limit = max(4 * (seq_length + 1), 1 << 21)  # enough distinct text that rows rarely repeat a slice
    streams = (_stream(texts, limit, tok), _stream([filler_text(20_000, seed)], limit, tok))
    row_len = seq_length + 1
    if min_length > row_len:
        raise ValueError(f"--min-length {min_length} exceeds a row of {row_len} tokens")
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    jobs = [(seed, r, row_len, min_length, prose_share, pad) for r in range(rows)]
    if workers > 1:
        with mp.get_context("fork").Pool(workers, _init, (tok_path, streams)) as pool:
            return pool.map(_row, jobs, chunksize=max(1, rows // (4 * workers)))
    _init(tok_path, streams)
    return [_row(j) for j in jobs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="the instruct model's directory (its chat template)")
    p.add_argument("--haystack", required=True, nargs="+", help="jsonl files with a 'text' column (training split)")
    p.add_argument("--seq-length", type=int, required=True, help="rows hold seq_length + 1 tokens")
    p.add_argument("--rows", type=int, required=True, help="rows to write")
    p.add_argument("--output", required=True, help="dataset directory (written to a temp name, then renamed)")
    p.add_argument("--prose-share", type=float, default=0.3, help="conversations over generated prose (default 0.3)")
    p.add_argument("--min-length", type=int, default=512, help="shortest conversation in tokens (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, min(16, (mp.cpu_count() or 2) - 1)))
    p.add_argument("--overwrite", action="store_true", help="replace --output if it holds a dataset this tool wrote")
    a = p.parse_args(argv)
    from .data import check_output_dataset
    from .errors import UsageError
    from .packed_data import save_rows
    try:
        if a.seq_length < 1 or a.rows < 1 or not 0 <= a.prose_share <= 1:
            raise UsageError("--seq-length and --rows must be >= 1 and --prose-share in [0, 1]")
        check_output_dataset(a.output, a.overwrite, inputs=tuple(a.haystack) + (a.tokenizer,))
        rows = build_rows(a.tokenizer, a.haystack, a.seq_length, a.rows, a.seed, a.prose_share, a.min_length,
                          a.workers)
        save_rows(rows, a.output)
    except (UsageError, ValueError, OSError) as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    trained = sum(sum(t != IGNORE_INDEX for t in r["labels"]) for r in rows)
    convs = sum(sum(1 for q in r["position_ids"][1:] if q == 0) + 1 for r in rows)
    print(f"wrote {len(rows)} rows of {a.seq_length + 1} tokens ({convs} documents incl. pads; {trained} trained "
          f"answer tokens) to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
