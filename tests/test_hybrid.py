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
    from easy_context.recurrent import adapter, supported_classes
    from easy_context.tools.check import main
    supported_classes()  # registers the shipped adapters; then one is taken away (nemotron_h is supported: #30)
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


def _cases(world_size):
    """(mode, layout kwargs, family, packed) for one spawn: every mode x supported family, plain and packed."""
    from easy_context import ParallelLayout
    usp = ParallelLayout.build("usp_attn", ring_degree=2)  # W=2: ring 2 x ulysses 1; W=4: ring 2 x ulysses 2
    modes = [("zigzag_ring_attn", {}), ("ulysses_attn", {}), ("dist_flash_attn", {}),
             ("usp_attn", dict(layout_kw=usp.layout_kw, groups=usp.attn_groups(), sp_group=usp.sp_group))]
    fams = SUPPORTED if world_size == 2 else ("qwen3_next", "lfm2")
    return [(m, kw, f, packed) for m, kw in modes for f in fams for packed in (False, True)]


def _equivalence_body(rank, world_size):
    import os

    from easy_context.recurrent.chain import DROP_STATE_ENV
    from tests.model_equiv import check_model_equivalence
    for mode, kw, family, packed in _cases(world_size):
        pos = _packed(2, 32, seed=3) if packed else None
        check_model_equivalence(rank, world_size, mode, family, position_ids=pos, **kw)
    # the mutation: the states crossing ranks replaced by zeros -> the comparison must fail
    for family in ("qwen3_next", "lfm2"):
        os.environ[DROP_STATE_ENV] = "1"
        try:
            check_model_equivalence(rank, world_size, "zigzag_ring_attn", family)
        except AssertionError as e:
            assert "relative error" in str(e), str(e)
        else:
            raise AssertionError(f"{family}: dropping the recurrent state exchange went unnoticed")
        finally:
            os.environ.pop(DROP_STATE_ENV)


@pytest.mark.parametrize("world_size", [2, 4])
def test_hybrid_models_equal_one_process(world_size):
    from tests.harness import run_ranks
    run_ranks(_equivalence_body, world_size, timeout=900)


@pytest.mark.parametrize("mode", ["data_parallel", "zigzag_ring_attn"])
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


def test_eval_engine_refuses_recurrent_models():
    from easy_context.inference import SeqParallelLM
    with pytest.raises(ValueError, match="Lfm2ShortConv"):
        SeqParallelLM(build_hybrid("lfm2").eval(), "data_parallel")
