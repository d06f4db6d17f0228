"""Memory options (chunked loss, tiled MLP, layer/offload/nested/selective checkpointing) are exact.

Each option alone and combined gives the same loss and gradients (float32, 1e-5 relative) as the plain
single-process model with HF logits + cross-entropy: in-process (W=1) and on 2 gloo ranks for every
sequence-parallel mode that is available.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
from easy_context.memory import (causal_lm_loss, chunked_lm_loss, configure_memory, lm_head_loss, tile_mlp,
                                 untile_mlp)
from easy_context.loss import ChunkedLMLoss
from easy_context.ops import apply_fused_ops, remove_fused_ops
from tests.harness import run_ranks
from tests.model_equiv import build_model, make_batch, reference_step
from tests.tols import assert_close

REL = 1e-5


# (checkpointing, offload_every_k, tiled_mlp, selective, fused): alone and combined; fused = lean RMSNorm +
# fused RoPE (easy_context.ops), so those are checked in every mode at W=2 and under ZeRO-3 too
CONFIGS = [("none", 1, False), ("layer", 1, False), ("offload", 1, False), ("offload", 3, False),
           ("nested", 2, False), ("none", 1, 3), ("layer", 1, 4), ("none", 1, False, False, True),
           ("offload", 2, 5, False, True), ("nested", 3, True, False, True),
           ("selective", 1, False), ("selective", 1, 3), ("offload", 2, 3, True, True)]


def _configure(model, ck, k, tiles, selective=False, fused=False, head_chunks=1):
    remove_fused_ops(model)
    cfg = configure_memory(model, ck, offload_every_k=k, tiled_mlp=tiles, selective=selective, lean_norm=fused,
                           head_chunks=head_chunks)
    if fused:
        assert apply_fused_ops(model, norms=False, rope=True)["rope"] == model.config.num_hidden_layers
    return cfg


# --------------------------------------------------------------------------------------------------
# chunked LM loss
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,chunk", [(37, 8), (37, 37), (37, 100), (5, 1)])
def test_chunked_loss_matches_cross_entropy(n, chunk):
    g = torch.Generator().manual_seed(n * 7 + chunk)
    d, v = 16, 53
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < 0.3] = -100
    nll, count = chunked_lm_loss(hidden, weight, targets, chunk_size=chunk)
    (nll * 0.37).backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100, reduction="sum")
    (ref * 0.37).backward()
    assert int(count) == int((targets != -100).sum())
    assert_close(nll, ref, 1e-10, "nll")
    assert_close(gh, hidden.grad, 1e-10, "d hidden")
    assert_close(gw, weight.grad, 1e-10, "d weight")


def test_chunked_loss_all_ignored_is_zero_not_nan():
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    targets = torch.full((2, 6), -100)
    nll, count = chunked_lm_loss(hidden, weight, targets, chunk_size=4)
    assert nll.item() == 0.0 and count.item() == 0
    nll.backward()
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_chunked_loss_never_builds_full_logits(monkeypatch):
    """Every logits block (forward and backward) has at most chunk_size rows."""
    n, d, v, chunk = 64, 8, 32, 16
    seen = []
    real_matmul = torch.Tensor.__matmul__

    def spy(a, b):
        out = real_matmul(a, b)
        if out.dim() == 2 and out.shape[-1] == v:
            seen.append(out.shape[0])
        return out
    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(v, d, requires_grad=True)
    nll, _ = ChunkedLMLoss.apply(hidden, weight, torch.randint(0, v, (n,)), chunk, -100)
    nll.backward()
    assert seen and max(seen) <= chunk, seen


def test_chunked_loss_validation():
    with pytest.raises(ValueError, match="lm_head_weight must be"):
        chunked_lm_loss(torch.randn(3, 8), torch.randn(8, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets shape"):
        chunked_lm_loss(torch.randn(3, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long))


def test_one_loss_module():
    """easy_context.loss owns the losses; easy_context.memory re-exports the same objects, and the eval helper's
    chunked NLL equals the training chunked loss (same chunk rule)."""
    from easy_context import inference, loss, memory
    for name in ("causal_lm_loss", "chunked_lm_loss", "lm_head_loss", "global_token_count"):
        assert getattr(memory, name) is getattr(loss, name)
    assert inference.IGNORE_INDEX == loss.IGNORE_INDEX == -100
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 9, 8, generator=g, dtype=torch.float64), torch.randn(13, 8, generator=g,
                                                                                         dtype=torch.float64)
    targets = torch.randint(0, 13, (2, 9), generator=g)
    targets[0, :4] = -100
    ref, n = chunked_lm_loss(hidden, weight, targets, chunk_size=5)
    s, c = loss.chunked_nll_sum(lambda h: h @ weight.t(), hidden, targets, 13, chunk_size=5)
    assert int(c) == int(n) == 14
    assert_close(s, ref, rel=1e-6, name="chunked_nll_sum")  # fp32 logits (token_nll_sum), fp64 reference


def test_lm_head_loss_runs_inside_module_forward_hooks():
    """ZeRO-3/FSDP gather the head weight in module hooks: the loss must run inside lm_head's call."""
    head = torch.nn.Linear(8, 13, bias=False)
    calls = []
    head.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    head.register_forward_hook(lambda m, a, o: calls.append("post"))
    nll, count = lm_head_loss(head, torch.randn(5, 8), torch.randint(0, 13, (5,)), chunk_size=2)
    assert calls == ["pre", "post"] and "forward" not in head.__dict__ and count.item() == 5
    assert head(torch.randn(2, 8)).shape == (2, 13)  # plain forward restored


