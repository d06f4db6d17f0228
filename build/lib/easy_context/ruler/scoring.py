"""RULER's scoring: string match, recall over the expected answers.

RULER (``string_match_all``) scores a prediction by the fraction of reference strings that occur in it,
case-insensitively, after replacing control characters by newlines and stripping; a task's score is the
mean over samples (RULER prints it x100). One answer (niah_single) therefore scores 1 or 0. Same here;
``score_sample`` returns the per-sample fraction in [0, 1].
"""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's clean-up of a generation: control characters become newlines, outer whitespace goes."""
    return _CONTROL.sub("\n", pred.strip()).strip()


def score_sample(pred: str, answers: list[str]) -> float:
    """Fraction of ``answers`` found (case-insensitive substring) in ``pred``."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    p = postprocess(pred).lower()
    return sum(a.lower() in p for a in answers) / len(answers)


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """Mean of ``score_sample`` over samples, in [0, 1]."""
    if len(preds) != len(refs) or not preds:
        raise ValueError(f"need equally many predictions and references (got {len(preds)} and {len(refs)})")
    return sum(score_sample(p, r) for p, r in zip(preds, refs)) / len(preds)


__all__ = ["postprocess", "score_sample", "string_match_all"]
