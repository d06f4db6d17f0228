"""RULER-style synthetic long-context tasks (Hsieh et al. 2024), generated offline for any tokenizer.

``tasks``: prompt generators (seeded, exact token budgets); ``scoring``: RULER's string-match recall.
See ``tasks``'s docstring for how each task follows the paper and where it differs.
"""
from .scoring import score_sample, string_match_all
from .tasks import TASKS, RulerBuilder, RulerSample

__all__ = ["TASKS", "RulerBuilder", "RulerSample", "score_sample", "string_match_all"]