# --------------------------------------------------------------------------------------------------
# tiled MLP
# --------------------------------------------------------------------------------------------------
def test_tiled_mlp_exact_and_keeps_state_dict_keys():
    from transformers.models.llama.modeling_llama import LlamaMLP
    model = build_model("llama")
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 19, 64, requires_grad=True)
    ref = mlp(x)
    ref.square().sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    keys = list(model.state_dict())
    for tiles in (1, 4, 19, 50, "auto"):
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        tile_mlp(mlp, tiles)
        assert isinstance(mlp, LlamaMLP) and list(model.state_dict()) == keys
        out = mlp(x)
        assert out.shape == ref.shape
        out.square().sum().backward()
        assert_close(out, ref, REL, f"tiles={tiles} out")
        for a, e in zip([x.grad] + [p.grad for p in mlp.parameters()], ref_grads):
            assert_close(a, e, REL, f"tiles={tiles} grad")
    untile_mlp(mlp)
    assert type(mlp) is LlamaMLP


_NORMS = [("llama", "LlamaRMSNorm"), ("lfm2", "Lfm2RMSNorm"), ("qwen3_5", "Qwen3_5RMSNorm"),
          ("qwen3_next", "Qwen3NextRMSNorm"), ("gemma3", "Gemma3RMSNorm")]  # the last three: the (1 + w) form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("module,name", _NORMS)
