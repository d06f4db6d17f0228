"""Vision-language models under sequence parallelism (easy_context/vlm/, docs/vlm.md): exact against one process.

Every case: a tiny Qwen2.5-VL / Qwen3-VL (/ Qwen3.5) in float32, rows packing documents of text + images + a video
(positions restarting at 0), images cut across ranks; the sequence-parallel logits (gathered, un-cut) within 1e-5
relative and every gradient, the vision tower's included (summed over ranks), within 1e-4 relative of the one-process
reference, which runs Hugging Face's own path on each document alone (its own positions, its own vision encode).
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import run_ranks

# rows of documents: segments ("t", n), ("img", (h, w)), ("vid", (t, h, w)) in patches (merge 2x2 -> h*w/4 tokens)
PACKED = [[[("t", 5), ("img", (4, 4)), ("t", 3), ("vid", (2, 4, 4)), ("t", 4)],
           [("t", 2), ("img", (4, 8)), ("t", 6)],
           [("t", 3), ("img", (8, 4)), ("t", 2), ("img", (4, 4)), ("t", 3)]]]
TWO_ROWS = [[[("t", 3), ("img", (4, 8)), ("t", 5), ("vid", (3, 4, 4)), ("t", 6)]],
            [[("t", 4), ("vid", (2, 4, 8)), ("t", 3)], [("t", 2), ("img", (4, 4)), ("t", 9)]]]


def check_vlm(rank, world, family, mode, rows, ring_degree=None, vision="local", length=None, dispatch=None,
              sp_size=None):
    """One case on the world's ranks (``sp_size``: dp x sp through a ParallelLayout, each dp group its own batch)."""
    import torch.distributed as dist
    from easy_context import ParallelLayout, apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
    from tests.tols import assert_close
    from tests.vlm_models import make_rows, make_vlm, reference

    what = (f"{family} {mode} W={world}" + (f" ring {ring_degree}" if ring_degree else "") + f" vision={vision}"
            + (f" dispatch={dispatch}" if dispatch else "") + (f" sp={sp_size}" if sp_size else ""))
    layout = ParallelLayout.build(mode, sp_size=sp_size, ring_degree=ring_degree) if sp_size else None
    group, sp, sp_rank = (layout.sp_group, layout.sp, layout.sp_rank) if layout else (None, world, rank)
    ref_model = make_vlm(family)
    batch = make_rows(family, rows, pad_to=length, seed=1 + (layout.dp_rank if layout else 0))
    ref_logits, ref_nll = reference(ref_model, batch)
    n = int((batch["targets"] != -100).sum())
    (ref_nll / n).backward()

    model = make_vlm(family)
    kw = {"ring_degree": ring_degree} if ring_degree else {}
    vlm = dict(model=model, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
               pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"], vision=vision,
               second_per_grid_ts=batch["second_per_grid_ts"])
    args = (batch["input_ids"], batch["position_ids"], batch["targets"])
    if layout is not None:
        apply_seq_parallel_monkey_patch(model, layout)
        prepared = layout.prepare_inputs(*args, "cpu", **vlm)
    else:
        apply_seq_parallel_monkey_patch(mode, model, **kw)
        prepared = prepare_seq_parallel_inputs(mode, *args, rank, world, "cpu", dispatch=dispatch, **vlm, **kw)
    assert prepared["local_position_ids"].shape[:2] == (4, batch["input_ids"].shape[0])
    if dispatch or layout is not None:
        assert prepared.model_kwargs.get("sp_dispatch") is not None, f"{what}: packed rows were not dispatched"
    out = model(input_ids=prepared["local_input_ids"], position_ids=prepared["local_position_ids"], use_cache=False,
                **prepared.model_kwargs)
    local = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), prepared["local_target_ids"].flatten(),
                                              ignore_index=-100, reduction="sum")
    (local / n).backward()

    parts = [torch.empty_like(out.logits) for _ in range(sp)]
    dist.all_gather(parts, out.logits.detach().contiguous(), group=group)
    assert_close(prepared.layout.unshard(parts, dim=1), ref_logits, rel=1e-5, name=f"{what}: logits")
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g, group=group)
        assert q.grad is not None, f"{what}: {name} has no reference gradient"
        assert_close(g, q.grad, rel=1e-4, name=f"{what}: grad {name}")
    # the cases cut images across ranks: some unit is encoded by two ranks (and none is lost)
    shard = prepared.model_kwargs["sp_vision"]
    units = torch.tensor([sum(m.units for m in (shard.image, shard.video) if m is not None)])
    dist.all_reduce(units, group=group)
    total = sum(m.total_units for m in (shard.image, shard.video) if m is not None)
    if vision == "local":
        assert total < int(units) < sp * total, f"{what}: {int(units)} units encoded over {sp} ranks of {total}"
    apply_seq_parallel_monkey_patch("data_parallel", model)
    return prepared


