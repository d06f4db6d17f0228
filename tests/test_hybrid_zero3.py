"""DeepSpeed ZeRO-3 (every parameter partitioned) with the recurrent layers under SP: gated DeltaNet (qwen3_next),
the short conv (lfm2) and Mamba-2 (nemotron_h) under zigzag at W = 2 on packed rows whose document starts differ
between the ranks (and so do the ranks' pieces), with and without layer checkpointing, through the parallel paths
(issue #30) and through the serial chain (``EASY_CONTEXT_RECURRENT_SERIAL=1``, issue #49): loss and every full
gradient equal one process (each document alone) within 1e-5 (fp32); dropping the exchange fails. And recurrent
tiles (configure_memory's recurrent_tiles, the one-GPU long-context path) under ZeRO-3 with two data-parallel ranks.
DeepSpeed on CPU over gloo (first run JIT-builds ~20 s)."""
from __future__ import annotations

import copy

import pytest
import torch

REL = 1e-5
DS_CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True}


def _starts_per_rank(pos, rank, world_size):
    from easy_context import prepare_seq_parallel_inputs
    local = prepare_seq_parallel_inputs("zigzag_ring_attn", pos, pos, None, rank, world_size,
                                        torch.device("cpu"))["local_position_ids"]
    return int((local == 0).sum())


def _count_runs(route):
    """Count the layers the route ran ("parallel": a parallel path; "serial": the chain) and this rank's pieces."""
    from easy_context.recurrent import chain, conv_parallel, delta_parallel, mamba2_parallel
    runs = {"n": 0, "pieces": set()}
    if route == "serial":
        def chained(plan, *a, _run=chain.chain_forward, **kw):
            runs["n"] += 1
            runs["pieces"].add(sum(p.owner == plan.me for p in plan.pieces))
            return _run(plan, *a, **kw)
        chain.chain_forward = chained
        return runs
    for mod in (conv_parallel, delta_parallel, mamba2_parallel):
        def counted(*a, _run=mod.run_plan):
            out = _run(*a)
            runs["n"] += out is not None
            plan = next(v for v in a if hasattr(v, "pieces"))
            runs["pieces"].add(sum(p.owner == plan.me for p in plan.pieces))
            return out
        mod.run_plan = counted
    return runs