def test_lean_rmsnorm_matches_hf(dtype, module, name):
    import importlib

    from easy_context.ops.lean_norm import lean_norm, unlean_norm
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    torch.manual_seed(0)
    norm = cls(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5) if float(norm.weight.detach().float().abs().sum()) == 0 else \
            norm.weight.uniform_(0.5, 1.5)  # (1 + w) norms start at w = 0
    x = torch.randn(2, 9, 64, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 9, 64, dtype=dtype)
    ref = norm(x)
    ref.backward(dy)
    ref_g = (x.grad.clone(), norm.weight.grad.clone())
    x.grad = norm.weight.grad = None
    lean_norm(norm)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = norm(x)
    out.backward(dy)
    assert torch.equal(out, ref), "forward must be bit-identical"
    assert not any(t.dtype == torch.float32 and t.shape == x.shape for t in saved if dtype != torch.float32), \
        "the lean norm kept an fp32 copy of its input"
    rel = REL if dtype == torch.float32 else 2e-2
    assert_close(x.grad, ref_g[0], rel, "d x")
    assert_close(norm.weight.grad, ref_g[1], rel, "d weight")
    assert type(unlean_norm(norm)) is cls


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "lfm2", "gemma3"])
def test_lean_norms_exact_on_hybrid_and_plus_one_families(family):
    """configure_memory(lean_norm=True) on the families whose norms joined (Qwen3.5 / Qwen3-Next / Gemma 3: the
    (1 + w) form; LFM2): every RMSNorm of the model swapped, loss and every gradient equal the plain model's."""
    from easy_context.ops.lean_norm import LeanRMSNormMixin
    from tests.hybrid_models import build_hybrid
    ref = build_model(family) if family == "gemma3" else build_hybrid(family)
    model = copy.deepcopy(ref)
    ids, pos, tgt = make_batch(2, 24, ref.config.vocab_size)
    _, ref_loss, ref_grads = reference_step(ref, ids, pos, tgt)
    configure_memory(model, "layer", lean_norm=True)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") or isinstance(m, LeanRMSNormMixin)]
    assert norms and all(isinstance(m, LeanRMSNormMixin) for m in norms), \
        [type(m).__name__ for m in norms if not isinstance(m, LeanRMSNormMixin)]
    _, loss, grads = reference_step(model, ids, pos, tgt)
    assert_close(loss, ref_loss, REL, f"{family} loss")
    for name, g in grads.items():
        assert_close(g, ref_grads[name], REL, f"{family} grad {name}")


def test_configure_memory_validation():
    model = build_model("llama")
    with pytest.raises(ValueError, match="checkpointing must be one of"):
        configure_memory(model, "everything")
    with pytest.raises(ValueError, match="offload_every_k"):
        configure_memory(model, "offload", offload_every_k=0)


# --------------------------------------------------------------------------------------------------
# whole model, W=1
# --------------------------------------------------------------------------------------------------
def _our_step(model, input_ids, position_ids, target_ids, group=None):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, input_ids, position_ids, target_ids, group=group, chunk_size=7)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_every_option_is_exact_single_process():
    ref = build_model("llama", num_hidden_layers=4)
    model = copy.deepcopy(ref)
    ids, pos, tgt = make_batch(2, 24, ref.config.vocab_size, labels_mask="random")
    _, ref_loss, ref_grads = reference_step(ref, ids, pos, tgt)
    for cfg in CONFIGS:
        _configure(model, *cfg)
        loss, grads = _our_step(model, ids, pos, tgt)
        tag = f"[W=1 {cfg}]"
        assert_close(loss, ref_loss, REL, f"{tag} loss")
        for name, g in grads.items():
            assert_close(g, ref_grads[name], REL, f"{tag} grad {name}")
    # host chunks smaller than a layer input (and not a multiple of the element size), reused over
    # two steps: still exact
    from easy_context.memory.offload import HostPool
    model._easy_context_host_pool = HostPool(chunk_bytes=1000)
    configure_memory(model, "offload", offload_every_k=2, tiled_mlp=3)
    for _ in range(2):
        loss, grads = _our_step(model, ids, pos, tgt)
    assert model._easy_context_host_pool.nbytes() >= 2 * 24 * 64 * 4  # chunks came back to the pool
    assert_close(loss, ref_loss, REL, "repeat loss")
    for name, g in grads.items():
        assert_close(g, ref_grads[name], REL, f"repeat grad {name}")


def test_offload_replays_dropout_exactly():
    """RNG state is replayed in the recompute: with attention dropout the gradients still match layer ckpt."""
    ref = build_model("llama", num_hidden_layers=3, attention_dropout=0.3, attn_implementation="eager")
    model = copy.deepcopy(ref)
    ids, pos, tgt = make_batch(1, 16, ref.config.vocab_size)
    results = []
    for m, ck in ((ref, "layer"), (model, "offload")):
        configure_memory(m, ck, offload_every_k=2)
        torch.manual_seed(5)
        results.append(_our_step(m, ids, pos, tgt))
    assert_close(results[1][0], results[0][0], REL, "dropout loss")
    for name, g in results[1][1].items():
        assert_close(g, results[0][1][name], REL, f"dropout grad {name}")


