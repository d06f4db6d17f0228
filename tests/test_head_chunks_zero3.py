"""Head-chunked attention blocks under DeepSpeed ZeRO-3 (every parameter partitioned, threshold 0): the block
gathers its own parameters (the groups slice the weights, bypassing the Linear modules' gather hooks). Zigzag at
W = 2 on packed rows, llama (MHA: one head per group at 4 groups) and qwen3 (GQA, per-head q/k norms), plain and
over offloaded checkpoints (k = 2, two steps), and qwen3 with its q/k norms persistent (ZeRO-3's default for small
parameters) while the projections are partitioned: loss and every full gradient equal one process within 1e-5 (fp32), and equal
ZeRO-3 without groups; afterwards no parameter is left gathered. DeepSpeed on CPU over gloo."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import run_ranks

REL = 1e-5
DS_CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True}


def _step(rank, world_size, ref, ids, pos, tgt, persist=0, steps=1, **memory):
    """(loss summed over ranks, {name: full gradient}) of the last of ``steps`` ZeRO-3 steps (learning rate 0: the
    same step again) of the patched copy of ``ref``; parameters of fewer than ``persist`` elements stay whole
    (stage3_param_persistence_threshold)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
    from easy_context.memory import causal_lm_loss, configure_memory, head_chunks_of
    model = copy.deepcopy(ref)
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    configure_memory(model, **memory)
    assert head_chunks_of(model) == memory.get("head_chunks", 1)
    cfg = copy.deepcopy(DS_CFG)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persist
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=cfg)
    partitioned = {n for n, p in engine.module.named_parameters() if p.ds_numel >= persist}
    assert any("q_proj" in n for n in partitioned), "the projections are not partitioned"
    assert all(p.numel() == 0 for n, p in engine.module.named_parameters() if n in partitioned), "not partitioned"
    p = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, pos, tgt, rank, world_size, torch.device("cpu"))
    for step in range(steps):  # a later step gathers again: nothing may be left gathered by the one before
        if step:
            engine.step()
        loss = causal_lm_loss(engine.module, p["local_input_ids"], p["local_position_ids"], p["local_target_ids"],
                              chunk_size=7)
        engine.backward(loss * world_size)  # ZeRO averages gradients over its (here: the sp) ranks
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {name: safe_get_full_grad(prm) for name, prm in engine.module.named_parameters()}
    assert all(p.numel() == 0 for n, p in engine.module.named_parameters() if n in partitioned), \
        "a gathered parameter was left whole"
    engine.destroy()
    return total, grads


def _body(rank, world_size):
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from easy_context.tools.check.rank import packed_positions
    from tests.model_equiv import build_model, make_batch, per_document_reference
    from tests.tols import assert_close
    for family, heads in (("llama", 4), ("qwen3", 2)):
        ref = build_model(family, num_hidden_layers=3, num_key_value_heads=4)
        ids, _, tgt = make_batch(2, 32, ref.config.vocab_size, labels_mask="random")
        pos = packed_positions(2, 32, seed=3)
        _, ref_loss, ref_grads = per_document_reference(copy.deepcopy(ref), ids, pos, tgt)
        plain = _step(rank, world_size, ref, ids, pos, tgt, checkpointing="layer")
        configs = [dict(checkpointing="layer"), dict(checkpointing="offload", offload_every_k=2, steps=2)]
        if family == "qwen3":  # 16-element q/k norms persistent, 4096-element projections partitioned
            configs.append(dict(checkpointing="layer", persist=100))
        for memory in configs:
            loss, grads = _step(rank, world_size, ref, ids, pos, tgt, head_chunks=heads, **memory)
            tag = f"[{family} {memory} head_chunks={heads} rank {rank}]"
            assert_close(loss, ref_loss, REL, f"{tag} loss")
            assert_close(loss, plain[0], REL, f"{tag} loss vs ZeRO-3 without groups")
            for name, g in grads.items():
                assert g is not None, f"{tag} no gradient for {name}"
                assert_close(g, ref_grads[name], REL, f"{tag} grad {name}")
                assert_close(g, plain[1][name], REL, f"{tag} grad {name} vs ZeRO-3 without groups")


@pytest.mark.slow  # ~36 s; head groups exact in test_head_chunks.py / test_memory.py
def test_head_chunks_under_zero3_w2():
    run_ranks(_body, 2)


def test_gathers_are_left_once_when_gradients_accumulate_or_at_the_next_call():
    """The release logic alone (no DeepSpeed): the gathers are left after the last parameter's gradient accumulates,
    exactly once; a backward that accumulates nothing leaves them pending until the block's next call releases them."""
    from easy_context.memory.head_chunks import _PENDING, _release_pending, _release_when_accumulated

    class Gather:
        exits = 0

        def __exit__(self, *exc):
            Gather.exits += 1
    attn = torch.nn.Module()
    a, b = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    _release_when_accumulated(attn, [Gather(), Gather()], [a, b])
    assert Gather.exits == 0 and _PENDING in attn.__dict__
    (a.sum() * 2).backward()
    assert Gather.exits == 0  # b has not accumulated yet
    b.sum().backward()
    assert Gather.exits == 2 and _PENDING not in attn.__dict__
    (a.sum() + b.sum()).backward()  # the hooks are gone
    assert Gather.exits == 2
    _release_when_accumulated(attn, [Gather()], [a])
    torch.autograd.grad(a.sum(), [a])  # nothing accumulates: still held
    assert Gather.exits == 2
    _release_pending(attn)
    assert Gather.exits == 3 and _PENDING not in attn.__dict__
    a.sum().backward()
    assert Gather.exits == 3
