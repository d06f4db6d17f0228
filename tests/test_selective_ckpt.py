"""Selective checkpointing (easy_context/memory/selective.py): same loss and grads as no checkpointing,
in every mode, and the attention forward (with its communication) runs once per layer, never again in
the backward's recomputation.

Tiers: single process (data_parallel, plain SDPA; counts SDPA calls), multi-rank CPU (one gloo spawn:
dist_flash_attn = lean path, zigzag / ulysses = generic path; counts P2P and all-to-all calls).
"""
from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from easy_context.memory.selective import (_hf_enable, _LayerCache, disable_selective_checkpointing,
                                           enable_selective_checkpointing, is_selective)
from tests.harness import run_ranks
from tests.model_equiv import build_model, make_batch, reference_step
from tests.tols import assert_close


@contextlib.contextmanager
def counting(module, name, counts, key=None):
    """Count calls of ``module.name`` into ``counts[key or name]``."""
    orig = getattr(module, name)
    key = key or name

    def wrapper(*a, **kw):
        counts[key] = counts.get(key, 0) + 1
        return orig(*a, **kw)
    setattr(module, name, wrapper)
    try:
        yield counts
    finally:
        setattr(module, name, orig)


def _set_checkpointing(model, kind):
    if kind == "layer":
        _hf_enable(model, {"use_reentrant": False})
    elif kind == "selective":
        enable_selective_checkpointing(model)
    elif kind == "selective_reentrant":
        enable_selective_checkpointing(model, {"use_reentrant": True})
    elif kind != "none":
        raise ValueError(kind)


def _live_caches():
    gc.collect()
    return sum(type(o) is _LayerCache for o in gc.get_objects())


# ----------------------------------------------------------------------------------------------
# single process: data_parallel (plain attention)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_data_parallel_equal_to_no_checkpointing(family):
    ref = build_model(family)
    layers = ref.config.num_hidden_layers
    batch = make_batch(2, 32, ref.config.vocab_size, labels_mask="random")
    want_logits, want_loss, want_grads = reference_step(copy.deepcopy(ref), *batch)
    for kind, sdpa_calls in (("none", layers), ("layer", 2 * layers), ("selective", layers),
                             ("selective_reentrant", layers)):
        model = copy.deepcopy(ref)
        _set_checkpointing(model, kind)
        counts = {}
        with counting(F, "scaled_dot_product_attention", counts, "sdpa"):
            logits, loss, grads = reference_step(model, *batch)
        tag = f"[{family} {kind}]"
        assert counts["sdpa"] == sdpa_calls, f"{tag} attention ran {counts['sdpa']} times, want {sdpa_calls}"
        assert_close(logits, want_logits, name=f"{tag} logits")
        assert_close(loss, want_loss, name=f"{tag} loss")
        for name in want_grads:
            assert_close(grads[name], want_grads[name], name=f"{tag} grad {name}")
        del logits, loss, grads
        assert _live_caches() == 0, f"{tag}: per-layer caches outlive the step"


def test_some_layers_only():
    """``layers=`` keeps attention outputs of the chosen layers only (the 512K bench spends its spare GPU memory
    so); the others recompute attention. Also on top of nested offload (k=2), where a group's first layer is
    recomputed twice; and re-enabling with other layers unwraps the ones dropped."""
    from easy_context.memory import configure_memory
    ref = build_model("llama", num_hidden_layers=4)
    batch = make_batch(2, 32, ref.config.vocab_size, labels_mask="random")
    want_logits, want_loss, want_grads = reference_step(copy.deepcopy(ref), *batch)
    for how, sdpa_calls in (("layer", 4 + 3), ("nested", 4 + 3 + 2 - 1)):
        model = copy.deepcopy(ref)
        if how == "layer":
            enable_selective_checkpointing(model, layers=[0, 2])
            enable_selective_checkpointing(model, layers=[1])  # 0 and 2 back to plain checkpointing
        else:  # groups (0,1), (2,3): layers 0 and 2 run forward 3 times without selective; keep layer 0's output
            configure_memory(model, "nested", offload_every_k=2, selective=True, selective_layers=[0])
        counts = {}
        with counting(F, "scaled_dot_product_attention", counts, "sdpa"):
            logits, loss, grads = reference_step(model, *batch)
        assert counts["sdpa"] == sdpa_calls, f"[{how}] attention ran {counts['sdpa']} times, want {sdpa_calls}"
        assert_close(logits, want_logits, name=f"[{how}] logits")
        assert_close(loss, want_loss, name=f"[{how}] loss")
        for name in want_grads:
            assert_close(grads[name], want_grads[name], name=f"[{how}] grad {name}")
    with pytest.raises(ValueError, match="out of range"):
        enable_selective_checkpointing(build_model("llama"), layers=[5])
    with pytest.raises(ValueError, match="needs selective=True"):
        configure_memory(build_model("llama"), "layer", selective_layers=[0])