# --------------------------------------------------------------------------------------------------
# W=2, every available sequence-parallel mode
# --------------------------------------------------------------------------------------------------
def _sp_body(rank, world_size, plan):
    """plan: [(mode, configs)]; the first mode also runs the case where only rank 0 has valid targets."""
    ref = build_model("llama", num_hidden_layers=4)
    seq, checked = 32, 0
    for mask in ("random", "one_rank"):
        if mask == "one_rank":  # every valid target on rank 0's tokens: rank 1's loss is 0, not NaN
            valid = torch.zeros(2, seq, dtype=torch.bool)
            held = prepare_seq_parallel_inputs(plan[0][0], torch.arange(seq)[None], torch.arange(seq)[None],
                                               None, 0, world_size, torch.device("cpu"))["local_input_ids"]
            valid[:, held[0]] = True
            ids, pos, tgt = make_batch(2, seq, ref.config.vocab_size, labels_mask=valid)
        else:
            ids, pos, tgt = make_batch(2, seq, ref.config.vocab_size, labels_mask="random")
        _, ref_loss, ref_grads = reference_step(copy.deepcopy(ref), ids, pos, tgt)
        for mode, configs in plan if mask == "random" else plan[:1]:
            model = apply_seq_parallel_monkey_patch(mode, copy.deepcopy(ref))
            p = prepare_seq_parallel_inputs(mode, ids, pos, tgt, rank, world_size, torch.device("cpu"))
            _run_configs(model, mode, mask, p, configs, rank, world_size, ref_loss, ref_grads)
            checked += len(configs)
    assert checked == sum(len(c) for _, c in plan) + len(plan[0][1]), checked
    _check_nested_attention_runs(ref, rank, world_size)


def _check_nested_attention_runs(ref, rank, world_size):
    """Nested groups keep what their rebuild computed: each layer's attention runs twice per step (forward + one
    recompute), not three times for a group's inner layers; the gradients stay those of plain checkpointing."""
    from easy_context.zigzag_ring_attn import attention as zz
    mode = "zigzag_ring_attn"
    ids, pos, tgt = make_batch(1, 32, ref.config.vocab_size, labels_mask="random")
    p = prepare_seq_parallel_inputs(mode, ids, pos, tgt, rank, world_size, torch.device("cpu"))
    model = apply_seq_parallel_monkey_patch(mode, copy.deepcopy(ref))
    real, calls = zz.zigzag_ring_forward, []
    zz.zigzag_ring_forward = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    got = {}
    try:
        for k, keep in ((2, False), (2, True), (3, False), (3, True)):
            configure_memory(model, "nested", offload_every_k=k, keep_nested_attention=keep)
            calls.clear()
            got[k, keep] = _our_step(model, p["local_input_ids"], p["local_position_ids"], p["local_target_ids"])
            got[k, keep] = (*got[k, keep], len(calls))
    finally:
        zz.zigzag_ring_forward = real
    n = ref.config.num_hidden_layers  # 4: groups (0, 1), (2, 3) at k=2; (0, 1, 2), (3) at k=3
    assert [got[k, keep][2] for k, keep in sorted(got)] == [2 * n + 2, 2 * n, 2 * n + 2, 2 * n], got
    for (k, keep), (loss, grads, _) in got.items():
        assert_close(loss, got[2, False][0], 1e-6, f"nested k={k} keep={keep} loss")
        for name, g in grads.items():
            assert_close(g, got[2, False][1][name], 1e-6, f"nested k={k} keep={keep} grad {name}")