def _w2(rank, world):
    for family in ("qwen2_5_vl", "qwen3_vl"):
        check_vlm(rank, world, family, "zigzag_ring_attn", PACKED, length=80)
        check_vlm(rank, world, family, "ulysses_attn", TWO_ROWS, length=72)
    check_vlm(rank, world, "qwen3_vl", "zigzag_ring_attn", TWO_ROWS, vision="all", length=72)
    check_vlm(rank, world, "qwen3_5", "zigzag_ring_attn", PACKED, length=80)  # hybrid: gated DeltaNet + attention


def test_vlm_equal_one_process_w2():
    run_ranks(_w2, world_size=2, timeout=300)


def _qwen35(rank, world):
    check_vlm(rank, world, "qwen3_5", "ulysses_attn", TWO_ROWS, length=72)
    check_vlm(rank, world, "qwen3_5", "zigzag_ring_attn", PACKED, length=80, dispatch="auto")


@pytest.mark.slow
def test_vlm_qwen3_5_hybrid_w2():
    run_ranks(_qwen35, world_size=2, timeout=300)


def _w4(rank, world):
    for family in ("qwen2_5_vl", "qwen3_vl"):
        check_vlm(rank, world, family, "zigzag_ring_attn", PACKED, length=80)
        check_vlm(rank, world, family, "usp_attn", TWO_ROWS, ring_degree=2, length=80)
    check_vlm(rank, world, "qwen2_5_vl", "zigzag_ring_attn", PACKED, length=80, sp_size=2)  # dp 2 x sp 2, dispatched


def _w2_more(rank, world):
    for family in ("qwen2_5_vl", "qwen3_vl"):
        check_vlm(rank, world, family, "dist_flash_attn", TWO_ROWS, length=72)
        check_vlm(rank, world, family, "zigzag_ring_attn", PACKED, length=80, dispatch="auto")
        check_vlm(rank, world, family, "usp_attn", PACKED, ring_degree=1, length=80)
    import os
    os.environ["EASY_CONTEXT_PAIRS_MIN_CHUNK"] = "4"  # packed rows in the k-pair zigzag (k = 80 / (4 * 2 * 4) > 1)
    try:
        prepared = check_vlm(rank, world, "qwen3_vl", "zigzag_ring_attn", PACKED, length=80)
        from easy_context.sharding import layout_pairs
        assert layout_pairs(prepared.layout.positions, 80, world) > 1
    finally:
        del os.environ["EASY_CONTEXT_PAIRS_MIN_CHUNK"]


@pytest.mark.slow
def test_vlm_equal_one_process_w4():
    run_ranks(_w4, world_size=4, timeout=900, collective_timeout=120)


@pytest.mark.slow
def test_vlm_more_modes_w2():
    run_ranks(_w2_more, world_size=2, timeout=600)


def _llava():
    import transformers as tf
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=160)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4)
    with torch.device("meta"):
        return tf.LlavaForConditionalGeneration(tf.LlavaConfig(text_config=tf.LlamaConfig(**text),
                                                               vision_config=tf.CLIPVisionConfig(**vision)))


