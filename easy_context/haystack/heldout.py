"""Held-out probes: needle kinds, wordings and frames no training generator emits (issue #64; eval_needle --templates).

tests/test_curriculum.py checks that the curriculum never emits these template ids nor a word 4-gram of their fixed
wording (``fixed_wording``), nor eval_needle's or RULER's. Kinds (``length`` = haystack tokens, as in own mode):
  frame     eval_needle's own needle, asked in another prompt frame
  word      a one-word secret ("the secret word for the otter gate")
  passkey   a 5-digit pass key, asked "What is the pass key?"
  distract  eval_needle's needle form with 2 distractor needles (other cities), asked in another wording;
            an answer that also names a distractor's number is wrong
  kv        an inventory record: item -> bin code
  code      a constant assignment inside code (the code haystack), asked by the constant's name
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from . import DISTRACTOR_CITIES, NEEDLE, random_number


@dataclass(frozen=True)
class ProbeTemplate:
    id: str
    kind: str
    head: str        # before the haystack
    needle: str      # inserted at the depth ({key}, {value})
    question: str    # after the haystack ({key})
    haystack: str = "prose"
    distractors: int = 0


HELDOUT = (
    ProbeTemplate("heldout/frame/0", "frame", "Below is a long document. Read it carefully; a question follows it.\n"
                  "=== DOCUMENT ===\n", NEEDLE.replace("Singapore", "{key}").replace("{}", "{value}"),
                  "\n=== END ===\nWhat is the special magic {key} number? Reply with the number only."),
    ProbeTemplate("heldout/word/0", "word", "Answer from the text that follows.\n\n",
                  "\nThe secret word for the {key} gate is \"{value}\".\n",
                  "\n\nWhat is the secret word for the {key} gate?"),
    ProbeTemplate("heldout/passkey/0", "passkey", "There is an important piece of information hidden inside a lot of "
                  "irrelevant text. Find it and memorize it.\n\n",
                  "\nThe pass key is {value}. Remember it. {value} is the pass key.\n", "\n\nWhat is the pass key?"),
    ProbeTemplate("heldout/distract/0", "distract", "Study this book closely.\n\n",
                  NEEDLE.replace("Singapore", "{key}").replace("{}", "{value}"),
                  "\n\nTell me which special magic number belongs to {key}.", distractors=2),
    ProbeTemplate("heldout/kv/0", "kv", "Warehouse log follows.\n\n",
                  "\nInventory note: item {key} is stored in bin {value}.\n", "\n\nWhich bin holds item {key}?"),
    ProbeTemplate("heldout/code/0", "code", "# Source listing\n\n", "\n{key} = {value}  # fixed at build time\n",
                  "\n\nIn the code above, which value is assigned to {key}?", haystack="code"),
)
KINDS = tuple(t.kind for t in HELDOUT)
BY_KIND = {t.kind: t for t in HELDOUT}
GATES = ("otter", "heron", "badger", "lynx", "marten", "puffin", "walrus", "ibis", "gecko", "tapir")
SECRETS = ("lantern", "saffron", "quartz", "juniper", "tundra", "velvet", "cobalt", "meridian", "thistle", "ember")
CONSTANTS = ("SESSION_SALT", "RETRY_SEED", "BUILD_TAG", "CACHE_EPOCH", "SHARD_MAGIC", "LEDGER_OFFSET")


def draw(kind: str, rng: random.Random) -> tuple[str, str, list[tuple[str, str]]]:
    """(key, value, distractors) of one prompt of ``kind``, drawn from ``rng``."""
    t = BY_KIND[kind]
    if kind in ("frame", "distract"):
        keys = rng.sample(("Singapore",) + DISTRACTOR_CITIES, 1 + t.distractors)
        vals = [random_number(rng, 7) for _ in keys]
        return keys[0], vals[0], list(zip(keys[1:], vals[1:]))
    if kind == "word":
        return rng.choice(GATES), rng.choice(SECRETS), []
    if kind == "passkey":
        return "", random_number(rng, 5), []
    if kind == "kv":
        return f"{rng.choice('ABCDEFGH')}-{random_number(rng, 3)}", f"Z{random_number(rng, 4)}", []
    return rng.choice(CONSTANTS), random_number(rng, 6), []


def code_filler_text(functions: int = 400, seed: int = 0) -> str:
    """Deterministic Python-like code (no needle wording): the code haystack when none is given."""
    rng = random.Random(seed)
    names = ("total", "count", "items", "buffer", "offset", "index", "value", "result", "limit", "chunk")
    out = []
    for i in range(functions):
        a, b, c = rng.sample(names, 3)
        out.append(f"def step_{i}({a}, {b}):\n    \"\"\"Combine {a} with {b}.\"\"\"\n    {c} = {a} + {b} * {i % 7}\n"
                   f"    if {c} > {rng.randint(10, 999)}:\n        return {c} - {b}\n    return {c}\n")
    return "\n\n".join(out) + "\n"


def fixed_wording(t: ProbeTemplate) -> list[str]:
    """The template's literal text without its placeholders (for the curriculum's n-gram disjointness test)."""
    import re
    return [s for part in (t.head, t.needle, t.question) for s in re.split(r"\{[a-z_]*\}", part) if s.strip()]


@dataclass
class HeldoutPrompt:
    input_ids: list[int]    # content ids (no chat markup, no BOS)
    expected: str
    wrong: list[str]        # distractor values: naming one makes the answer wrong
    template_id: str


class HeldoutProbes:
    """Builds held-out probe prompts over a prose and a code haystack, each tokenized once."""

    def __init__(self, tok, prose_text: str, code_text: str | None, max_length: int):
        from . import NeedleHaystack
        self.tok = tok
        self.prose = NeedleHaystack(tok, prose_text, max_length)
        self.code = NeedleHaystack(tok, code_text or code_filler_text(), max_length, ends=("\n",))

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def build(self, kind: str, length: int, depth: float, key: str, value: str, distractors=(),
              rng: random.Random | None = None) -> HeldoutPrompt:
        if kind not in BY_KIND:
            raise ValueError(f"unknown held-out probe kind {kind!r}; choose from {', '.join(KINDS)}")
        t, rng = BY_KIND[kind], rng or random.Random(0)
        s = self.code if t.haystack == "code" else self.prose
        if length > len(s.ids):
            raise ValueError(f"context length {length} exceeds the prepared haystack ({len(s.ids)})")
        hay = s.ids[:length]
        pos = 0 if depth <= 0 else s._snap(int(length * depth), length)
        inserts = [(pos, 0, self._ids(t.needle.format(key=key, value=value)))]
        inserts += [(s._snap(rng.randrange(length + 1), length), i + 1, self._ids(t.needle.format(key=k, value=v)))
                    for i, (k, v) in enumerate(distractors)]
        body, prev = [], 0
        for p, _, ids in sorted(inserts, key=lambda x: (x[0], x[1])):
            body += hay[prev:p] + ids
            prev = p
        body += hay[prev:]
        ids = self._ids(t.head) + body + self._ids(t.question.format(key=key))
        return HeldoutPrompt(ids, value, [v for _, v in distractors], t.id)


def correct(text: str, p: HeldoutPrompt) -> bool:
    """The expected value is named and no distractor's value is."""
    return p.expected in text and not any(w in text for w in p.wrong)


__all__ = ["HELDOUT", "KINDS", "ProbeTemplate", "HeldoutProbes", "HeldoutPrompt", "draw", "correct",
           "code_filler_text", "fixed_wording"]
