"""Nothing a user saved is deleted, resume never mixes runs, every bad input is one clear line (issue #16).

Mostly in-process (argument parsing, prepare_data, run directory, manifests, metrics); one plain-python
train.py pair for the run-identity / corrupt-checkpoint path end to end.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fails(fn, capsys, needle, code=2):
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == code, (e.value.code, err)
    assert len(err) >= 1 and needle in err[-1], err
    return err[-1]


# ------------------------------------------------------------------------------- 6. bad floats, 7. paths
@pytest.mark.parametrize("extra,needle", [
    (["--rope-theta", "nan"], "--rope-theta must be a finite number, got nan"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number"),
    (["--learning-rate", "-1e-3"], "--learning-rate must be > 0, got -0.001"),
    (["--min-lr-ratio", "-5"], "--min-lr-ratio must be in [0, 1], got -5"),
    (["--timeout", "0"], "--collective-timeout must be > 0 seconds"),
    (["--collective-timeout", "2x"], "is not a duration"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--resume", "--overwrite-output-dir"], "pass one"),
])
def test_bad_flags_are_one_line(extra, needle, capsys, tmp_path):
    from easy_context_train.args import parse_args
    _fails(lambda: parse_args(["--output-dir", str(tmp_path / "o"), *extra]), capsys, needle)


def test_unusable_output_dir_and_model_paths(capsys, tmp_path):
    from easy_context_train.args import parse_args
    f = tmp_path / "a_file"
    f.write_text("x")
    _fails(lambda: parse_args(["--output-dir", str(f)]), capsys, "is a file, not a directory")
    (tmp_path / "output").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # "output/7B_64K" where output/ exists: a mistyped local path, not a hub name
        _fails(lambda: parse_args(["--output-dir", "o", "--model", "output/7B_64K"]), capsys, "no such directory")
    finally:
        os.chdir(cwd)


def test_rope_theta_unset_keeps_the_models_own(tmp_path):
    """The #18 bug: --rope-theta defaulted to 1e5 and was written into every config (Llama-3 is 5e5)."""
    from transformers import LlamaConfig

    from easy_context_train.args import parse_args
    from easy_context_train.modeling import get_rope_theta, load_config
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=64, rope_theta=500000.0).save_pretrained(tmp_path / "m")
    args = parse_args(["--output-dir", str(tmp_path / "o"), "--model", str(tmp_path / "m")])
    assert args.rope_theta is None and args.save_rope_theta is None
    assert get_rope_theta(load_config(str(tmp_path / "m"), args.rope_theta)) == 500000.0
    assert get_rope_theta(load_config(str(tmp_path / "m"), 1e7)) == 1e7


# ------------------------------------------------------------------------------- 1, 9. prepare_data
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from easy_context_train.toy import build_tokenizer, make_corpus
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(make_corpus(20), str(d))
    return str(d)


def _prep(tok, data, out, *extra):
    import prepare_data
    return lambda: prepare_data.main(["--dataset", str(data), "--tokenizer", tok, "--seq-length", "8",
                                      "--output", str(out), "--num-proc", "1", *extra])


def test_prepare_data_never_deletes_what_it_did_not_write(tok, tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"hello world number {i} and more"}) + "\n" for i in range(6)))
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "notes.txt").write_text("notes")
    _fails(_prep(tok, data, precious), capsys, "non-empty directory that prepare_data.py did not write")
    assert (precious / "notes.txt").read_text() == "notes" and (precious / "sub").is_dir()
    _fails(_prep(tok, data, data), capsys, "is (inside) the input")
    assert data.exists()
    f = tmp_path / "file_out"
    f.write_text("x")
    _fails(_prep(tok, data, f), capsys, "is a file")
    out = tmp_path / "ds"
    _prep(tok, data, out)()
    _fails(_prep(tok, data, out), capsys, "pass --overwrite")
    _prep(tok, data, out, "--overwrite")()  # its own dataset may be replaced when asked
    _fails(_prep(tok, out, out, "--overwrite"), capsys, "is (inside) the input")
    assert os.path.exists(out / ".easy_context_dataset")


def test_prepare_data_unreadable_inputs_are_one_line(tok, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _fails(_prep(tok, empty, tmp_path / "o1"), capsys, "is an empty file")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 \xff\xfe nope\n")
    _fails(_prep(tok, bad, tmp_path / "o2"), capsys, "is not UTF-8 text")


def test_train_data_errors_are_one_line(tmp_path):
    from easy_context_train.data import load_any_dataset, validate_packed
    from easy_context_train.errors import UsageError
    s = tmp_path / "strids.jsonl"
    s.write_text(json.dumps({"input_ids": "abc"}) + "\n")
    with pytest.raises(UsageError, match="must be lists of token ids"):
        validate_packed(load_any_dataset(str(s)), str(s), 4)
    e = tmp_path / "e.jsonl"
    e.write_text("")
    with pytest.raises(UsageError, match="empty file"):
        load_any_dataset(str(e))


# ------------------------------------------------------------------------------- 5. torn metrics line
def test_torn_metrics_tail_is_tolerated(tmp_path):
    from easy_context_train.metrics import JsonlLog
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    JsonlLog(str(p), True, resume_step=2)
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2]


