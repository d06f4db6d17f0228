"""`python -m easy_context retrieval-data`: the retrieval curriculum as training rows (issue #64; #48's stage 4).

A toy byte-level tokenizer with a chat template stands in for the real model's (tests/test_real_model.py has the real
one). Checked on the rows as written: length, restarting positions, labels only on the replies (each reply's values
sit in its own conversation's context, a span reply is a line of it) and on the raw piece's tail, the stated loss
weighting (raw tail = ratio x replies in a mixed row), no eval wording in the decoded rows, and a fixed seed gives
the same rows. tests/test_curriculum.py checks the template disjointness on thousands of conversations.
"""
from __future__ import annotations

import json
import re

import pytest

from easy_context_train.__main__ import main as cli
from easy_context.haystack import filler_text
from easy_context.loss import IGNORE_INDEX
from easy_context_train.toy import build_tokenizer

SEQ = 2048


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ret")
    docs = [f'"""{filler_text(4, seed=s + 99)}"""\n' + filler_text(60, seed=s).replace(".", ".\n", 3)
            + f"\ndef f{s}(x):\n    return x + {s}\n" for s in range(30)]
    with open(d / "train.jsonl", "w") as f:
        for i, t in enumerate(docs):
            f.write(json.dumps({"name": f"doc{i}", "text": t}) + "\n")
    tok = build_tokenizer(docs + ["Remember this: Harlow account corresponds to 0123456789."], str(d / "tok"), 512)
    return d, tok


def _write(d, out, seed, rows=12, *extra):
    return cli(["retrieval-data", "--tokenizer", str(d / "tok"), "--haystack", str(d / "train.jsonl"),
                "--seq-length", str(SEQ), "--rows", str(rows), "--output", str(d / out), "--seed", str(seed),
                "--min-length", "300", "--workers", "1", *extra])


def _segments(labels):
    """(start, end) of each run of trained labels."""
    spans, start = [], None
    for i, lab in enumerate(labels + [IGNORE_INDEX]):
        if lab != IGNORE_INDEX and start is None:
            start = i
        elif lab == IGNORE_INDEX and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_rows_are_curriculum_conversations_with_the_stated_weighting(setup):
    import datasets

    from tests.test_curriculum import eval_wording, grams
    d, tok = setup
    assert _write(d, "a", 3) == 0
    ds = datasets.load_from_disk(str(d / "a"))
    assert len(ds) == 12 and set(ds.column_names) == {"input_ids", "labels", "position_ids"}
    banned = set().union(*(grams(p) for texts in eval_wording().values() for p in texts))
    n_conv = n_raw = n_span = 0
    for r in ds:
        ids, labels, pos = r["input_ids"], r["labels"], r["position_ids"]
        assert len(ids) == len(labels) == len(pos) == SEQ + 1
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        replies = raw = 0
        for a, b in zip(starts, starts[1:]):
            assert pos[a:b] == list(range(b - a))  # one document each
            text, segs = tok.decode(ids[a:b]), _segments(labels[a:b])
            if "<s>user" not in text:  # a raw-text piece (labels: a suffix of its own ids) or the pad
                assert len(segs) <= 1 and (not segs or segs[0][1] == b - a), segs
                assert all(labels[a + i] == ids[a + i] for s, e in segs for i in range(s, e))
                raw += sum(e - s for s, e in segs)
                n_raw += bool(segs)
                continue
            n_conv += b - a >= 300  # shorter: a generated chat conversation (no haystack)
            for s, e in segs:  # a reply: ends with the end-of-turn token; its values are in the context before it
                rep = tok.decode(ids[a + s:a + e])
                assert rep.endswith("</s>"), rep
                context = tok.decode(ids[a:a + s])
                for v in re.findall(r"\b(?=\w*\d)\w{3,}\b", rep[:-4]) if b - a >= 300 else ():
                    assert v in context, (v, rep)
                n_span += "line" in context.split("<s>assistant")[0][-300:] and rep[:-4].strip() in context
                replies += e - s
            assert not grams(text) & banned, sorted(grams(text) & banned)[:3]
        if raw:  # a mixed row: the raw tail is ratio (1.0) x the replies, unless the piece is shorter
            assert raw == replies or raw < replies, (raw, replies)
    assert n_conv >= 12 and n_raw >= 2 and n_span >= 1, (n_conv, n_raw, n_span)


def test_seeded_and_refuses_bad_input(setup, capsys):
    import datasets
    d, _ = setup
    assert _write(d, "b", 3) == 0
    assert datasets.load_from_disk(str(d / "a"))[:] == datasets.load_from_disk(str(d / "b"))[:]
    assert _write(d, "b", 3) == 2  # an existing output is not replaced without --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli(["retrieval-data", "--tokenizer", str(d / "tok"), "--haystack", str(d / "train.jsonl"),
                "--seq-length", "100", "--rows", "1", "--output", str(d / "c"), "--min-length", "500"]) == 2
    assert "--min-length" in capsys.readouterr().err
    assert _write(d, "c", 1, 1, "--raw-share", "0.8", "--chat-share", "0.2") == 2
    assert "--raw-share + --chat-share" in capsys.readouterr().err


def test_gemma_turn_template_on_a_base_tokenizer(setup, tmp_path, capsys):
    """real_model/chat_template.py: a tokenizer with Gemma's turn tokens gets the template, <end_of_turn> as EOS, and
    the curriculum's ChatMarkup parses it; one without them is refused with the reason."""
    import shutil

    from transformers import AutoTokenizer

    from easy_context_train.curriculum.markup import ChatMarkup
    from easy_context_train.real_model import chat_template
    d, _ = setup
    plain = tmp_path / "plain"
    shutil.copytree(d / "tok", plain)
    assert chat_template.main([str(plain)]) == 2 and "not one token" in capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(d / "tok")
    tok.chat_template = None
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.save_pretrained(tmp_path / "g")
    assert chat_template.main([str(tmp_path / "g")]) == 0
    g = AutoTokenizer.from_pretrained(tmp_path / "g")
    assert g.eos_token == "<end_of_turn>"
    text = g.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    m = ChatMarkup(g)
    assert g.convert_ids_to_tokens(m.eot) == ["<end_of_turn>"] and m.to_user[:1] == m.eot
