"""eval_needle.py / eval_ppl.py / plot.py and the shared SP inference path (easy_context/inference.py).

Tiers: pure logic (prompt building, grids, windows), single process (chunked NLL and greedy decoding against
full logits and model.generate), multi-rank gloo (every sequence-parallel mode that exists equals single
process), and @slow subprocess runs of the scripts under torchrun.
"""
from __future__ import annotations

import csv
import math
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_ranks
from tests.tols import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # eval_needle / eval_ppl live at the repo root

import eval_needle  # noqa: E402
import eval_ppl  # noqa: E402


# ----------------------------------------------------------------------------------------------
# tiny model + byte-level tokenizer, saved like a real checkpoint
# ----------------------------------------------------------------------------------------------
def build_tiny(path: str, kv_heads: int = 2) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from easy_context.haystack import NEEDLE, PREFIX, QUESTION_STR, filler_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([filler_text(300), NEEDLE, QUESTION_STR, PREFIX], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, vocab_size=tok.get_vocab_size(), bos_token_id=0,
                      eos_token_id=1, pad_token_id=1, max_position_embeddings=4096, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a sharper random model: greedy continuations vary with the context
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(str(tmp_path_factory.mktemp("tiny") / "model"))


# every sequence-parallel mode (data_parallel is the single-process path the tests compare against)
SP_MODES = ["zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"]


# ----------------------------------------------------------------------------------------------
# independent references: full logits of the unpatched model
# ----------------------------------------------------------------------------------------------
def hand_window_nll(model, inp, tgt):
    """(sum NLL, count) of one window from the full-vocabulary logits of a plain forward."""
    with torch.no_grad():
        logits = model(inp).logits[0].double()
    t = tgt[0]
    m = t != -100
    return F.cross_entropy(logits[m], t[m], reduction="sum").item(), int(m.sum())


def hand_ppl(model, docs, max_length, stride, truncate, bos):
    """Token-weighted perplexity written out by hand (HF strided windows, BOS prepended)."""
    s = c = 0.0
    max_tok = max_length - 1
    for ids in docs:
        prev_end, starts = 0, ([0] if truncate else range(0, len(ids), stride))
        for begin in starts:
            end = min(len(ids), max_tok) if truncate else min(begin + max_tok, len(ids))
            trg = end if truncate else end - prev_end
            inp = [bos] + ids[begin:end]
            tgt = [-100] * len(inp)
            for i in range(len(inp) - 1):
                if i + 1 >= len(inp) - trg:
                    tgt[i] = inp[i + 1]
            ws, wc = hand_window_nll(model, torch.tensor([inp]), torch.tensor([tgt]))
            s, c = s + ws, c + wc
            prev_end = end
            if truncate or end == len(ids):
                break
    return math.exp(s / c)


def needle_prompt(tok, length=150, depth=0.5, number="1234567", distractors=()):
    from easy_context.haystack import NeedleHaystack, filler_text
    hay = NeedleHaystack(tok, filler_text(200), 400)
    return hay.build(length, depth, number, distractors, rng=random.Random(1))


class PplArgs:  # the eval_ppl flags compute_perplexity reads
    def __init__(self, truncate, sliding_window=64):
        self.truncate, self.sliding_window = truncate, sliding_window
        self.hide_progress, self.aggressive_memory = True, False


def make_docs(tok, n=3):
    from easy_context.haystack import filler_text
    return [tok(filler_text(12 + 7 * i, seed=i), add_special_tokens=False)["input_ids"] for i in range(n)]


# ----------------------------------------------------------------------------------------------
# pure logic
# ----------------------------------------------------------------------------------------------
def test_needle_prompt_depth_digits_and_haystack(tiny, tmp_path):
    from transformers import AutoTokenizer

    from easy_context.haystack import (NEEDLE, PREFIX, QUESTION_STR, NeedleHaystack, filler_text, random_number,
                                       read_haystack)

    tok = AutoTokenizer.from_pretrained(tiny)
    hay = NeedleHaystack(tok, filler_text(200), 3000)
    assert len(hay.ids) == 3000  # tiled from one tokenization
    L = 2000
    for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        p = hay.build(L, depth, "7654321")
        needle = tok(NEEDLE.format("7654321"), add_special_tokens=False)["input_ids"]
        assert p.input_ids[p.needle_start:p.needle_start + len(needle)] == needle
        assert p.input_ids[:len(hay.prefix_ids)] == tok(PREFIX)["input_ids"] and p.input_ids[0] == tok.bos_token_id
        assert p.input_ids[-len(hay.question_ids):] == tok(QUESTION_STR, add_special_tokens=False)["input_ids"]
        assert len(p.input_ids) == len(hay.prefix_ids) + L + len(needle) + len(hay.question_ids)
        at = p.needle_start - p.haystack_start  # haystack tokens before the needle
        # at the requested depth, snapped forward to the FIRST sentence end (a period token) after it
        ends = [tok.decode([t]).rstrip().endswith(".") for t in hay.ids[:L]]
        if depth == 0:
            assert at == 0
        else:
            assert depth * L <= at <= depth * L + 80 and (ends[at - 1] or at == L), (depth, at)
            assert not any(ends[int(depth * L):at - 1]), (depth, at)
        assert tok.decode(p.answer_ids).strip() == "7654321"
    # distractors: fresh cities/numbers go in, the needle text stays once
    p = hay.build(L, 0.5, "1111111", [("Paris", "2222222"), ("Tokyo", "3333333")], rng=random.Random(3))
    text = tok.decode(p.input_ids)
    assert text.count("Singapore number is: 1111111.") == 1 and "Paris number is: 2222222." in text
    assert "Tokyo number is: 3333333." in text
    # exactly d digits
    rng = random.Random(0)
    for d in (1, 2, 7):
        assert all(len(random_number(rng, d)) == d for _ in range(300))
    # haystack files in sorted order
    (tmp_path / "b.txt").write_text("second file.")
    (tmp_path / "a.txt").write_text("first file.")
    assert read_haystack(str(tmp_path)).index("first") < read_haystack(str(tmp_path)).index("second")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        read_haystack(str(tmp_path / "missing"))


def test_grids_windows_and_clear_errors(tiny, tmp_path):
    from easy_context.inference import load_model

    args = eval_needle.parse_args(["--min_context_length", "100", "--max_context_length", "300",
                                   "--context_interval", "100", "--depth_interval", "0.25"])
    lengths, depths = eval_needle.check_grid(args)
    assert lengths == [100, 200, 300] and depths == [0.0, 0.25, 0.5, 0.75, 1.0]
    bad = eval_needle.parse_args(["--min_context_length", "500", "--max_context_length", "300"])
    with pytest.raises(ValueError, match="impossible length grid"):
        eval_needle.check_grid(bad)
    with pytest.raises(ValueError, match="depth_interval"):
        eval_needle.check_grid(eval_needle.parse_args(["--depth_interval", "0"]))
    assert eval_ppl.length_grid(256, 2048, None) == [256, 512, 1024, 2048]
    assert eval_ppl.length_grid(100, 300, 100) == [100, 200, 300]
    with pytest.raises(ValueError, match="impossible length grid"):
        eval_ppl.length_grid(4096, 1024, None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "no_such_model"))
    # strided windows score every token exactly once when stride <= window
    w = eval_ppl.windows(1000, 300, 128, truncate=False)
    assert sum(t for _, _, t in w) == 1000 and w[-1][1] == 1000
    assert eval_ppl.windows(1000, 300, 128, truncate=True) == [(0, 300, 300)]