# ------------------------------------------------------------------------------- 2, 4. run identity, manifests
class _FakeAccelerator:
    is_main_process = True

    def save_state(self, path):
        with open(os.path.join(path, "model.bin"), "wb") as f:
            f.write(b"w" * 5000)

    def wait_for_everyone(self):
        pass


def test_pruning_touches_only_this_runs_checkpoints(tmp_path):
    from easy_context_train import checkpoint as ckpt
    acc = _FakeAccelerator()
    for step in (10, 20):  # an older run with later step numbers
        ckpt.save_checkpoint(acc, str(tmp_path), step, keep=5, run_id="old")
    for step in (1, 2, 3):
        ckpt.save_checkpoint(acc, str(tmp_path), step, keep=2, run_id="new")
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == [2, 3, 10, 20]


def test_fresh_run_into_another_runs_dir_is_refused(tmp_path):
    from types import SimpleNamespace

    from easy_context_train import run_dir
    from easy_context_train.errors import UsageError
    args = SimpleNamespace(resume=False, overwrite_output_dir=False)
    run_dir.check_run(str(tmp_path), args, [])  # empty dir: fine
    with pytest.raises(UsageError, match=r"holds checkpoints of an earlier run \(steps 5\); pass --resume"):
        run_dir.check_run(str(tmp_path), args, [(5, "x")])
    run_dir.check_run(str(tmp_path), SimpleNamespace(resume=True, overwrite_output_dir=False), [(5, "x")])


def test_corrupt_checkpoint_falls_back_to_the_previous_good_one(tmp_path):
    from easy_context_train import checkpoint as ckpt
    from easy_context_train import run_dir
    acc = _FakeAccelerator()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(acc, str(tmp_path), step, keep=5, run_id="r")
    found = ckpt.list_checkpoints(str(tmp_path))
    with open(os.path.join(found[-1][1], "model.bin"), "r+b") as f:  # truncated shard
        f.truncate(100)
    open(os.path.join(found[-2][1], "train_state.json"), "w").close()  # empty train_state.json
    notes = []
    good = run_dir.latest_good_checkpoint(found, "r", notes.append)
    assert good == found[0][1]
    assert "model.bin has 100 bytes, 5000 were written" in notes[0] and "step 3" in notes[0]
    assert "train_state.json" in notes[1] and "step 2" in notes[1]
    assert run_dir.latest_good_checkpoint(found, "someone-else", notes.append) is None


# ------------------------------------------------------------------------------- 3. lock, launcher death
def test_output_dir_lock_and_stale_takeover(tmp_path):
    from easy_context_train import run_dir
    from easy_context_train.errors import UsageError
    a = run_dir.RunLock(str(tmp_path)).acquire()
    with pytest.raises(UsageError, match=f"in use by another run \\(pid {os.getpid()}"):
        run_dir.RunLock(str(tmp_path)).check()
    with pytest.raises(UsageError, match="in use by another run"):
        run_dir.RunLock(str(tmp_path)).acquire()
    a.release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket
    with open(tmp_path / "run.lock", "w") as f:
        json.dump({"pid": int(dead.stdout), "host": socket.gethostname()}, f)
    with pytest.warns(RuntimeWarning, match="stale lock"):
        b = run_dir.RunLock(str(tmp_path)).acquire()
    b.release()
    assert not (tmp_path / "run.lock").exists()


_LAUNCHER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "from easy_context_train.run_dir import exit_with_parent; "
                          "exit_with_parent(); import time; time.sleep(60)"], env=dict(os.environ, LOCAL_RANK="0"))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_workers_exit_when_the_launcher_is_killed():
    p = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    child = int(p.stdout.readline())
    time.sleep(1.5)  # the worker is up and has asked for PDEATHSIG
    p.send_signal(signal.SIGKILL)
    p.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the worker outlived its killed launcher")


# ------------------------------------------------------------------------------- 8. eval_ppl lengths
def test_eval_ppl_does_not_pass_short_documents_off_as_long(capsys):
    import math
    from types import SimpleNamespace

    from eval_ppl import compute_perplexity

    class Engine:
        def nll(self, inp, tgt, pad_id=0):
            n = int((tgt != -100).sum())
            return float(n) * 2.0, n
    tok = SimpleNamespace(bos_token_id=None, pad_token_id=0, eos_token_id=0)
    args = SimpleNamespace(sliding_window=256, truncate=True, hide_progress=True, aggressive_memory=False)
    docs = [list(range(513))] * 2
    ppl, _, count = compute_perplexity(Engine(), docs, 2048, args, tok)
    assert math.isnan(ppl) and count == 0
    assert "2 of 2 documents are shorter than 2048 tokens" in capsys.readouterr().out
    ppl, _, count = compute_perplexity(Engine(), docs + [list(range(3000))], 2048, args, tok)
    assert count == 2047 and abs(ppl - math.exp(2.0)) < 1e-9