def _run_configs(model, mode, mask, p, configs, rank, world_size, ref_loss, ref_grads):
    for cfg in configs:
        _configure(model, *cfg)
        loss, grads = _our_step(model, p["local_input_ids"], p["local_position_ids"],
                                p["local_target_ids"])
        tag = f"[{mode} W={world_size} rank {rank} {cfg} mask={mask}]"
        assert torch.isfinite(loss), f"{tag} loss {loss}"
        dist.all_reduce(loss)
        assert_close(loss, ref_loss, REL, f"{tag} loss")
        for name, g in grads.items():
            dist.all_reduce(g)
            assert_close(g, ref_grads[name], REL, f"{tag} grad {name}")


def test_every_option_is_exact_with_sequence_parallel_w2():
    modes = ["zigzag_ring_attn", "ulysses_attn", "dist_flash_attn", "usp_attn"]
    # zigzag gets every config; the other modes combined ones (each option is mode-agnostic code)
    combined = [("offload", 2, 3, False, True), ("layer", 1, True)]
    # head-chunked attention blocks (memory/head_chunks.py; a mode's attention needed, so not in CONFIGS' W=1 run):
    # 2 groups of 2 q heads / 1 kv head, nested + selective, and plain layer checkpointing
    heads = [("offload", 2, 3, True, True, 2), ("layer", 1, False, False, False, 2)]
    plan = [("zigzag_ring_attn", CONFIGS + heads)] + [(m, combined + heads) for m in modes[1:]]
    run_ranks(_sp_body, world_size=2, args=(plan,), timeout=240)


# --------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 (partitioned parameters), W=2 zigzag on CPU
# --------------------------------------------------------------------------------------------------
def _zero3_body(rank, world_size):
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    ref = build_model("llama", num_hidden_layers=3)
    ids, pos, tgt = make_batch(1, 32, ref.config.vocab_size, labels_mask="random")
    _, ref_loss, ref_grads = reference_step(copy.deepcopy(ref), ids, pos, tgt)
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    p = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, pos, tgt, rank, world_size, torch.device("cpu"))
    for cfg in [("offload", 2, 3, False, True), ("layer", 1, 4)]:
        model = copy.deepcopy(ref)
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
        try:
            _configure(model, *cfg)
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                              config=ds_cfg)
            loss = causal_lm_loss(engine.module, p["local_input_ids"], p["local_position_ids"],
                                  p["local_target_ids"])
            engine.backward(loss * world_size)  # ZeRO averages gradients over its (here: the sp) ranks
            total = loss.detach().clone()
            dist.all_reduce(total)
            assert_close(total, ref_loss, REL, f"[zero3 {cfg}] loss")
            for name, prm in engine.module.named_parameters():
                g = safe_get_full_grad(prm)
                assert g is not None, f"[zero3 {cfg}] no grad for {name}"
                assert_close(g, ref_grads[name], REL, f"[zero3 {cfg}] grad {name}")
        finally:
            apply_seq_parallel_monkey_patch("data_parallel", "llama")


@pytest.mark.slow
def test_options_under_deepspeed_zero3_w2():
    """Partitioned lm_head / MLP weights are gathered through module hooks (first run JIT-builds ~20 s)."""
    run_ranks(_zero3_body, world_size=2, timeout=300)


