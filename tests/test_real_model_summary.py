"""easy_context_train/real_model/summary.py: the one before/after table, the goals as measured, the heatmaps.

Run directories are written here by hand in the evals' formats (eval_needle --templates both, eval_ruler, eval_ppl
--truncate); the numbers in the report must be the means of those rows.
"""
from __future__ import annotations

import csv
import json
import math
import os

from easy_context_train.real_model import summary


def _run(d, own, held, ruler, ppl):
    os.makedirs(d / "needle_own")  # own format: eval_needle's plain CSV in a folder, as bench/real_model_gpu.sh does
    with open(d / "needle_own" / "needle_m.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["length", "depth", "sample", "expected", "generated", "correct"])
        for L, depth, ok in own:
            w.writerow([L, depth, 0, "1", "x", ok])
    with open(d / "needle_m.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["length", "depth", "sample", "expected", "generated", "correct", "templates", "kind",
                    "template_id"])
        for kind, L, depth, ok in held:
            w.writerow([L, depth, 0, "1", "x", ok, "heldout", kind, f"heldout/{kind}/0"])
    with open(d / "ruler_m.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["task", "length", "sample", "score", "expected", "generated", "prompt_tokens"])
        for task, L, s in ruler:
            w.writerow([task, L, 0, s, "a", "b", L])
    with open(d / "ppl.csv", "w") as f:
        f.write("," + ",".join(str(L) for L in ppl) + "\nm," + ",".join(str(v) for v in ppl.values()) + "\n")
    json.dump({"path": str(d), "rope_theta": 5e6}, open(d / "model.json", "w"))


def test_report_table_goals_and_heatmaps(tmp_path):
    L1, L2 = 16384, 65536
    _run(tmp_path / "stage3", [(L1, 0.0, 0), (L2, 0.0, 0)], [("word", L1, 0.0, 0)], [("vt", L1, 0.0)],
         {1024: 8.0, L1: 5.0, L2: 4.9})
    _run(tmp_path / "after", [(L1, 0.0, 1), (L1, 1.0, 1), (L2, 0.0, 1), (L2, 1.0, 0)],
         [("word", L1, 0.0, 1), ("word", L2, 0.0, 1), ("code", L1, 0.0, 1), ("code", L2, 0.0, 0)],
         [("niah_single", L1, 1.0), ("niah_single", L2, 0.5), ("vt", L1, 0.6), ("vt", L2, 0.4)],
         {1024: 8.5, L1: 5.4, L2: 5.6})
    text = summary.report([("stage3", str(tmp_path / "stage3")), ("after", str(tmp_path / "after")),
                           ], str(tmp_path / "out"), "t")
    cells = {tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[3:-1]]
             for ln in text.splitlines() if ln.startswith("| ")}
    assert cells[("run", "probe")] == ["1K", "16K", "64K", "mean"]
    assert cells[("after", "needle own")] == ["", "1.00", "0.50", "0.75"]  # no needle at 1K
    assert cells[("after", "needle held-out (mean)")] == ["", "1.00", "0.50", "0.75"]  # word 1/1, code 1/0
    assert cells[("after", "RULER vt")] == ["", "0.60", "0.40", "0.50"]
    assert cells[("after", "perplexity")] == ["8.500", "5.400", "5.600", ""]
    by_pos = [float(x) for x in cells[("after", "loss by position (nats)")][:3]]
    assert by_pos[0] == round(math.log(8.5), 3)  # positions 0..1K: the 1K window's own mean
    want = (math.log(5.6) * (L2 - 1) - math.log(5.4) * (L1 - 1)) / (L2 - L1)
    assert abs(by_pos[2] - want) < 1e-3, (by_pos, want)
    goals = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if "(16K+)" in ln or "vs stage3" in ln}
    assert "0.75 | NOT met" in goals["needle own (16K+)"] and "0.50 | met" in goals["RULER vt (16K+)"]
    assert "not measured" in goals["RULER niah_multikey (16K+)"]
    assert "+14.3 %" in goals["perplexity at 64K vs stage3"] and "NOT met" in goals["perplexity at 64K vs stage3"]
    data = json.load(open(tmp_path / "out" / "summary.json"))
    assert data["after"]["probes"]["needle code"] == {str(L1): 1.0, str(L2): 0.0}
    assert os.path.getsize(tmp_path / "out" / "probes_after.png") > 1000
    lbp = summary.loss_by_position({1024: math.e, 2048: math.e})
    assert [round(x, 9) for _, _, x in lbp] == [1.0, 1.0]
