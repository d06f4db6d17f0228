"""Needle-in-a-haystack prompts (EasyContext's texts) over any tokenizer.

* ``read_haystack(dir)``: every ``*.txt`` in ``dir`` in sorted order (EasyContext globbed unsorted), or,
  without a dir, ``filler_text()``: generated, license-free prose so the eval runs anywhere.
* ``NeedleHaystack``: tokenizes the haystack ONCE (EasyContext re-tokenized the growing string in a loop),
  tiles the ids to the longest context needed, finds sentence ends from the tokenizer's own decoded tokens
  (no hard-coded Llama-2 period ids) and builds ``prefix + haystack-with-needle + question`` as ids.
"""
from __future__ import annotations

import bisect
import glob
import os
import random
from dataclasses import dataclass, field

# EasyContext's exact texts (eval_needle.py).
NEEDLE = "\nThe special magic Singapore number is: {}.\n"
DISTRACTOR_CITIES = ("New York", "London", "Paris", "Tokyo", "Beijing", "Berlin")
DISTRACTORS = tuple(NEEDLE.replace("Singapore", c) for c in DISTRACTOR_CITIES)
PREFIX = "This is a very long story book: <book>"
QUESTION_STR = ("</book>.\n Based on the content of the book, Question: What is the special magic Singapore "
                "number? Answer: The special magic Singapore number is:")

_SUBJECTS = ("The old miller", "A quiet fisherman", "The young clerk", "Her grandmother", "The traveller",
             "A tired sailor", "The village teacher", "The blacksmith", "A curious child", "The night watchman")
_VERBS = ("walked slowly toward", "spoke at length about", "thought often of", "wrote a letter about",
          "remembered", "painted a picture of", "argued with a friend about", "dreamed of", "looked across",
          "sang a song about")
_OBJECTS = ("the river under the bridge", "the hills beyond the town", "the harvest of that year",
            "the lamp in the window", "the long road north", "the bells of the church", "the empty market",
            "the garden behind the house", "the storm of the previous night", "the ships in the harbour")
_TAILS = ("before the sun went down", "while the kettle boiled", "without saying a word", "as the wind rose",
          "for the first time in years", "when nobody was watching", "with great care", "in the early morning",
          "after supper", "under a grey sky")


def filler_text(sentences: int = 4000, seed: int = 0) -> str:
    """Deterministic prose of simple sentences (about 15 tokens each), grouped into paragraphs."""
    rng = random.Random(seed)
    out, para = [], []
    for i in range(sentences):
        para.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}.")
        if len(para) == 6 or i == sentences - 1:
            out.append(" ".join(para))
            para = []
    return "\n\n".join(out) + "\n\n"


def read_haystack(haystack_dir: str | None) -> str:
    """Concatenated ``*.txt`` files of ``haystack_dir`` in sorted order; the generated filler if None."""
    if haystack_dir is None:
        return filler_text()
    if not os.path.isdir(haystack_dir):
        raise FileNotFoundError(f"--haystack_dir {haystack_dir!r} is not a directory")
    files = sorted(glob.glob(os.path.join(haystack_dir, "*.txt")))
    if not files:
        raise FileNotFoundError(f"--haystack_dir {haystack_dir!r} contains no *.txt files")
    texts = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            texts.append(fh.read())
    return "\n\n".join(texts)


def ending_ids(tokenizer, ids, ends, strip: str | None = None) -> set[int]:
    """The distinct ids of ``ids`` whose decoded text ends in one of ``ends`` after ``str.rstrip(strip)``: found from
    the tokenizer itself (SentencePiece "▁.", byte-level ".", ".\n", ...), no hard-coded ids."""
    return {i for i in set(ids) if tokenizer.decode([i]).rstrip(strip).endswith(tuple(ends))}


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class NeedlePrompt:
    input_ids: list[int]          # full prompt (prefix with BOS if the tokenizer adds one, ..., question)
    answer_ids: list[int]         # the gold answer continuation, tokenized in context after the question
    number: str                   # the needle number
    needle_start: int             # index in input_ids where the needle's tokens start
    haystack_start: int           # index in input_ids where the haystack starts
    needle_haystack_pos: int      # insertion index inside the cut haystack (before distractors)
    context_length: int           # haystack tokens
    distractors: list = field(default_factory=list)  # (city, number) pairs