# ----------------------------------------------------------------------------------------------
# single process: chunked NLL, perplexity, greedy decoding
# ----------------------------------------------------------------------------------------------
def test_engine_takes_one_layout(tiny):
    """The engine takes one ParallelLayout (mode + degrees + groups); mixing it with other ways is an error."""
    from easy_context.inference import SeqParallelLM, load_model
    from easy_context.parallel_layout import ParallelLayout
    model, _ = load_model(tiny)
    eng = SeqParallelLM(model, layout=ParallelLayout.build("usp_attn"))
    assert eng.seq_algo == "usp_attn" and eng.layout_kw == {"ring_degree": 1} and eng.world == 1
    with pytest.raises(ValueError, match="either layout="):
        SeqParallelLM(model, "ulysses_attn", layout=ParallelLayout.build("zigzag_ring_attn"))
    with pytest.raises(ValueError, match="ring_degree=3 only applies to usp_attn"):
        SeqParallelLM(model, "zigzag_ring_attn", ring_degree=3)


def test_single_process_against_full_logits_and_generate(tiny):
    from easy_context.inference import SeqParallelLM, chunked_nll, load_model

    model, tok = load_model(tiny)
    # chunked NLL (odd chunk) == full cross-entropy
    ids = torch.tensor([make_docs(tok, 1)[0][:97]])
    tgt = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    tgt[0, :30] = -100
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        full = F.cross_entropy(model(ids).logits[0].double(), tgt[0], reduction="sum")
        s, c = chunked_nll(model, hidden, tgt, chunk_tokens=7)
    assert int(c) == 66
    assert_close(s, full, rel=1e-6, name="chunked nll")

    docs = make_docs(tok)
    p = needle_prompt(tok)
    ids = torch.tensor([p.input_ids])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             eos_token_id=1, pad_token_id=1)[0, ids.shape[1]:].tolist()
        logits = model(torch.cat([ids, torch.tensor([p.answer_ids])], 1)).logits[0]
    n, a = ids.shape[1], len(p.answer_ids)
    ref_tf = logits[n - 1:n + a - 1].argmax(-1)
    hand = {tr: hand_ppl(model, docs, 128, 64, tr, tok.bos_token_id) for tr in (True, False)}

    eng = SeqParallelLM(model, "data_parallel")
    assert eng.generate(ids, 10, eos_token_id=1) == ref
    assert torch.equal(eng.teacher_forced(ids, torch.tensor([p.answer_ids]))[0], ref_tf)
    for tr in (True, False):
        ppl, _, _ = eval_ppl.compute_perplexity(eng, docs, 128, PplArgs(tr), tok)
        assert abs(ppl - hand[tr]) <= 1e-4 * hand[tr], (tr, ppl, hand[tr])
    eng.close()
    # --rope_theta / --rope-theta reaches the rotary embedding
    m2, _ = load_model(tiny, rope_theta=5e5)
    assert m2.config.rope_parameters["rope_theta"] == 5e5
    assert not torch.allclose(m2.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)


