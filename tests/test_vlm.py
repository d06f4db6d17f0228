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


def check_vlm(rank, world, family, mode, rows, ring_degree=None, vision="local", length=None):
    import torch.distributed as dist
    from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
    from tests.tols import assert_close
    from tests.vlm_models import make_rows, make_vlm, reference

    what = f"{family} {mode} W={world}" + (f" ring {ring_degree}" if ring_degree else "") + f" vision={vision}"
    ref_model = make_vlm(family)
    batch = make_rows(family, rows, pad_to=length)
    ref_logits, ref_nll = reference(ref_model, batch)
    n = int((batch["targets"] != -100).sum())
    (ref_nll / n).backward()

    model = make_vlm(family)
    kw = {"ring_degree": ring_degree} if ring_degree else {}
    apply_seq_parallel_monkey_patch(mode, model, **kw)
    prepared = prepare_seq_parallel_inputs(
        mode, batch["input_ids"], batch["position_ids"], batch["targets"], rank, world, "cpu", model=model,
        pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
        pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"], vision=vision, **kw)
    out = model(input_ids=prepared["local_input_ids"], position_ids=prepared["local_position_ids"], use_cache=False,
                **prepared.model_kwargs)
    local = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), prepared["local_target_ids"].flatten(),
                                              ignore_index=-100, reduction="sum")
    (local / n).backward()

    parts = [torch.empty_like(out.logits) for _ in range(world)]
    dist.all_gather(parts, out.logits.detach().contiguous())
    assert_close(prepared.layout.unshard(parts, dim=1), ref_logits, rel=1e-5, name=f"{what}: logits")
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        assert q.grad is not None, f"{what}: {name} has no reference gradient"
        assert_close(g, q.grad, rel=1e-4, name=f"{what}: grad {name}")
    # the cases cut images across ranks: some unit is encoded by two ranks (and none is lost)
    shard = prepared.model_kwargs["sp_vision"]
    units = torch.tensor([sum(m.units for m in (shard.image, shard.video) if m is not None)])
    dist.all_reduce(units)
    total = sum(m.total_units for m in (shard.image, shard.video) if m is not None)
    if vision == "local":
        assert total < int(units) < world * total, f"{what}: {int(units)} units encoded over {world} ranks of {total}"
    apply_seq_parallel_monkey_patch("data_parallel", model)
    return prepared


def _w2(rank, world):
    for family in ("qwen2_5_vl", "qwen3_vl"):
        check_vlm(rank, world, family, "zigzag_ring_attn", PACKED, length=80)
        check_vlm(rank, world, family, "ulysses_attn", TWO_ROWS, length=72)
    check_vlm(rank, world, "qwen3_vl", "zigzag_ring_attn", TWO_ROWS, vision="all", length=72)


def test_vlm_equal_one_process_w2():
    run_ranks(_w2, world_size=2, timeout=300)