def test_vlm_patch_routes_the_language_model_only_and_refuses_by_name():
    """No process group: the checks run before any collective."""
    from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
    from easy_context.vlm.positions import token_types
    from tests.vlm_models import IMG, make_rows, make_vlm
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration .*supported VLM families: qwen2_5_vl"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", _llava())
    model = make_vlm("qwen3_vl")
    tower = model.model.visual.config._attn_implementation
    apply_seq_parallel_monkey_patch("ulysses_attn", model)
    assert model.model.language_model.config._attn_implementation.startswith("easy_context_ulysses_attn")
    assert model.model.visual.config._attn_implementation == tower  # the tower keeps its own attention
    batch = make_rows("qwen3_vl", PACKED, pad_to=80)
    ids = batch["input_ids"]
    with pytest.raises(ValueError, match="pixel_values passed to a sequence-parallel VLM"):
        model(input_ids=ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    with pytest.raises(ValueError, match="placeholder tokens but the call carries no sp_vision"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match="without model="):
        prepare_seq_parallel_inputs("ulysses_attn", ids, None, None, 0, 2, "cpu", pixel_values=batch["pixel_values"],
                                    image_grid_thw=batch["image_grid_thw"])
    with pytest.raises(ValueError, match="model=.* is for vision-language models; LlamaForCausalLM"):
        import transformers as tf
        with torch.device("meta"):
            llama = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=4, vocab_size=160))
        prepare_seq_parallel_inputs("ulysses_attn", ids, None, None, 0, 2, "cpu", model=llama)
    with pytest.raises(ValueError, match="image placeholder tokens .* but no image_grid_thw"):
        prepare_seq_parallel_inputs("ulysses_attn", ids, None, None, 0, 2, "cpu", model=model)
    bad = ids.clone()
    bad[0, (bad[0] == IMG).nonzero()[0]] = 5  # one placeholder fewer: a group no longer matches its grid
    with pytest.raises(ValueError, match="placeholder tokens where grid"):
        prepare_seq_parallel_inputs("ulysses_attn", bad, batch["position_ids"], None, 0, 2, "cpu", model=model,
                                    pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                                    pixel_values_videos=batch["pixel_values_videos"],
                                    video_grid_thw=batch["video_grid_thw"])
    apply_seq_parallel_monkey_patch("data_parallel", model)
    assert model.model.language_model.config._attn_implementation == tower
    out = model(input_ids=ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"],
                mm_token_type_ids=token_types(model.config, ids))
    assert out.logits.shape == (1, 80, 160)


# ---------------------------------------------------------------- the Trainer (tests/vlm_trainer_cases.py)
TRAINER_CASES = {  # name -> (family, sp options, lora[, more TrainingArguments])
    "qwen2_5_vl_zigzag": ("qwen2_5_vl", {"mode": "zigzag_ring_attn"}, False, {"evaluate": True}),
    "qwen3_vl_ulysses_lora": ("qwen3_vl", {"mode": "ulysses_attn", "chunked_loss": True}, True),
    "qwen3_vl_zigzag_ckpt": ("qwen3_vl", {"mode": "zigzag_ring_attn"}, False,
                             {"gradient_checkpointing": True, "ddp_find_unused_parameters": False}),
}


def _more(name) -> dict:
    return TRAINER_CASES[name][3] if len(TRAINER_CASES[name]) > 3 else {}


def _trainer_refs(rank, world, root, names):
    from tests import vlm_trainer_cases as tc
    refs = {n: tc.run(TRAINER_CASES[n][0], f"{root}/ref-{n}", lora=TRAINER_CASES[n][2], **_more(n)) for n in names}
    torch.save(refs, f"{root}/refs.pt")


def _trainer_sp(rank, world, root, names):
    from tests import vlm_trainer_cases as tc
    from tests.tols import assert_close
    refs = torch.load(f"{root}/refs.pt")
    for name in names:
        family, sp, lora = TRAINER_CASES[name][:3]
        got, ref = tc.run(family, f"{root}/w{world}-{name}-r{rank}", sp=sp, lora=lora, **_more(name)), refs[name]
        assert len(got["loss"]) == len(ref["loss"]) == tc.STEPS, f"{name}: {got['loss']} vs {ref['loss']}"
        assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rel=1e-4, name=f"{name}: loss curve")
        assert set(got["weights"]) == set(ref["weights"]), f"{name}: trainable parameters differ"
        for k, w in ref["weights"].items():
            assert_close(got["weights"][k], w, rel=1e-4, name=f"{name}: weight {k}")
        if "eval_loss" in ref:
            assert_close(torch.tensor(got["eval_loss"]), torch.tensor(ref["eval_loss"]), rel=1e-5, name=f"{name}: eval")