# ----------------------------------------------------------------------------------------------
# multi-rank: every existing sp mode equals single process
# ----------------------------------------------------------------------------------------------
def _sp_body(rank, world, model_dir, modes):
    from easy_context.inference import SeqParallelLM, load_model, sp_group_kwargs

    torch.manual_seed(0)
    model, tok = load_model(model_dir)
    docs = make_docs(tok)
    # awkward lengths: the prompt is not a multiple of 2W (padding) and the needle sits at 0.3
    p = needle_prompt(tok, length=137, depth=0.3, distractors=[("Paris", "5555555")])
    ids = torch.tensor([p.input_ids])
    ans = torch.tensor([p.answer_ids])
    with torch.no_grad():
        ref_gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 eos_token_id=1, pad_token_id=1)[0, ids.shape[1]:].tolist()
        n = ids.shape[1]
        ref_tf = model(torch.cat([ids, ans], 1)).logits[0, n - 1:n + ans.shape[1] - 1].argmax(-1)
        # scored tokens only in the last 20 positions: they sit on one or two ranks (EasyContext: NaN)
        tail_tgt = torch.full_like(ids, -100)
        tail_tgt[0, -21:-1] = ids[0, -20:]
        ref_tail = hand_window_nll(model, ids, tail_tgt)
    hand = {tr: hand_ppl(model, docs, 128, 64, tr, tok.bos_token_id) for tr in (True, False)}

    cases = [(m, None) for m in modes]
    if "usp_attn" in modes and world >= 4:
        cases.append(("usp_attn", 2))
    for mode, ring in cases:
        groups = sp_group_kwargs(mode, ring)
        eng = SeqParallelLM(model, mode, groups=groups, ring_degree=ring)
        assert eng.world == world
        tag = f"{mode} ring={ring} W={world}"
        got = eng.generate(ids, 8, eos_token_id=1)
        assert got == ref_gen, f"{tag}: generate {got} != model.generate {ref_gen}"
        tf = eng.teacher_forced(ids, ans)[0]
        assert torch.equal(tf, ref_tf), f"{tag}: teacher forced {tf} != {ref_tf}"
        s, c = eng.nll(ids, tail_tgt)
        assert c == ref_tail[1] and abs(s - ref_tail[0]) <= 1e-5 * abs(ref_tail[0]), (tag, s, c, ref_tail)
        for tr in (True, False):
            ppl, _, _ = eval_ppl.compute_perplexity(eng, docs, 128, PplArgs(tr), tok)
            assert abs(ppl - hand[tr]) <= 1e-4 * hand[tr], (tag, tr, ppl, hand[tr])
        eng.close()
    # data_parallel over the ranks: documents split, totals all-reduced
    eng = SeqParallelLM(model, "data_parallel")
    for tr in (True, False):
        ppl, _, _ = eval_ppl.compute_perplexity(eng, docs, 128, PplArgs(tr), tok, rank, world, dp_split=True)
        assert abs(ppl - hand[tr]) <= 1e-4 * hand[tr], ("data_parallel", tr, ppl, hand[tr])
    eng.close()


def test_sp_modes_equal_single_process_w2(tiny):
    run_ranks(_sp_body, 2, args=(tiny, SP_MODES), timeout=180)


