"""``python -m easy_context check --matrix`` (#32): refusals planned before any rank starts, a slice of the matrix run
in one spawn (every measured cell within 1e-5), the markdown and CSV it writes, and a failing cell reported."""
from __future__ import annotations

import csv
import os

import pytest

from easy_context.tools.check import matrix


def test_known_wrong_combinations_are_refused_at_planning():
    def refused(family, mode, feature):
        with pytest.raises(matrix.Refused) as e:
            matrix.plan_cell(family, mode, feature, world=4)
        return str(e.value)
    assert "no sliding-window attention" in refused("llama", "zigzag_ring_attn", "window")
    assert "no router" in refused("qwen3", "ulysses_attn", "moe_aux")
    assert "'dynamic' rescales by the longest position" in refused("llama", "usp_attn", "rope_dynamic")
    assert "RoPE per layer type" in refused("gemma3", "zigzag_ring_attn", "rope_yarn")
    case = matrix.plan_cell("qwen2", "usp_attn", "window", world=4)  # the window takes effect: it is run
    assert case.ring == 2 and case.config.sliding_window == matrix.WINDOW and case.seq_len == matrix.SEQ_LEN
    assert matrix.plan_cell("mixtral", "ulysses_attn", "moe_aux", world=4).moe_aux == 1.0
    assert "Phi3Attention" in refused("phi3", "zigzag_ring_attn", "heads")
    assert matrix.plan_cell("qwen3", "usp_attn", "heads", world=4).head_chunks == 2


def test_a_cell_beyond_tolerance_is_a_failure():
    d = {"rel": 2e-3, "max_abs": 1.0}
    got = matrix.measure({"error": None, "results": [{"logits": d, "loss": {"rel": 0.0}, "grads": {"w": d}}]})
    assert got["status"] == "measured" and got["max_rel"] == 2e-3
    assert matrix.measure({"error": (1, "Traceback\nValueError: boom"), "results": []})["detail"] == \
        "rank 1: ValueError: boom"
    rows = [{"feature": "base", "family": "llama", "mode": "ulysses_attn", **got, "status": "FAIL"}]
    assert "**FAIL 2.0e-03**" in matrix.to_markdown(rows, 2, 1e-5, 1.0, "cmd")


def test_matrix_slice_on_two_ranks(tmp_path, capsys):
    from easy_context.tools.check import main
    out = str(tmp_path / "pm")
    code = main(["--matrix", "--world", "2", "--families", "llama,mixtral", "--modes", "zigzag_ring_attn,ulysses_attn",
                 "--features", "packed,window,lora,moe_aux,rope_dynamic", "--out", out])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = list(csv.DictReader(open(out + ".csv")))
    assert len(rows) == 2 * 2 * 5
    status = {(r["family"], r["mode"], r["feature"]): r for r in rows}
    ran = [r for r in rows if r["status"] != "refused"]
    assert len(ran) == 12 and all(r["status"] == "pass" and float(r["max_rel"]) <= 1e-5 for r in ran), ran
    assert status[("llama", "ulysses_attn", "window")]["status"] == "refused"
    assert status[("mixtral", "zigzag_ring_attn", "moe_aux")]["status"] == "pass"
    assert all(status[(f, m, "rope_dynamic")]["status"] == "refused" for f in ("llama", "mixtral")
               for m in ("zigzag_ring_attn", "ulysses_attn"))
    md = open(out + ".md").read()
    assert "## moe_aux:" in md and "| mixtral |" in md and "## Refusals" in md and "refused [r" in md
    assert "12 pass, 0 fail, 0 errors, 8 refused" in md and os.path.exists(out + ".md")