class NeedleHaystack:
    """Builds needle prompts from one tokenization of the haystack."""

    def __init__(self, tokenizer, text: str, max_context_length: int, ends=(".", "!", "?")):
        self.tok = tokenizer
        base = _ids(tokenizer, text)
        if not base:
            raise ValueError("the haystack text is empty")
        reps = -(-max_context_length // len(base))  # tile the ids instead of re-tokenizing longer strings
        self.ids = (base * max(1, reps))[:max(max_context_length, 1)]
        # Sentence ends from the tokenizer itself: any token whose text ends in . ! or ? (after stripping
        # whitespace) - works for SentencePiece ("▁."), byte-level BPE (".", ".\n") and the rest.
        ends = ending_ids(tokenizer, self.ids, ends)  # ("\n",): line ends (a code haystack)
        self.sentence_ends = [j + 1 for j, t in enumerate(self.ids) if t in ends]  # insert after the period
        enc = tokenizer(PREFIX)["input_ids"]  # keeps the BOS the tokenizer adds, like EasyContext
        self.prefix_ids = list(enc)
        self.question_ids = _ids(tokenizer, QUESTION_STR)

    def _snap(self, pos: int, length: int) -> int:
        """The first sentence end at or after ``pos`` inside the cut haystack, else ``pos``."""
        k = bisect.bisect_left(self.sentence_ends, pos)
        if k < len(self.sentence_ends) and self.sentence_ends[k] <= length:
            return self.sentence_ends[k]
        return pos

    def answer_ids(self, number: str) -> list[int]:
        """The answer as the tokenizer splits it right after the question (no Llama-3 space hack needed)."""
        q = self.question_ids
        both = _ids(self.tok, QUESTION_STR + " " + number)
        if both[:len(q)] == q and len(both) > len(q):
            return both[len(q):]
        return _ids(self.tok, " " + number)

    def build(self, context_length: int, depth: float, number: str, distractors=(),
              rng: random.Random | None = None) -> NeedlePrompt:
        """Prompt with ``number`` at ``depth`` (0 = start, 1 = end) of ``context_length`` haystack tokens.

        ``distractors``: (city, number) pairs, each inserted after the next sentence end following a
        random position (``rng``).
        """
        if context_length > len(self.ids):
            raise ValueError(f"context length {context_length} exceeds the prepared haystack ({len(self.ids)})")
        hay = self.ids[:context_length]
        pos = 0 if depth <= 0 else self._snap(int(context_length * depth), context_length)
        inserts = [(pos, 0, _ids(self.tok, NEEDLE.format(number)))]
        rng = rng or random.Random(0)
        for i, (city, num) in enumerate(distractors):
            p = self._snap(rng.randrange(context_length + 1), context_length)
            inserts.append((p, i + 1, _ids(self.tok, NEEDLE.replace("Singapore", city).format(num))))
        inserts.sort(key=lambda x: (x[0], x[1]))
        body, prev, needle_at = [], 0, -1
        for p, kind, ids in inserts:
            body += hay[prev:p]
            if kind == 0:
                needle_at = len(body)
            body += ids
            prev = p
        body += hay[prev:]
        start = len(self.prefix_ids)
        return NeedlePrompt(self.prefix_ids + body + self.question_ids, self.answer_ids(number), number,
                            start + needle_at, start, pos, context_length, list(distractors))


def random_number(rng: random.Random, digits: int) -> str:
    """A number with exactly ``digits`` digits (EasyContext's randint(10**d) could be shorter)."""
    if digits < 1:
        raise ValueError(f"--rnd_number_digits must be >= 1; got {digits}")
    return str(rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1))


__all__ = ["NEEDLE", "DISTRACTOR_CITIES", "DISTRACTORS", "PREFIX", "QUESTION_STR", "filler_text", "read_haystack",
           "NeedleHaystack", "NeedlePrompt", "random_number", "ending_ids"]