@pytest.mark.slow  # the SFTTrainer example below is the default run's Trainer case
def test_vlm_trainer_equals_one_process(tmp_path):
    names = list(TRAINER_CASES)
    run_ranks(_trainer_refs, world_size=1, args=(str(tmp_path), names), timeout=300)
    run_ranks(_trainer_sp, world_size=2, args=(str(tmp_path), names), timeout=400)


# ---------------------------------------------------------------- the example, run as written (docs/vlm.md)
VLM_SFT = ["examples/vlm_sft_sp.py", "--tiny"]


def test_vlm_sft_example_equals_one_process(tmp_path):
    """torchrun --nproc_per_node 2 examples/vlm_sft_sp.py --tiny --mode zigzag_ring_attn: trl.SFTTrainer with its
    vision collator (padded rows, images of several sizes) against the same SFTTrainer on one process."""
    from tests.test_examples import _Launch, _results, _same
    ref_launch = _Launch(VLM_SFT + ["--no-sp", "--output-dir", str(tmp_path / "ref")], tmp_path / "ref.pt")
    zz, ref = _results(_Launch(VLM_SFT + ["--mode", "zigzag_ring_attn", "--output-dir", str(tmp_path / "zz")],
                               tmp_path / "zz.pt", nproc=2), ref_launch)
    assert ref["loss"][-1] < ref["loss"][0]  # it trains
    _same(zz, ref, "VLM SFTTrainer zigzag_ring_attn, 2 ranks")


@pytest.mark.slow
def test_vlm_sft_example_ulysses_lora(tmp_path):
    from tests.test_examples import _Launch, _results, _same
    cmd = VLM_SFT + ["--lora-rank", "8"]
    ref_launch = _Launch(cmd + ["--no-sp", "--output-dir", str(tmp_path / "ref")], tmp_path / "ref.pt")
    got, ref = _results(_Launch(cmd + ["--mode", "ulysses_attn", "--output-dir", str(tmp_path / "u")],
                                tmp_path / "u.pt", nproc=2), ref_launch)
    _same(got, ref, "VLM SFTTrainer ulysses_attn, LoRA r8 on the language model, 2 ranks")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_shard_without_placeholders_still_runs_the_tower(family):
    """A rank whose shard holds no image / video token of a batch that has some encodes one unit and keeps none of
    it: the forward is the text-only one and every tower parameter gets a (zero) gradient, so DDP's reducer, which
    waits for every parameter, is not left hanging."""
    from easy_context.vlm.vision import vision_shard
    from tests.vlm_models import make_rows, make_vlm
    model = make_vlm(family)
    batch = make_rows(family, PACKED, pad_to=80)
    ids = batch["input_ids"]
    text = slice(0, 5)  # the first document's leading text
    shard = vision_shard(model.config, ids, lambda t: t[..., text], batch["pixel_values"], batch["image_grid_thw"],
                         batch["pixel_values_videos"], batch["video_grid_thw"])
    assert shard.image.units == shard.video.units == 1 and len(shard.image.take) == len(shard.video.take) == 0
    pos = torch.arange(5).expand(4, 1, 5)
    out = model(input_ids=ids[:, text], position_ids=pos, mm_encoder_outputs=shard.encoder_outputs(model.model))
    plain = model(input_ids=ids[:, text], position_ids=pos)
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)
    out.logits.sum().backward()
    tower = [p.grad for p in model.model.visual.parameters()]
    assert all(g is not None and not bool(g.any()) for g in tower)


def _more_families(rank, world):
    for family in ("qwen2_vl", "qwen3_vl_moe"):
        check_vlm(rank, world, family, "zigzag_ring_attn", PACKED, length=80)
        check_vlm(rank, world, family, "ulysses_attn", TWO_ROWS, length=72)


@pytest.mark.slow
def test_vlm_qwen2_vl_and_qwen3_vl_moe_w2():
    run_ranks(_more_families, world_size=2, timeout=400)
