"""eval_ruler.py and easy_context/ruler: every task's generator + scorer on known answers, exact lengths,
seeded determinism, --chat-template (both evals), and 2 gloo ranks == 1 process end to end.
"""
from __future__ import annotations

import csv
import os
import sys

import pytest

from tests.test_evals import _torchrun, build_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import eval_ruler  # noqa: E402

from easy_context.ruler import TASKS, RulerBuilder, score_sample, string_match_all  # noqa: E402

CHAT = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(str(tmp_path_factory.mktemp("tiny_ruler") / "model"))


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def builder(tok):
    from easy_context.haystack import read_haystack
    return RulerBuilder(tok, read_haystack(None), 1500)


def test_scoring_is_rulers_string_match_recall():
    assert score_sample("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert score_sample("just 456\x01", ["123", "456"]) == 0.5
    assert score_sample("ABCDE abcde", ["abcde"]) == 1.0  # case-insensitive
    assert score_sample("nothing", ["123"]) == 0.0
    assert string_match_all(["123", "x"], [["123"], ["123"]]) == 0.5
    with pytest.raises(ValueError):
        score_sample("x", [])


@pytest.mark.parametrize("task", TASKS)
def test_every_task_exact_length_known_answers_and_seeded(builder, tok, task):
    for length in (700, 1500):
        s = builder.build(task, length, index=0, seed=3)
        assert len(s.input_ids) <= length
        if task.startswith("niah") or task == "vt":
            assert len(s.input_ids) == length  # filler is cut token-exact
        else:
            assert len(s.input_ids) >= length - 40  # the longest word list that fits
        text = tok.decode(s.input_ids, skip_special_tokens=True)
        assert all(a in text for a in s.answers)  # every expected answer is in the context
        assert s.answers and s.max_new_tokens > 0
        # a perfect "model" scores 1, a wrong one 0; niah_single is 1/0
        assert score_sample(" " + ", ".join(s.answers) + ".", s.answers) == 1.0
        assert score_sample("I do not know 0000000 QQQQQ.", s.answers) == 0.0
        if len(s.answers) > 1:
            assert 0 < score_sample(s.answers[0], s.answers) < 1
        else:
            assert task == "niah_single" or task == "niah_multikey"
        # seeded: same (seed, task, length, sample) -> same prompt; another sample -> another prompt
        again = builder.build(task, length, index=0, seed=3)
        assert again.input_ids == s.input_ids and again.answers == s.answers
        assert builder.build(task, length, index=1, seed=3).input_ids != s.input_ids
    # the task's own structure
    s = builder.build(task, 1500, index=0, seed=3)
    text = tok.decode(s.input_ids, skip_special_tokens=True)
    expect = {"niah_single": 1, "niah_multikey": 1, "niah_multivalue": 4, "niah_multiquery": 4, "vt": 5, "cwe": 10,
              "fwe": 3}[task]
    assert len(s.answers) == expect == len(set(s.answers))
    if task.startswith("niah"):
        assert text.count("One of the special magic numbers for") == (1 if task == "niah_single" else 4)
    if task == "vt":
        assert text.count(f"= {s.info['value']}.") == 1 and text.count("VAR ") == 1 + 2 * 4  # value + 4 hops
    if task == "cwe":
        words = [w for w in text.split() if w.isalpha() and len(w) == 6 and w.islower()]
        from collections import Counter
        top = [w for w, _ in Counter(words).most_common(10)]
        assert set(top) == set(s.answers)
    if task == "fwe":
        from collections import Counter
        ctx = text.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
        top = [w for w, _ in Counter(ctx).most_common(4)]
        assert top[0] == "..." and set(top[1:]) == set(s.answers)


def test_too_short_is_a_clear_error(builder):
    with pytest.raises(ValueError, match="cannot hold the task"):
        builder.build("niah_multiquery", 100)
    with pytest.raises(ValueError, match="unknown RULER task"):
        builder.build("qa_1", 1000)


def test_chat_template_wrap_and_clear_error(tok, tmp_path):
    from easy_context.evals import ChatWrap
    from easy_context.haystack import read_haystack
    with pytest.raises(ValueError, match="has no chat template"):
        ChatWrap(tok)
    tok.chat_template = CHAT
    try:
        w = ChatWrap(tok)
        b = RulerBuilder(tok, read_haystack(None), 800, wrap=w)
        s = b.build("niah_single", 800, seed=1)
        assert len(s.input_ids) == 800
        text = tok.decode(s.input_ids)
        assert text.startswith("<s>user\nSome special magic numbers")
        assert "?</s><s>assistant\n The special magic numbers for" in text  # answer prefix after the template
        assert text.count("<s>") == 2  # the tokenizer's BOS was replaced by the template's
    finally:
        tok.chat_template = None


def _ruler_args(tiny, out, *extra):
    return ["--model", tiny, "--min_context_length", "600", "--max_context_length", "800", "--context_interval",
            "200", "--num_samples", "1", "--max_new_tokens", "6", "--output-dir", str(out), *extra]


def test_eval_ruler_2_ranks_equal_one_process_and_chat_flags(tiny, tmp_path, capsys):
    import shutil

    # one process, in-process: every task at two lengths
    one = eval_ruler.main(_ruler_args(tiny, tmp_path / "one", "--parallel_mode", "zigzag_ring_attn"))
    assert len(one) == len(TASKS) * 2
    printed = capsys.readouterr().out
    assert "niah_single" in printed and "average" in printed and "ruler_model.png" in printed
    # 2 gloo ranks under torchrun, zigzag ring attention: the same generations and scores
    _torchrun("eval_ruler.py", _ruler_args(tiny, tmp_path / "two", "--parallel_mode", "zigzag_ring_attn"))
    rows = list(csv.DictReader(open(tmp_path / "two" / "ruler_model.csv", encoding="utf-8", newline="")))
    assert [(r["task"], int(r["length"]), r["generated"], float(r["score"])) for r in rows] == \
        [(r["task"], r["length"], r["generated"], r["score"]) for r in one]
    assert all(int(r["prompt_tokens"]) <= int(r["length"]) for r in rows)
    assert os.path.getsize(tmp_path / "two" / "ruler_model.png") > 1000
    summary = open(tmp_path / "two" / "ruler_model_summary.txt").read()
    assert summary.splitlines()[0].split() == ["task", "600", "800", "avg"]
    assert not [f for f in os.listdir(tmp_path / "two") if f.endswith(".tmp")]  # atomic writes left no temp file

    # --chat-template: a clear error without a template, for both evals
    import eval_needle
    needle = ["--model", tiny, "--min_context_length", "100", "--max_context_length", "100", "--depth_interval", "1",
              "--num_samples", "1", "--rnd_number_digits", "3", "--max_new_tokens", "3", "--parallel_mode",
              "data_parallel", "--chat-template", "--output-dir", str(tmp_path / "n")]
    with pytest.raises(ValueError, match="has no chat template"):
        eval_needle.main(needle)
    with pytest.raises(ValueError, match="has no chat template"):
        eval_ruler.main(_ruler_args(tiny, tmp_path / "x", "--tasks", "niah_single", "--chat-template"))
    # with one: the prompt is wrapped (needle: whole prompt as the user message; ruler: + answer prefix)
    chat_model = tmp_path / "chat"
    shutil.copytree(tiny, chat_model)
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(chat_model)
    t.chat_template = CHAT
    t.save_pretrained(chat_model)
    rows = eval_needle.main([*needle[:1], str(chat_model), *needle[2:]])
    assert len(rows) == 2 and all(len(r["expected"]) == 3 for r in rows)
    rows = eval_ruler.main(_ruler_args(str(chat_model), tmp_path / "c", "--tasks", "niah_single", "vt",
                                       "--chat-template", "--parallel_mode", "data_parallel"))
    assert [r["task"] for r in rows] == ["niah_single", "niah_single", "vt", "vt"]
    assert all(r["prompt_tokens"] <= r["length"] for r in rows)
