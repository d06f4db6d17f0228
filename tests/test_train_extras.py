"""train.py extras (#18, #19): held-out eval loss, RoPE scaling flags, LoRA; 2 ranks (zigzag) == 1 process.

Reuses tests/test_train.py's toy fixture and launcher; one launch pair covers eval + RoPE scaling.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.test_train import COMMON, STEPS, TOY, _ok, launch, metrics, toy  # noqa: F401 - fixture

EVAL_ROWS = 3


@pytest.fixture(scope="module")
def eval_data(toy):  # noqa: F811
    """Held-out rows with labels (some -100) and packed-document positions (a document starts mid-row)."""
    import datasets
    src = datasets.load_from_disk(toy["data"])
    n = len(src["input_ids"][0])
    rows = [{"input_ids": ids, "labels": [-100] * 7 + ids[7:], "position_ids": list(range(50)) + list(range(n - 50))}
            for ids in src["input_ids"][-EVAL_ROWS - 1:]]
    path = os.path.join(toy["base"], "eval_rows")
    datasets.Dataset.from_list(rows).save_to_disk(path)
    return path


def _train(nproc, out, mode, extra):
    return launch(nproc, ["--model", TOY["model"], "--dataset", TOY["data"], "--output-dir", str(out),
                          "--parallel_mode", mode, *COMMON, *extra])


def _close(a, b, tol=1e-4):
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


# ---------------------------------------------------------------- end to end
EVAL_FLAGS = ["--eval-every", "2", "--eval-rows", str(EVAL_ROWS)]


@pytest.mark.slow
def test_eval_loss_zigzag_equals_single_process(toy, eval_data, tmp_path):  # noqa: F811
    runs = {}
    for nproc, mode in ((1, "data_parallel"), (2, "zigzag_ring_attn")):
        out = tmp_path / f"{mode}"
        _ok(_train(nproc, out, mode, [*EVAL_FLAGS, "--eval-dataset", eval_data, "--no-save-model"]))
        runs[nproc] = metrics(out)
    one, two = runs[1], runs[2]
    evals = {n: {s: r["eval_loss"] for s, r in m.items() if "eval_loss" in r} for n, m in runs.items()}
    assert sorted(evals[1]) == sorted(evals[2]) == [2, 4, STEPS], evals  # every 2 steps and at the end
    assert _close([evals[1][s] for s in (2, 4, 5)], [evals[2][s] for s in (2, 4, 5)]), evals
    assert _close([one[s]["loss"] for s in sorted(one)], [two[s]["loss"] for s in sorted(two)])
    assert evals[2][STEPS] < evals[2][2]  # the toy corpus is learnable, held-out rows too