def _window_body(rank, world, model_dir):
    """A Mistral with a 16-token sliding window: SP prefill (windowed ring blocks) + distributed decode (each
    rank's prompt KV cut to the window) give model.generate's tokens; teacher-forced logits equal HF's."""
    import transformers as tf

    from easy_context.inference import SeqParallelLM, sp_group_kwargs
    tok = tf.AutoTokenizer.from_pretrained(model_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.sliding_window == 16
    p = needle_prompt(tok, length=101, depth=0.9)
    ids = torch.tensor([p.input_ids])
    ans = torch.tensor([p.answer_ids])
    with torch.no_grad():
        ref_gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                                 do_sample=False, pad_token_id=1)[0, ids.shape[1]:].tolist()
        n = ids.shape[1]
        ref_tf = model(torch.cat([ids, ans], 1)).logits[0, n - 1:n + ans.shape[1] - 1].argmax(-1)
    full = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    full.config.sliding_window = None
    with torch.no_grad():  # the window really matters for this prompt
        assert full.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                             do_sample=False, pad_token_id=1)[0, n:].tolist() != ref_gen
    for mode in ("data_parallel", "zigzag_ring_attn", "ulysses_attn"):
        eng = SeqParallelLM(model, mode, groups=sp_group_kwargs(mode))
        got = eng.generate(ids, 24)  # 24 > window: the generated KV is cut too
        assert got == ref_gen, f"{mode} W={world}: generate {got} != model.generate {ref_gen}"
        assert torch.equal(eng.teacher_forced(ids, ans)[0], ref_tf), mode
        eng.close()


@pytest.fixture(scope="module")
def windowed(tiny, tmp_path_factory):
    import shutil

    import transformers as tf
    out = tmp_path_factory.mktemp("windowed") / "model"
    cfg = tf.AutoConfig.from_pretrained(tiny)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=cfg.vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=1, sliding_window=16,
        rope_theta=10000.0, max_position_embeddings=4096))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    for f in os.listdir(tiny):
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny, f), out / f)
    return str(out)


def test_sliding_window_generation_equals_hf(windowed):
    run_ranks(_window_body, 2, args=(windowed,), timeout=180)


@pytest.mark.slow
def test_sp_modes_equal_single_process_w4(tiny):
    run_ranks(_sp_body, 4, args=(tiny, SP_MODES), timeout=300)


# ----------------------------------------------------------------------------------------------
# the scripts end to end (torchrun, 2 CPU ranks)
# ----------------------------------------------------------------------------------------------
def _torchrun(script, args, nproc=2):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(__import__("tests.harness", fromlist=["free_port"]).free_port()), os.path.join(ROOT, script), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, f"{script} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


