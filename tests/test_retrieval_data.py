"""`python -m easy_context retrieval-data`: chat-formatted needle retrieval rows (the real-model recipe's stage 4).

A toy byte-level tokenizer with a chat template stands in for the real model's (tests/test_real_model.py has the real
one). Checked on the rows as written: length, restarting positions, labels exactly on the replies (each reply names a
needle that sits in its own conversation's haystack, with that needle's number), the first question asks for a
needle of the conversation, and a fixed seed gives the same rows.
"""
from __future__ import annotations

import json
import re

import pytest

from easy_context.__main__ import main as cli
from easy_context.haystack import filler_text
from easy_context.loss import IGNORE_INDEX
from easy_context_train.toy import build_tokenizer

SEQ = 1024


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ret")
    docs = [filler_text(60, seed=s).replace(".", ".\n", 3) + f"\ndef f{s}(x):\n    return x + {s}\n" for s in range(30)]
    with open(d / "train.jsonl", "w") as f:
        for i, t in enumerate(docs):
            f.write(json.dumps({"name": f"doc{i}", "text": t}) + "\n")
    tok = build_tokenizer(docs + ["The special magic Singapore number is: 0123456789."], str(d / "tok"), 512)
    return d, tok


def _write(d, out, seed, rows=6):
    return cli(["retrieval-data", "--tokenizer", str(d / "tok"), "--haystack", str(d / "train.jsonl"),
                "--seq-length", str(SEQ), "--rows", str(rows), "--output", str(d / out), "--seed", str(seed),
                "--min-length", "200", "--workers", "1"])


def _segments(ids, labels):
    """(start, end) of each run of trained labels."""
    spans, start = [], None
    for i, lab in enumerate(labels + [IGNORE_INDEX]):
        if lab != IGNORE_INDEX and start is None:
            start = i
        elif lab == IGNORE_INDEX and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_rows_are_retrieval_conversations(setup):
    import datasets
    d, tok = setup
    assert _write(d, "a", seed=3) == 0
    ds = datasets.load_from_disk(str(d / "a"))
    assert len(ds) == 6 and set(ds.column_names) == {"input_ids", "labels", "position_ids"}
    n_conv = n_replies = 0
    for r in ds:
        ids, labels, pos = r["input_ids"], r["labels"], r["position_ids"]
        assert len(ids) == len(labels) == len(pos) == SEQ + 1
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        assert starts[0] == 0
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b] == list(range(b - a))  # one document each
            text = tok.decode(ids[a:b])
            if "special magic" not in text:  # the pad document of a row's tail
                assert all(x == IGNORE_INDEX for x in labels[a:b])
                continue
            n_conv += 1
            needles = dict(re.findall(r"\nThe special magic ([A-Za-z ]+) number is: (\d+)\.\n", text))
            assert 1 <= len(needles) <= 4
            asked = re.search(r"What is the special magic (?:number for )?([A-Za-z ]+?) (?:number|mentioned)", text)
            assert asked and asked.group(1) in needles
            replies = [tok.decode(ids[a + s:a + e]) for s, e in _segments(ids[a:b], labels[a:b])]
            assert len(replies) == len(needles)
            seen = set()
            for rep in replies:
                m = re.fullmatch(r"The special magic ([A-Za-z ]+) number is: (\d+)\.</s>", rep)
                assert m and needles.get(m.group(1)) == m.group(2), rep
                seen.add(m.group(1))
                n_replies += 1
            assert seen == set(needles)  # every needle asked once, the first one in the first turn
            assert replies[0].startswith(f"The special magic {asked.group(1)} ")
    assert n_conv >= 6 and n_replies > n_conv


def test_seeded_and_refuses_bad_input(setup, capsys):
    import datasets
    d, _ = setup
    assert _write(d, "b", seed=3) == 0
    assert datasets.load_from_disk(str(d / "a"))[:] == datasets.load_from_disk(str(d / "b"))[:]
    assert _write(d, "b", seed=3) == 2  # an existing output is not replaced without --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli(["retrieval-data", "--tokenizer", str(d / "tok"), "--haystack", str(d / "train.jsonl"),
                "--seq-length", "100", "--rows", "1", "--output", str(d / "c"), "--min-length", "500"]) == 2
    assert "--min-length" in capsys.readouterr().err