def _step(rank, world_size, family, ref, ids, pos, tgt, checkpointing="none", steps=1, mode="zigzag_ring_attn",
          tiles=1):
    """(loss summed over ranks, {name: full gradient}) of a ZeRO-3 step of the patched copy of ``ref``: the last of
    ``steps`` (lr 0: every step computes the same; from the second on, DeepSpeed prefetches by its recorded trace)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
    from easy_context.memory import causal_lm_loss, configure_memory
    model = copy.deepcopy(ref)
    apply_seq_parallel_monkey_patch(mode, model)
    configure_memory(model, checkpointing, recurrent_tiles=tiles)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=DS_CFG)
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in engine.module.parameters()), "not partitioned"
    sp = mode != "data_parallel"  # data_parallel: this rank's own rows, whole
    p = (prepare_seq_parallel_inputs(mode, ids, pos, tgt, rank, world_size, torch.device("cpu")) if sp else
         {"local_input_ids": ids, "local_position_ids": pos, "local_target_ids": tgt})
    for step in range(steps):
        if step:
            engine.step()
        loss = causal_lm_loss(engine.module, p["local_input_ids"], p["local_position_ids"], p["local_target_ids"])
        engine.backward(loss * world_size)  # ZeRO averages gradients over its ranks (sp or dp)
    total = loss.detach().clone()  # this rank's NLL over the tokens of every rank: the sum is the global mean
    dist.all_reduce(total)
    grads = {name: safe_get_full_grad(prm) for name, prm in engine.module.named_parameters()}
    engine.destroy()
    return total, grads


def _body(rank, world_size, route="parallel"):
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if route == "serial":
        from easy_context.recurrent.exchange import SERIAL_ENV
        os.environ[SERIAL_ENV] = "1"
    import torch.distributed as dist

    from tests.hybrid_models import drop_recurrent_state
    from easy_context.tools.check.rank import packed_positions
    from tests.hybrid_models import build_hybrid
    from tests.model_equiv import make_batch, per_document_reference
    from tests.tols import assert_close
    runs = _count_runs(route)
    pos = packed_positions(2, 32, seed=3)
    starts = [_starts_per_rank(pos, r, world_size) for r in range(world_size)]
    assert len(set(starts)) > 1, f"the ranks hold the same number of document starts: {starts}"
    for family in ("qwen3_next", "lfm2", "nemotron_h"):
        ref = build_hybrid(family)
        ids, _, tgt = make_batch(2, 32, ref.config.vocab_size, seed=5)
        _, ref_loss, ref_grads = per_document_reference(copy.deepcopy(ref), ids, pos, tgt)
        for ck in ("none", "layer"):  # "layer": the recompute in backward runs the exchanges again
            n, tag = runs["n"], f"[zero3 {route} {family} checkpointing={ck}]"
            # the serial chain keeps its submodule calls out of DeepSpeed's trace: a second step (prefetching by the
            # trace of the first) must pair up too
            loss, grads = _step(rank, world_size, family, ref, ids, pos, tgt, ck, steps=2 if route == "serial" else 1)
            assert runs["n"] > n, f"{tag} the {route} route never ran"
            assert_close(loss, ref_loss, REL, f"{tag} loss")
            for name, g in grads.items():
                assert g is not None, f"{tag} no grad for {name}"
                assert_close(g, ref_grads[name], REL, f"{tag} grad {name}")
        with drop_recurrent_state():  # the mutation: the exchange dropped -> some gradient must differ
            loss, grads = _step(rank, world_size, family, ref, ids, pos, tgt)
        off = [n for n, g in grads.items() if (g - ref_grads[n]).norm() > REL * ref_grads[n].norm()]
        assert off, f"{route} {family}: dropping the recurrent exchange went unnoticed under ZeRO-3"
    counts = [None] * world_size
    dist.all_gather_object(counts, sorted(runs["pieces"]))
    assert counts[0] != counts[1], f"every rank held the same number of pieces: {counts}"


@pytest.mark.slow
def test_parallel_recurrent_paths_under_zero3_w2():
    from tests.harness import run_ranks
    run_ranks(_body, world_size=2, timeout=600)


@pytest.mark.slow
def test_serial_chain_under_zero3_w2():
    """The serial chain gathers each recurrent layer once per forward / backward chain (recurrent/zero3.py)."""
    from tests.harness import run_ranks
    run_ranks(_body, world_size=2, args=("serial",), timeout=600)


def _tiles_body(rank, world_size):
    """Two data-parallel ranks, each its own packed rows, ZeRO-3, the recurrent layers in 3 tiles with and without
    layer checkpointing, two steps: each rank's loss equals its rows' one-process reference, every gathered gradient
    the token-weighted mean of the two references' (causal_lm_loss divides by the tokens of every rank); the tiles
    ran."""
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from easy_context.tools.check.rank import packed_positions
    from tests.hybrid_models import build_hybrid
    from tests.model_equiv import make_batch, per_document_reference
    from tests.tols import assert_close
    runs = _count_runs("serial")
    tiles = []
    from easy_context.recurrent import chain
    counted = chain.chain_forward
    chain.chain_forward = lambda plan, *a, **k: tiles.append(len(plan.pieces)) or counted(plan, *a, **k)
    for family in ("qwen3_next", "lfm2", "nemotron_h"):
        ref = build_hybrid(family)
        refs = []
        for r in range(world_size):
            ids, _, tgt = make_batch(2, 32, ref.config.vocab_size, seed=5 + r)
            pos = packed_positions(2, 32, seed=3 + r)
            refs.append((ids, pos, tgt, per_document_reference(copy.deepcopy(ref), ids, pos, tgt)))
        ids, pos, tgt = refs[rank][:3]
        w = [int((r[2] != -100).sum()) for r in refs]
        w = [c / sum(w) for c in w]
        ref_loss = sum(c * r[3][1] for c, r in zip(w, refs))
        mean_grads = {n: sum(c * r[3][2][n] for c, r in zip(w, refs)) for n in refs[0][3][2]}
        for ck in ("none", "layer"):
            n, tag = runs["n"], f"[zero3 dp tiles=3 {family} checkpointing={ck}]"
            tiles.clear()
            loss, grads = _step(rank, world_size, family, ref, ids, pos, tgt, ck, steps=2, mode="data_parallel",
                                tiles=3)
            assert runs["n"] > n and tiles and all(t == 3 for t in tiles), f"{tag} the tiles did not run: {tiles}"
            assert_close(loss, ref_loss, REL, f"{tag} loss")
            for name, g in grads.items():
                assert g is not None, f"{tag} no grad for {name}"
                assert_close(g, mean_grads[name], REL, f"{tag} grad {name}")


@pytest.mark.slow
def test_recurrent_tiles_under_zero3_dp2():
    """The one-GPU long-context path (recurrent tiles, the chain on one process) under ZeRO-3 with dp = 2: DeepSpeed's
    per-module gathers pair up across ranks that run the same tiles on different rows."""
    from tests.harness import run_ranks
    run_ranks(_tiles_body, world_size=2, timeout=600)
