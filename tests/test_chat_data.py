"""Chat / packed-document data: prepare_data.py --format chat and --document-masking, the row format, and train.py
on it (2 ranks, zigzag, equal to one process: labels and restarting positions travel through the sp split)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import prepare_data
from easy_context_train.packed_data import IGNORE_INDEX, batch_targets, pack_examples, pack_text, render_chat
from tests.test_train import _ok, launch, losses

SEQ = 512


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from easy_context_train.toy import build_model, build_tokenizer, make_chat_corpus, make_corpus
    base = tmp_path_factory.mktemp("chat")
    model = str(base / "tiny-llama")
    tok = build_tokenizer(make_corpus(200) + ["user assistant system"], model)
    build_model(model, vocab_size=len(tok))
    convs = make_chat_corpus(60)
    convs[3] = [{"role": "user", "content": "x " * 400}, {"role": "assistant", "content": "long " * 300}]
    data = base / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return {"model": model, "tok": tok, "jsonl": str(data), "convs": convs, "base": base}


# ------------------------------------------------------------------------------------ row format (fast)
def test_render_chat_labels_only_assistant_turns(chat):
    tok, conv = chat["tok"], chat["convs"][0]
    ids, labels = render_chat(tok, conv, 0)
    assert ids == list(tok.apply_chat_template(conv, tokenize=True)["input_ids"])
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    answers = [m["content"] for m in conv if m["role"] == "assistant"]
    # exactly the assistant turns with their markup (role line and end-of-turn token)
    assert trained == "".join(f"<s>assistant\n{a}</s>" for a in answers), trained
    assert all(lab in (t, IGNORE_INDEX) for t, lab in zip(ids, labels))
    assert labels[0] == IGNORE_INDEX and labels[-1] == tok.eos_token_id


def test_render_chat_errors(chat):
    from easy_context_train.errors import UsageError
    tok = chat["tok"]
    with pytest.raises(UsageError, match="row 7: 'messages' must be a non-empty list"):
        render_chat(tok, [], 7)
    with pytest.raises(UsageError, match="row 2, message 1: needs a role"):
        render_chat(tok, [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}], 2)
    with pytest.raises(UsageError, match="row 0: no assistant turn"):
        render_chat(tok, [{"role": "user", "content": "hi"}], 0)


def test_pack_examples_positions_restart_and_long_ones_are_cut():
    docs = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5]), (list(range(10, 30)), list(range(10, 30))), ([7], [7])]
    stats: dict = {}
    rows = list(pack_examples(iter(docs), 7, pad_id=0, stats=stats))  # rows of 8
    assert all(len(r[k]) == 8 for r in rows for k in r)
    assert rows[0] == {"input_ids": [1, 2, 3, 4, 5, 0, 0, 0], "labels": [-100, 2, 3, 4, 5, -100, -100, -100],
                       "position_ids": [0, 1, 2, 0, 1, 0, 1, 2]}
    assert rows[1]["input_ids"] == list(range(10, 18)) and rows[1]["position_ids"] == list(range(8))
    assert rows[3]["input_ids"] == [26, 27, 28, 29, 7, 0, 0, 0]
    assert rows[3]["position_ids"] == [0, 1, 2, 3, 0, 0, 1, 2]
    assert stats == {"split": 1, "docs": 6}


def test_pack_text_restarts_positions_at_each_document_and_row():
    rows = list(pack_text([[5, 6, 7], [8, 9]], 3, bos=1, eos=2))  # rows of 4: 1 5 6 7 | 2 1 8 9 | (2 dropped)
    assert [r["input_ids"] for r in rows] == [[1, 5, 6, 7], [2, 1, 8, 9]]
    assert [r["position_ids"] for r in rows] == [[0, 1, 2, 3], [0, 0, 1, 2]]
    assert rows[0]["labels"] == rows[0]["input_ids"]


def test_batch_targets_never_predict_across_a_document_start():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    labels = torch.tensor([[-100, 2, 3, 4, -100, 6]])
    inp, p, tgt = batch_targets({"input_ids": ids, "labels": labels, "position_ids": pos})
    assert inp.tolist() == [[1, 2, 3, 4, 5]] and p.tolist() == [[0, 1, 2, 0, 1]]
    assert tgt.tolist() == [[2, 3, -100, -100, 6]]  # 4 starts a document: not predicted from 3
    inp, p, tgt = batch_targets({"input_ids": ids})  # plain rows: the old behaviour
    assert tgt.tolist() == [[2, 3, 4, 5, 6]] and p.tolist() == [list(range(5))]


# ------------------------------------------------------------------------------------ the CLI and errors
@pytest.fixture(scope="module")
def chat_data(chat):
    import contextlib
    import io
    out, printed = str(chat["base"] / f"chat_{SEQ}"), io.StringIO()
    with contextlib.redirect_stdout(printed):
        prepare_data.main(["--dataset", chat["jsonl"], "--tokenizer", chat["model"], "--seq-length", str(SEQ),
                           "--output", out, "--format", "chat"])
    return out, printed.getvalue()


def test_prepare_chat_writes_checked_rows(chat, chat_data):
    import datasets

    from easy_context_train.data import validate_packed
    out, printed = chat_data
    assert "1 conversations longer than a row were cut" in printed, printed
    ds = datasets.load_from_disk(out)
    assert set(ds.column_names) == {"input_ids", "labels", "position_ids"}
    validate_packed(ds, out, SEQ)  # train.py's own check accepts it
    n_assistant = sum(m["role"] == "assistant" for c in chat["convs"] for m in c)
    starts = sum(r.count(0) for r in ds["position_ids"])
    assert starts >= len(chat["convs"])  # every conversation starts a document (plus filler tails)
    ends = sum(sum(1 for t, lab in zip(i, lab_) if lab == t == chat["tok"].eos_token_id)
               for i, lab_ in zip(ds["input_ids"], ds["labels"]))
    assert ends == n_assistant  # each assistant turn's end-of-turn token is trained, nothing else's


def test_prepare_chat_and_train_errors(chat, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(SystemExit):
        prepare_data.main(["--dataset", str(bad), "--tokenizer", chat["model"], "--seq-length", "16",
                           "--output", str(tmp_path / "o"), "--format", "chat"])
    assert "row 0: no assistant turn" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_data.main(["--dataset", chat["jsonl"], "--tokenizer", chat["model"], "--seq-length", "16",
                           "--output", str(tmp_path / "o"), "--format", "chat", "--messages-column", "conv"])
    assert "no 'conv' column" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # a dataset whose positions jump inside a document is refused by train.py's check, naming row and index
    import datasets

    from easy_context_train.data import validate_packed
    from easy_context_train.errors import UsageError
    ds = datasets.Dataset.from_list([{"input_ids": [1] * 6, "position_ids": [0, 1, 2, 0, 5, 6]}])
    with pytest.raises(UsageError, match="row 0: position_ids jump from 0 to 5 at index 4"):
        validate_packed(ds, "x", 5)


@pytest.mark.slow
def test_chat_training_zigzag_equals_single_process(chat, chat_data, tmp_path):
    common = ["--model", chat["model"], "--dataset", chat_data[0], "--seq-length", str(SEQ), "--max-train-steps", "3",
              "--learning-rate", "3e-3", "--warmup-steps", "1", "--no-save-model", "--timeout", "120"]
    _ok(launch(1, [*common, "--output-dir", str(tmp_path / "ref"), "--parallel_mode", "data_parallel"]))
    _ok(launch(2, [*common, "--output-dir", str(tmp_path / "zz"), "--parallel_mode", "zigzag_ring_attn"]))
    ref, got = losses(tmp_path / "ref"), losses(tmp_path / "zz")
    assert len(got) == 3 and all(abs(a - b) <= 1e-4 for a, b in zip(got, ref)), (got, ref)
    assert os.path.exists(tmp_path / "zz" / "metrics.jsonl")


def test_prepare_text_document_masking(chat, tmp_path, capsys):
    import datasets

    from easy_context_train.toy import make_corpus
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_corpus(30)))
    out = str(tmp_path / "masked")
    prepare_data.main(["--dataset", str(src), "--tokenizer", chat["model"], "--seq-length", "255", "--output", out,
                       "--document-masking"])
    assert "with labels and position_ids" in capsys.readouterr().out
    ds = datasets.load_from_disk(out)
    tok = chat["tok"]
    for ids, pos in zip(ds["input_ids"], ds["position_ids"]):
        assert len(ids) == len(pos) == 256 and pos[0] == 0
        # every BOS starts a document (position 0), and nothing else does except a row's first token
        assert [i for i, p in enumerate(pos) if p == 0 and i] == [i for i, t in enumerate(ids) if t == tok.bos_token_id
                                                                  and i]


@pytest.mark.slow
def test_packed_resume_with_the_dispatch_planned_ahead(chat, chat_data, tmp_path):
    """train.py reads one optimizer step ahead to plan packed rows' dispatch in a helper process
    (easy_context_train/plan_ahead.py): a crash after checkpoint 2 and a resume must train steps 3-4 on the same micro-batches
    as an uninterrupted run (the checkpoint records the data position of the batches trained on, not those read
    ahead), with GA 2 so that a whole step is in flight at the checkpoint."""
    from tests.test_train import _env
    common = ["--model", chat["model"], "--dataset", chat_data[0], "--seq-length", str(SEQ), "--max-train-steps", "4",
              "--learning-rate", "3e-3", "--warmup-steps", "1", "--no-save-model", "--timeout", "120",
              "--gradient-accumulate-every", "2", "--checkpoint-every", "2", "--parallel_mode", "zigzag_ring_attn"]
    _ok(launch(2, [*common, "--output-dir", str(tmp_path / "whole")]))
    out = str(tmp_path / "crash")
    p = launch(2, [*common, "--output-dir", out], env=_env(EASY_CONTEXT_CRASH="step:2"))
    assert p.returncode != 0 and os.path.isdir(os.path.join(out, "checkpoints", "step-0000002"))
    p = launch(2, [*common, "--output-dir", out, "--resume"])
    _ok(p)
    want, got = losses(tmp_path / "whole"), losses(out)
    assert len(got) == 4 and all(abs(a - b) <= 1e-5 for a, b in zip(got, want)), (got, want)
