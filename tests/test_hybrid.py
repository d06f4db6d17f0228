"""Hybrid (softmax + recurrent) models under sequence parallelism (issue #30).

Refusal: a recurrent / linear-attention / short-convolution layer without an adapter is refused by every
sequence-parallel mode with one line naming its class and the model type — never a silent wrong run."""
from __future__ import annotations

import pytest
import torch

from easy_context import apply_seq_parallel_monkey_patch
from easy_context.recurrent import supported_classes
from easy_context.recurrent.detect import recurrent_layers
from tests.hybrid_models import REFUSED, SUPPORTED, build_hybrid, make_hybrid_config

SP_MODES = ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")


@pytest.mark.parametrize("family", SUPPORTED + REFUSED)
def test_unsupported_recurrent_layers_are_refused(family):
    model = build_hybrid(family)
    layers = recurrent_layers(model)
    assert layers, f"{family}: no recurrent layer detected"
    unsupported = [m for _, m in layers if type(m).__name__ not in supported_classes()]
    impl = model.config._attn_implementation
    for mode in SP_MODES:
        if not unsupported:
            break
        with pytest.raises(ValueError) as e:
            apply_seq_parallel_monkey_patch(mode, model)
        msg = str(e.value)
        assert "\n" not in msg, msg
        assert type(unsupported[0]).__name__ in msg and repr(model.config.model_type) in msg, msg
        assert model.config._attn_implementation == impl, f"{family}: patched before refusing"
    apply_seq_parallel_monkey_patch("data_parallel", model)  # plain data parallel never refuses


def test_unknown_recurrent_config_is_refused():
    """A recurrent layer kind no module check recognises is still refused from the config's layer_types."""
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = make_hybrid_config("lfm2")
            self.config.layer_types = ["full_attention", "retention"]
    from easy_context.recurrent import check_supported
    with pytest.raises(ValueError, match=r"layer_types \['retention'\]"):
        check_supported("ulysses_attn", Plain())


def test_softmax_only_families_have_no_recurrent_layer():
    from tests.model_equiv import EXTRA_FAMILIES, FAMILIES, build_model
    for family in FAMILIES + EXTRA_FAMILIES:
        assert recurrent_layers(build_model(family)) == [], family


def test_check_refuses_before_any_rank(tmp_path, capsys, monkeypatch):
    from easy_context.recurrent import adapter
    from easy_context.tools.check import main
    supported_classes()  # the built-in adapters registered, then one taken away: its layer is now unsupported
    monkeypatch.delitem(adapter._ADAPTERS, "NemotronHMamba2Mixer")
    make_hybrid_config("nemotron_h").save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--parallel_mode", "ulysses_attn", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "NemotronHMamba2Mixer" in err and "nemotron_h" in err, err


# ---------------------------------------------------------------------------------------------- exactness
# Every case: logits (unsharded), loss and every gradient (summed over the sp group) of the patched model equal one
# process on the full rows (each packed document alone) within 1e-5 relative (float32; tests/model_equiv.py).
def _packed(batch, seq_len, seed):
    from easy_context.tools.check.rank import packed_positions  # random restarts, rows differ
    return packed_positions(batch, seq_len, seed)


def _cases(world_size, full):
    """(mode, layout kwargs, family, packed) for one spawn. full: every mode x family x {plain, packed}; else every
    mode with gated DeltaNet packed and the short conv plain (one representative per mode x feature)."""
    from easy_context import ParallelLayout
    usp = ParallelLayout.build("usp_attn", ring_degree=2)  # W=2: ring 2 x ulysses 1; W=4: ring 2 x ulysses 2
    modes = [("zigzag_ring_attn", {}), ("ulysses_attn", {}), ("dist_flash_attn", {}),
             ("usp_attn", dict(layout_kw=usp.layout_kw, groups=usp.attn_groups(), sp_group=usp.sp_group))]
    if not full:
        return [(m, kw, f, f != "lfm2") for m, kw in modes for f in ("qwen3_next", "lfm2")] + \
            [(modes[0][0], {}, "qwen3_5", True), (modes[3][0], modes[3][1], "lfm2", True)]
    fams = SUPPORTED if world_size == 2 else ("qwen3_next", "lfm2")
    return [(m, kw, f, packed) for m, kw in modes for f in fams for packed in (False, True)]


def _count_parallel_runs():
    """Count the layers the parallel paths (delta_parallel / conv_parallel) ran, in this process."""
    from easy_context.recurrent import conv_parallel, delta_parallel
    runs = {"n": 0}
    for mod in (conv_parallel, delta_parallel):
        def counted(*a, _run=mod.run_plan):
            out = _run(*a)
            runs["n"] += out is not None
            return out
        mod.run_plan = counted
    return runs