# --------------------------------------------------------------------------------------------------
# CUDA: side-stream offload copies, registered host chunks, prefetch
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_offload_on_cuda_matches_layer_checkpointing():
    from easy_context.memory.offload import HostPool
    ref = build_model("llama", num_hidden_layers=5, hidden_size=256, intermediate_size=512).cuda()
    model = copy.deepcopy(ref)
    ids, pos, tgt = (t.cuda() for t in make_batch(1, 2048, ref.config.vocab_size, labels_mask="random"))
    configure_memory(ref, "layer")
    ref_loss, ref_grads = _our_step(ref, ids, pos, tgt)
    model._easy_context_host_pool = HostPool(chunk_bytes=1_000_003)  # several chunks per layer input
    for cfg in [("offload", 1, False), ("offload", 2, 4, False, True), ("nested", 3, "auto", False, True)]:
        _configure(model, *cfg)
        for _ in range(2):  # the second step reuses the pinned chunks
            loss, grads = _our_step(model, ids, pos, tgt)
        assert_close(loss, ref_loss, 1e-4, f"[cuda {cfg}] loss")  # GPU reductions are not bit-stable
        for name, g in grads.items():
            assert_close(g, ref_grads[name], 1e-4, f"[cuda {cfg}] grad {name}")
    # the timeline of one more step: every layer's compute, its copies each way, and the stalls, hidden or not
    from bench.offload_timeline import Timeline
    configure_memory(model, "offload", offload_every_k=1)
    model._easy_context_offload.timeline = tl = Timeline()
    _our_step(model, ids, pos, tgt)
    names = [r[1] for r in tl.rows()]
    n = ref.config.num_hidden_layers
    assert sum(x.startswith("forward") for x in names) == n and sum(x.startswith("backward") for x in names) == n
    assert sum(x.startswith("D2H") for x in names) == n and sum(x.startswith("H2D") for x in names) == n
    summary = tl.summary()
    assert summary["compute_ms"] > 0 and 0.0 <= summary["copies_hidden"] <= 1.0, summary
    pool = model._easy_context_host_pool
    assert pool.nbytes() > 0
    pool.release()
    assert pool.nbytes() == 0 and not pool.registered


# --------------------------------------------------------------------------------------------------
# checkpointing chosen from the budgets (memory/auto.py)
# --------------------------------------------------------------------------------------------------
def test_auto_checkpointing_choice_follows_the_budgets():
    from easy_context.memory.auto import GiB, choose_checkpointing
    from easy_context.tools.plan import load_shape
    s = load_shape("llama-2-7b")
    gpu = (139.8 - 25.2) * GiB  # an H200 after bf16 weights + gradients
    roomy = choose_checkpointing(s, 131072, gpu, 100 * GiB)
    assert roomy.offload_every_k == 1 and len(roomy.selective_layers) == 32  # all outputs fit at 128K
    tight = choose_checkpointing(s, 524288, gpu, 70 * GiB)  # the 512K run's host
    assert tight.offload_every_k == 2 and 0 < len(tight.selective_layers) < 32
    assert tight.selective_layers == tuple(range(32 - len(tight.selective_layers), 32))  # later layers first
    assert tight.host_bytes <= 70 * GiB and tight.saved_s > 0
    less = choose_checkpointing(s, 524288, gpu - 20 * GiB, 70 * GiB)
    assert len(less.selective_layers) == len(tight.selective_layers) - 5  # 4.06 GiB each
    with pytest.raises(ValueError, match="more than the 114.6 GiB free"):
        choose_checkpointing(s, 1048576, gpu, 200 * GiB)
    with pytest.raises(ValueError, match="host memory"):
        choose_checkpointing(s, 524288, gpu, 1 * GiB)


def test_auto_checkpointing_applies_an_exact_configuration():
    from easy_context.memory.auto import auto_checkpointing
    ref = build_model("llama", num_hidden_layers=4)
    model = copy.deepcopy(ref)
    ids, pos, tgt = make_batch(1, 24, ref.config.vocab_size, labels_mask="random")
    _, ref_loss, ref_grads = reference_step(ref, ids, pos, tgt)
    inp = 2 * ref.config.hidden_size * 24  # one layer input; host for two of them -> k = 2
    choice, cfg = auto_checkpointing(model, 24, gpu_budget=1e9, host_budget=2 * inp, kernel="cudnn")
    assert choice.offload_every_k == 2 and cfg.offload_every_k == 2 and cfg.checkpointing == "offload"
    assert cfg.selective_layers == choice.selective_layers == (0, 1, 2, 3)
    loss, grads = _our_step(model, ids, pos, tgt)
    assert_close(loss, ref_loss, REL, "auto loss")
    for name, g in grads.items():
        assert_close(g, ref_grads[name], REL, f"auto grad {name}")