@pytest.mark.slow
def test_scripts_end_to_end(tiny, tmp_path):
    import json

    from easy_context.haystack import filler_text
    from easy_context.inference import SeqParallelLM, load_model

    mode = "zigzag_ring_attn"
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": filler_text(15 + 5 * i, seed=i)}) + "\n" for i in range(2)))
    out_csv = tmp_path / "ppl" / "ppl.csv"
    _torchrun("eval_ppl.py", ["-m", tiny, "-d", str(data), "--min-tokens", "64", "--max-tokens", "128",
                              "--sliding-window", "48", "--output-file", str(out_csv), "--parallel_mode", mode])
    rows = list(csv.reader(open(out_csv)))
    assert rows[0] == ["", "64", "128"] and rows[1][0] == tiny
    model, tok = load_model(tiny)
    docs = [tok(filler_text(15 + 5 * i, seed=i), add_special_tokens=False)["input_ids"] for i in range(2)]
    for length, val in zip((64, 128), rows[1][1:]):
        ref = hand_ppl(model, docs, length, 48, False, tok.bos_token_id)
        assert abs(float(val) - ref) <= 1e-4 * ref, (length, val, ref)
    subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), str(out_csv), "--xmax", "150", "--ymin", "0",
                    "--ymax", "1000"], check=True, capture_output=True, cwd=ROOT)
    assert os.path.getsize(f"{out_csv}.png") > 1000 and os.path.getsize(f"{out_csv}.pdf") > 100

    out = tmp_path / "needle"
    _torchrun("eval_needle.py", ["--model", tiny, "--min_context_length", "100", "--max_context_length", "200",
                                 "--context_interval", "100", "--depth_interval", "0.5", "--num_samples", "1",
                                 "--rnd_number_digits", "5", "--max_new_tokens", "6", "--output-dir", str(out),
                                 "--parallel_mode", mode])
    rows = list(csv.DictReader(open(out / "needle_model.csv", encoding="utf-8", newline="")))
    assert len(rows) == 2 * 3 and list(rows[0]) == ["length", "depth", "sample", "expected", "generated", "correct"]
    assert all(len(r["expected"]) == 5 for r in rows)
    assert os.path.getsize(out / "heatmap_model.png") > 1000
    assert open(out / "accuracy_model.txt").read().startswith("Average Accuracy: ")
    # the generated text equals single-process greedy decoding of the same prompts
    args = eval_needle.parse_args(["--min_context_length", "100", "--max_context_length", "200",
                                   "--context_interval", "100", "--depth_interval", "0.5", "--num_samples", "1",
                                   "--rnd_number_digits", "5"])
    from easy_context.haystack import NeedleHaystack, read_haystack
    hay = NeedleHaystack(tok, read_haystack(None), 200)
    for job, row in zip(eval_needle.build_jobs(args, *eval_needle.check_grid(args)), rows):
        p = hay.build(job["length"], job["depth"], job["number"], job["distractors"], rng=random.Random(job["seed"]))
        ids = torch.tensor([p.input_ids])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 eos_token_id=1, pad_token_id=1)[0, ids.shape[1]:]
        assert row["expected"] == job["number"]
        assert row["generated"] == tok.decode(new, skip_special_tokens=True), (row, job)
    # a missing model path fails fast with a clear message (no traceback)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "eval_needle.py"), "--model", str(tmp_path / "nope")],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_heldout_templates_mode(tiny, tmp_path):
    """--templates both: the own rows are what --templates own gives; each held-out kind gets its rows, its heatmap,
    and greedy text equal to HF generate on the prompt HeldoutProbes builds; a distractor's number makes a miss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from easy_context.haystack import heldout, read_haystack
    base = ["--model", tiny, "--min_context_length", "100", "--max_context_length", "200", "--context_interval", "100",
            "--depth_interval", "0.5", "--num_samples", "1", "--max_new_tokens", "5", "--parallel_mode",
            "data_parallel"]
    own = eval_needle.main(base + ["--output-dir", str(tmp_path / "own")])
    kinds = ["distract", "code"]
    both = eval_needle.main(base + ["--output-dir", str(tmp_path / "both"), "--templates", "both",
                                    "--probe_kinds", *kinds])
    assert [(r["expected"], r["generated"]) for r in both if r["kind"] == "own"] == \
        [(r["expected"], r["generated"]) for r in own]
    held = [r for r in both if r["templates"] == "heldout"]
    assert [r["kind"] for r in held] == [k for k in kinds for _ in range(6)]
    header = open(tmp_path / "both" / "needle_model.csv", encoding="utf-8").readline().strip().split(",")
    assert header[-3:] == ["templates", "kind", "template_id"]
    for k in kinds:
        assert os.path.getsize(tmp_path / "both" / f"heatmap_model_{k}.png") > 1000
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    args = eval_needle.parse_args(base + ["--templates", "heldout", "--probe_kinds", *kinds])
    jobs = eval_needle.build_jobs(args, *eval_needle.check_grid(args))
    probes = heldout.HeldoutProbes(tok, read_haystack(None), None, 200)
    for job, row in list(zip(jobs, held))[::5]:
        p = probes.build(job["kind"], job["length"], job["depth"], job["key"], job["number"], job["distractors"],
                         rng=random.Random(job["seed"]))
        assert p.template_id == row["template_id"] == f"heldout/{job['kind']}/0"
        assert heldout.BY_KIND[job["kind"]].question.format(key=job["key"]).strip() in tok.decode(p.input_ids)
        assert len(p.wrong) == (2 if job["kind"] == "distract" else 0)
        ids = torch.tensor([[tok.bos_token_id] + p.input_ids])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                 eos_token_id=1, pad_token_id=1)[0, ids.shape[1]:]
        assert row["generated"] == tok.decode(new, skip_special_tokens=True), (row, job)
    p = heldout.HeldoutPrompt([], "1234567", ["7654321"], "heldout/distract/0")
    assert heldout.correct("it is 1234567", p) and not heldout.correct("1234567 or 7654321", p)
    with pytest.raises(ValueError, match="--probe_kinds: unknown"):
        eval_needle.check_grid(eval_needle.parse_args(["--templates", "heldout", "--probe_kinds", "nope"]))
    with pytest.raises(ValueError, match="--mode generate"):
        eval_needle.check_grid(eval_needle.parse_args(["--templates", "both", "--mode", "teacher_forced"]))