def test_enable_disable_and_eval():
    model = build_model("llama")
    layers = model.model.layers
    enable_selective_checkpointing(model)
    enable_selective_checkpointing(model)  # idempotent: wraps once
    assert is_selective(model)
    base = layers[0]._gradient_checkpointing_func._easy_context_selective_base
    assert not hasattr(base, "_easy_context_selective_base")
    # eval / no_grad runs the plain forward (nothing checkpointed, nothing cached)
    ids, pos, _ = make_batch(1, 16, model.config.vocab_size)
    model.eval()
    with torch.inference_mode():
        model(ids, position_ids=pos, use_cache=False)
    model.train()
    disable_selective_checkpointing(model)  # it was off before: off again
    assert not is_selective(model) and not any(m.gradient_checkpointing for m in layers)
    # on top of existing per-layer checkpointing: disable goes back to it
    _hf_enable(model, {"use_reentrant": False})
    plain = layers[0]._gradient_checkpointing_func
    enable_selective_checkpointing(model)
    assert is_selective(model)
    disable_selective_checkpointing(model)
    assert layers[0].gradient_checkpointing and layers[0]._gradient_checkpointing_func is plain
    with pytest.raises(ValueError, match="GradientCheckpointingLayer"):
        enable_selective_checkpointing(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------------------------
# multi-rank: every sequence-parallel mode, communication counted
# ----------------------------------------------------------------------------------------------
def _comm_counts(rank, world_size, seq_algo, family, kind):
    """Run the model-equivalence check with checkpointing ``kind``; return the P2P/all-to-all call counts."""
    import easy_context.dist_flash_attn.attention as A
    from easy_context import kernels
    from tests.model_equiv import check_model_equivalence
    counts = {}
    with contextlib.ExitStack() as st:
        st.enter_context(counting(dist, "batch_isend_irecv", counts, "p2p"))
        st.enter_context(counting(dist, "all_to_all", counts, "a2a"))
        st.enter_context(counting(dist, "all_to_all_single", counts, "a2a"))
        st.enter_context(counting(A, "dist_flash_attn_forward", counts, "dist_flash_forward"))
        st.enter_context(counting(kernels, "attn_forward", counts, "kernel_fwd"))
        check_model_equivalence(rank, world_size, seq_algo, family, seq_len=8 * world_size,
                                labels_mask="random", prepare_sp_model=lambda m: _set_checkpointing(m, kind))
    return counts


def _multi_rank_body(rank, world_size):
    layers = 2
    ran = []
    for seq_algo in ("dist_flash_attn", "zigzag_ring_attn", "ulysses_attn"):  # all three take the lean path
        ran.append(seq_algo)
        none = _comm_counts(rank, world_size, seq_algo, "llama", "none")
        layer = _comm_counts(rank, world_size, seq_algo, "llama", "layer")
        assert sum(layer.values()) > sum(none.values()), f"{seq_algo}: counting sees no recompute {layer}"
        for kind in ("selective", "selective_reentrant"):
            got = _comm_counts(rank, world_size, seq_algo, "llama", kind)
            want = dict(none)
            if seq_algo == "ulysses_attn":
                # the replay re-shards the recomputed q/k/v and the kept output: 2 all-to-alls per layer,
                # but the attention kernels themselves never run again
                want["a2a"] = none["a2a"] + 2 * layers
            assert got == want, f"{seq_algo} {kind}: communication {got}, want {want} (no checkpointing: {none})"
        if seq_algo == "dist_flash_attn":
            assert none["dist_flash_forward"] == layers and layer["dist_flash_forward"] == 2 * layers
    assert ran[0] == "dist_flash_attn" and len(ran) >= 2, ran
    from easy_context.parallel_layout import ParallelLayout
    from tests.model_equiv import check_model_equivalence

    def selective(m):
        _set_checkpointing(m, "selective")
    # another family through the lean path
    check_model_equivalence(rank, world_size, "dist_flash_attn", "qwen2", seq_len=8 * world_size,
                            prepare_sp_model=selective)
    # usp (ring 1 x ulysses 2): the all-to-all around a ring, lean as well
    lay = ParallelLayout.build("usp_attn", ring_degree=1)
    check_model_equivalence(rank, world_size, "usp_attn", "llama", seq_len=8 * world_size,
                            groups=lay.attn_groups("usp_attn"), layout_kw={"ring_degree": 1},
                            labels_mask="random", prepare_sp_model=selective)


def test_sequence_parallel_modes_two_ranks():
    run_ranks(_multi_rank_body, world_size=2, timeout=240)
