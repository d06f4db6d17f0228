"""The retrieval curriculum never emits an eval's templates (issue #64).

Checked two ways on thousands of generated conversations: (1) exact template ids: no id the generator records is an
eval's (eval_needle's, RULER's, the held-out probes'), and every recorded id is one ``templates.template_ids()``
knows; (2) wording: no word 4-gram of any eval template's fixed text (placeholders cut out) occurs in the generated
conversations' non-haystack text (needles, questions, frames, replies) nor in the generator's own template strings.
The rows as tokenized and packed are checked in tests/test_retrieval_data.py.
"""
from __future__ import annotations

import random
import re

from easy_context import haystack
from easy_context.haystack import heldout
from easy_context.ruler import tasks as ruler
from easy_context_train.curriculum import chat, spec, templates

N = 4


def grams(text: str, n: int = N) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _pieces(text: str) -> list[str]:
    return [s for s in re.split(r"\{[a-z_]*\}", text) if s.strip()]


def eval_wording() -> dict[str, list[str]]:
    """Every eval template's fixed text, by the eval that owns it."""
    ruler_texts = [v for k, v in vars(ruler).items() if k.isupper() and isinstance(v, str)
                   and re.match(r"(NIAH|VT|CWE|FWE)_", k)]
    own = [haystack.NEEDLE.replace("{}", "{v}"), haystack.PREFIX, haystack.QUESTION_STR]
    return {"eval_needle": [p for t in own for p in _pieces(t)],
            "ruler": [p for t in ruler_texts for p in _pieces(t)],
            "heldout": [p for t in heldout.HELDOUT for p in heldout.fixed_wording(t)]}


def eval_ids() -> set[str]:
    return {t.id for t in heldout.HELDOUT} | {f"ruler/{t}" for t in ruler.TASKS} | {"eval_needle/own"}


def _text(s: spec.Spec) -> str:
    head, tail = spec.render(s, s.question.replace("{line}", "a quoted line of the haystack"))
    return "\n".join([head, tail, s.reply, s.lead] + s.inserts + [x for t in s.follow for x in t])


def test_generated_conversations_are_disjoint_from_every_eval():
    banned = {name: set().union(*(grams(p) for p in texts)) for name, texts in eval_wording().items()}
    assert all(banned.values()) and len(banned["ruler"]) > 30 and len(banned["heldout"]) > 30
    known, seen_ids, kinds = templates.template_ids(), set(), set()
    assert not known & eval_ids()
    rng = random.Random(2026)
    for _ in range(4000):
        s = spec.draw_spec(rng)
        kinds.add(s.kind)
        assert set(s.ids) <= known, set(s.ids) - known
        seen_ids |= set(s.ids)
        g = grams(_text(s))
        for name, b in banned.items():
            assert not g & b, (name, sorted(g & b)[:3], _text(s)[:300])
    assert kinds == set(spec.KIND_WEIGHTS)
    assert len(seen_ids) > 0.95 * len(known)  # the 4000 draws reach (almost) every template
    assert not seen_ids & eval_ids()
    for _ in range(500):  # the chat turns too
        for u, r in chat.conversation(rng):
            g = grams(u + "\n" + r)
            assert not any(g & b for b in banned.values()), (u, r)


def test_the_generators_template_strings_share_no_4gram_with_an_eval():
    mine = set().union(*(grams(p) for t in templates.all_wording() for p in _pieces(t)))
    for name, texts in eval_wording().items():
        theirs = set().union(*(grams(p) for p in texts))
        assert not mine & theirs, (name, sorted(mine & theirs)[:5])
    # the check can fail: eval_needle's question wording is caught
    own = set().union(*(grams(p) for p in eval_wording()["eval_needle"]))
    assert grams("What is the special magic Oslo number?") & own