def _equivalence_body(rank, world_size, full):
    import os

    from tests.hybrid_models import drop_recurrent_state
    from easy_context.recurrent.exchange import SERIAL_ENV
    from tests.model_equiv import check_model_equivalence
    runs = _count_parallel_runs()
    for mode, kw, family, packed in _cases(world_size, full):
        pos = _packed(2, 32, seed=3) if packed else None
        check_model_equivalence(rank, world_size, mode, family, position_ids=pos, **kw)
    assert runs["n"] > 0, "the parallel recurrent paths never ran"
    # a deep copy of the patched model (TRL's reference model, an EMA copy) routes its own layers: a copy still
    # bound to the original's would leave its recurrent parameters without gradients
    import copy
    n = runs["n"]
    check_model_equivalence(rank, world_size, "zigzag_ring_attn", "qwen3_next", position_ids=_packed(2, 32, 3),
                            prepare_sp_model=copy.deepcopy)
    assert runs["n"] > n, "the deep copy's recurrent layers did not run the parallel path"
    os.environ[SERIAL_ENV] = "1"  # the serial chain, still selectable
    try:
        for family in ("qwen3_next", "lfm2"):
            check_model_equivalence(rank, world_size, "zigzag_ring_attn", family, position_ids=_packed(2, 32, 3))
    finally:
        os.environ.pop(SERIAL_ENV)
    if full and world_size == 2:  # packed rows in the balanced k-pair zigzag layout (many pieces per rank)
        from easy_context.sharding import PAIRS_ENV, zigzag_pairs
        os.environ[PAIRS_ENV] = "4"
        try:
            assert zigzag_pairs(64, world_size) == 4
            for family in ("qwen3_next", "lfm2"):
                check_model_equivalence(rank, world_size, "zigzag_ring_attn", family, seq_len=64,
                                        position_ids=_packed(2, 64, seed=9))
        finally:
            os.environ.pop(PAIRS_ENV)
    # the mutation: what crosses ranks (states, conv windows) replaced by zeros -> the comparison must fail, both paths
    for family in ("qwen3_next", "lfm2"):
        for serial in (False, True):
            if serial:
                os.environ[SERIAL_ENV] = "1"
            try:
                with drop_recurrent_state():
                    check_model_equivalence(rank, world_size, "zigzag_ring_attn", family)
            except AssertionError as e:
                assert "relative error" in str(e), str(e)
            else:
                raise AssertionError(f"{family}: dropping the recurrent state exchange went unnoticed "
                                     f"(serial={serial})")
            finally:
                os.environ.pop(SERIAL_ENV, None)


def test_hybrid_models_equal_one_process():
    from tests.harness import run_ranks
    run_ranks(_equivalence_body, 2, args=(False,), timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_hybrid_models_equal_one_process_all_cases(world_size):
    from tests.harness import run_ranks
    run_ranks(_equivalence_body, world_size, args=(True,), timeout=900)


@pytest.mark.parametrize("mode", ["data_parallel", pytest.param("zigzag_ring_attn", marks=pytest.mark.slow)])
def test_document_resets_on_one_process(mode):
    """One process (no process group): packed rows reset the recurrent state at every restart, in data_parallel
    too, and equal each document run alone; unpacked rows equal the plain model."""
    import copy

    from tests.model_equiv import make_batch, per_document_reference, reference_step
    from tests.tols import assert_close
    for family in SUPPORTED:
        ref = build_hybrid(family)
        sp = copy.deepcopy(ref)
        apply_seq_parallel_monkey_patch(mode, sp)
        ids, pos, tgt = make_batch(2, 24, ref.config.vocab_size, seed=2)
        for packed in (False, True):
            p = _packed(2, 24, seed=4) if packed else pos
            want = (per_document_reference if packed else reference_step)(ref, ids, p, tgt)
            got = reference_step(sp, ids, p, tgt)
            tag = f"{family} {mode} packed={packed}"
            assert_close(got[0], want[0], 1e-5, f"{tag} logits")
            assert_close(got[1], want[1], 1e-5, f"{tag} loss")
            for name in want[2]:
                assert_close(got[2][name], want[2][name], 1e-5, f"{tag} grad {name}")
        apply_seq_parallel_monkey_patch("data_parallel", sp)
        if mode != "data_parallel":  # data_parallel keeps the resets; any other mode's wrappers are replaced by them
            assert all("forward" in m.__dict__ for _, m in recurrent_layers(sp))


def test_eval_engine_refuses_unsupported_recurrent_models():
    from easy_context.inference import SeqParallelLM
    with pytest.raises(ValueError, match="JambaMambaMixer"):
        SeqParallelLM(build_hybrid("jamba").eval(), "data_parallel")


# ---------------------------------------------------------------------------------------------- eval engine
def _generate_body(rank, world_size):
    """SeqParallelLM (eval_needle's engine): greedy tokens, teacher-forced argmax and NLL of a hybrid equal
    model.generate / the plain model on one process, for every mode on the world and for one process."""
    from easy_context.inference import SeqParallelLM, sp_group_kwargs
    from tests.tols import assert_close
    for family in ("qwen3_5", "lfm2"):
        model = build_hybrid(family).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # sharper: greedy continuations follow the context
        g = torch.Generator().manual_seed(11)
        ids = torch.randint(2, model.config.vocab_size, (1, 37), generator=g)  # 37: padded to the layout's multiple
        ans = torch.randint(2, model.config.vocab_size, (1, 5), generator=g)
        with torch.no_grad():
            ref_gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
            full = model(torch.cat([ids, ans], 1)).logits[0]
            ref_tf = full[36:41].argmax(-1)
            tgt = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
            ref_nll = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1].double(), ids[0, 1:],
                                                        reduction="sum")
        for mode in ("data_parallel", "zigzag_ring_attn", "ulysses_attn", "usp_attn", "dist_flash_attn"):
            groups = sp_group_kwargs(mode) if mode != "data_parallel" else None
            eng = SeqParallelLM(model, mode, groups=groups)
            tag = f"{family} {mode} W={eng.world}"
            got = eng.generate(ids, 8)
            assert got == ref_gen, f"{tag}: generate {got} != model.generate {ref_gen}"
            assert torch.equal(eng.teacher_forced(ids, ans)[0], ref_tf), tag
            s, c = eng.nll(ids, tgt)
            assert c == 36 and abs(s - float(ref_nll)) <= 1e-5 * float(ref_nll), (tag, s, float(ref_nll))
            eng.close()


