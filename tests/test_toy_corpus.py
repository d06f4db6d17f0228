"""The demo's toy corpus (easy_context_train/toy.py): passkey drills, passkey documents that fit their rows and
grow with the row length, digit-splitting tokenizer. No ranks, a few seconds."""
import re

import pytest


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from easy_context_train.toy import build_all

    out = str(tmp_path_factory.mktemp("toy_corpus"))
    paths = build_all(out, seq_lengths=(128, 256), n_docs=20, needle_docs=60, needle_max_sentences=None,
                      needle_digits=(2, 3), drill_docs=30, split_digits=True, vocab_size=512,
                      document_masking=True)
    return paths


def test_drills_state_one_number_twice():
    from easy_context_train.toy import make_drill_corpus

    drills = make_drill_corpus(50, seed=3, digits=(6, 9))
    assert drills == make_drill_corpus(50, seed=3, digits=(6, 9))  # seeded
    for d in drills:
        m = re.fullmatch(r"The pass key is (\d+)\. Remember it\. (\d+) is the pass key\.", d)
        assert m and m.group(1) == m.group(2) and 6 <= len(m.group(1)) <= 9, d


def test_recall_drills_ask_for_the_number_as_the_needle_question_does():
    from easy_context.haystack import NEEDLE, QUESTION_STR
    from easy_context_train.toy import make_drill_corpus

    drills = make_drill_corpus(50, seed=3, digits=(2, 2), style="recall")
    assert drills == make_drill_corpus(50, seed=3, digits=(2, 2), style="recall")  # seeded
    for d in drills:
        m = re.fullmatch(r"The pass key is: (\d+)\. Remember it\. The pass key is: (\d+)\.", d)
        assert m and m.group(1) == m.group(2) and len(m.group(1)) == 2, d
    # the needle states "... is: N." and its question ends "... is:" (what the recall drill copies after)
    assert "is: {}." in NEEDLE and QUESTION_STR.endswith("is:")
    # the default sentence is unchanged (same numbers from the same seed)
    assert make_drill_corpus(5, seed=3) == make_drill_corpus(5, seed=3, style="passkey")
    with pytest.raises(ValueError, match="recall"):
        make_drill_corpus(1, style="mixed")


def test_digit_tokenizer_gives_one_digit_per_token(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    toks = tok.tokenize(" 4821 and 93")
    assert all(sum(c.isdigit() for c in t) <= 1 for t in toks), toks  # one digit per token
    assert toks[toks.index("8") - 1].endswith("4") and toks[toks.index("8"):toks.index("8") + 3] == ["8", "2", "1"]


def test_passkey_documents_fit_their_rows_and_grow_with_them(assets):
    import datasets
    from transformers import AutoTokenizer

    from easy_context.haystack import QUESTION_STR

    tok = AutoTokenizer.from_pretrained(assets["model"])
    for L in (128, 256):
        rows = datasets.load_from_disk(assets[f"data_{L}"])
        answers = drills = 0
        longest = 0
        for r in rows:
            ids, labels, pos = r["input_ids"], r["labels"], r["position_ids"]
            assert len(ids) == len(labels) == len(pos) == L + 1
            starts = [i for i, p in enumerate(pos) if p == 0] + [L + 1]
            for a, b in zip(starts, starts[1:]):
                text = tok.decode(ids[a:b])
                trained = [t for t in labels[a:b] if t != -100]
                if "<book>" in text:
                    # whole passkey document in one row (never cut), in eval_needle's format, trained
                    assert text.startswith("<s>This is a very long story book") and text.endswith("</s>"), text
                    assert pos[a:b] == list(range(b - a))
                    number = re.search(r"is: (\d+)\.\n", text).group(1)
                    assert text.endswith(f"is: {number}.</s>") and trained == ids[a:b], text
                    q = QUESTION_STR.split("Singapore")[0]
                    assert q in text
                    longest = max(longest, b - a)
                    answers += 1
                elif "pass key" in text:
                    assert trained == ids[a:b]  # drills: every token trained
                    drills += 1
        assert answers >= 50 and drills >= 25, (answers, drills)
        # haystacks grow with the row length (as many sentences as fit): eval_needle asks for long ones
        assert longest > 0.7 * L, (L, longest)
    # eval_ppl's held-out prose: whole documents longer than the longest row
    import json
    with open(assets["heldout"]) as f:
        held = [json.loads(line)["text"] for line in f]
    assert len(held) == 8 and len(set(held)) == 8
    assert min(len(tok(t)["input_ids"]) for t in held) > 256