def test_eval_engine_generates_like_one_process():
    from tests.harness import run_ranks
    run_ranks(_generate_body, 2, timeout=600)


# ---------------------------------------------------------------------------------------------- train.py
def _hybrid_toy(base: str, family: str) -> dict:
    """The toy corpus with per-document position ids (prepare_data --document-masking) and a tiny hybrid sharing
    its tokenizer, saved like a checkpoint."""
    import os
    import shutil

    from transformers import AutoTokenizer

    from easy_context_train.toy import build_all
    paths = build_all(base, seq_lengths=(128,), n_docs=120, document_masking=True)
    out = os.path.join(base, family)
    shutil.copytree(paths["model"], out, ignore=shutil.ignore_patterns("*.safetensors", "config.json",
                                                                         "generation_config.json"))
    build_hybrid(family, vocab_size=len(AutoTokenizer.from_pretrained(paths["model"])),
                 max_position_embeddings=1024).save_pretrained(out)
    return {"model": out, "data": paths["data_128"]}


@pytest.mark.slow
def test_train_py_hybrid_zigzag_equals_one_process(tmp_path):
    """train.py end to end on CPU (float32, Accelerate's DDP over gloo; ZeRO-3 is covered by
    tests/test_hybrid_zero3.py): a gated-DeltaNet hybrid on packed documents, zigzag on 2 ranks, gives the loss curve
    of one process (data_parallel, which resets the state at the same document starts; its recurrent layers in 3
    tiles, --recurrent-tiles: the memory option's exactness on the user's path)."""
    import os
    import subprocess
    import sys

    from tests import test_train as T
    toy = _hybrid_toy(str(tmp_path / "toy"), "qwen3_5")
    curves = {}
    for nproc, mode in ((1, "data_parallel"), (2, "zigzag_ring_attn")):
        out = tmp_path / mode
        args = ["--model", toy["model"], "--dataset", toy["data"], "--output-dir", str(out), "--parallel_mode", mode,
                *T.COMMON, "--no-save-model", *(["--recurrent-tiles", "3"] if nproc == 1 else [])]
        launcher = [sys.executable] if nproc == 1 else [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(T.free_port())]
        p = subprocess.run([*launcher, os.path.join(T.ROOT, "train.py"), *args], cwd=T.ROOT,
                           env=T._env(ACCELERATE_USE_CPU="true"), capture_output=True, text=True, timeout=900)
        T._ok(p)
        curves[mode] = T.losses(out)
    ref, got = curves["data_parallel"], curves["zigzag_ring_attn"]
    assert len(got) == T.STEPS and all(abs(a - b) <= 1e-5 for a, b in zip(got, ref)), (got, ref)
    assert got[-1] < got[0], got
