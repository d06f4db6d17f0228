"""zigzag_ring_attn: schedule logic, kernel-level equality with full causal attention, HF models.

Tiers: pure logic (block_plan, validation), multi-rank CPU (gloo, one spawn per world size running
many cases), model level through tests/model_equiv.py.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from easy_context import kernels
from easy_context.sharding import zigzag_shard, zigzag_unshard
from easy_context.zigzag_ring_attn import (block_plan, global_chunks, zigzag_ring_attn_func,
                                           zigzag_ring_forward)
from tests.harness import run_ranks
from tests.sim_comm import run_simulated
from tests.tols import assert_close

# (batch, seq_len_global_per_2W_chunk c, q heads, kv heads, head_dim, dtype, backend)
KERNEL_CASES = [
    (2, 8, 4, 2, 32, torch.float64, "math"),     # GQA
    (2, 8, 4, 4, 64, torch.float64, "math"),     # MHA, head_dim 64
    (1, 13, 6, 2, 32, torch.float64, "math"),    # awkward chunk length, 3 q heads per kv head
    (2, 8, 4, 2, 32, torch.float32, "cpu"),
    (2, 7, 4, 2, 64, torch.float32, "cpu"),      # awkward, fused CPU kernel
]


# ----------------------------------------------------------------------------------------------
# pure logic
# ----------------------------------------------------------------------------------------------
def _covered_pairs(rank, world, c):
    """Global (q position, k position) pairs the plan computes for ``rank``, with multiplicity check."""
    pairs = set()
    for blk in block_plan(rank, world):
        qg = [global_chunks(rank, world)[i] for i in blk.q_chunks]
        kg = [global_chunks(blk.src, world)[i] for i in blk.kv_chunks]
        q_pos = [g * c + j for g in qg for j in range(c)]
        k_pos = [g * c + j for g in kg for j in range(c)]
        for qi, qp in enumerate(q_pos):
            for ki, kp in enumerate(k_pos):
                if blk.causal and ki > qi:  # causal inside the block's own (local) order
                    continue
                assert (qp, kp) not in pairs, f"rank {rank} step {blk.step} computes ({qp}, {kp}) twice"
                pairs.add((qp, kp))
    return pairs


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_block_plan_is_exactly_the_causal_mask(world):
    c = 3
    for r in range(world):
        plan = block_plan(r, world)
        assert [b.step for b in plan] == list(range(world))
        assert [b.src for b in plan] == [(r - s) % world for s in range(world)]
        assert plan[0].causal and not any(b.causal for b in plan[1:])
        rows = [g * c + j for g in global_chunks(r, world) for j in range(c)]
        want = {(qp, kp) for qp in rows for kp in range(qp + 1)}
        assert _covered_pairs(r, world, c) == want


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_block_plan_balances_work(world):
    """Every rank does the same q x kv area (causal blocks count half) at every step and in total."""
    c = 1.0
    per_rank = []
    for r in range(world):
        areas = []
        for blk in block_plan(r, world):
            a = len(blk.q_chunks) * c * len(blk.kv_chunks) * c
            areas.append(a / 2 if blk.causal else a)
        assert areas == [2 * c * c] * world, f"rank {r}: per-step areas {areas}"
        per_rank.append(sum(areas))
    assert len(set(per_rank)) == 1
    # and the total equals one full causal attention over 2W chunks: (2W c)^2 / 2
    assert sum(per_rank) == (2 * world * c) ** 2 / 2


def test_block_plan_rejects_bad_rank():
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        block_plan(2, 2)


def test_validation_errors_before_any_collective():
    q = torch.randn(1, 8, 4, 16)
    k = v = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="causal=True.*ulysses_attn_func"):
        zigzag_ring_attn_func(q, k, v, causal=False)
    with pytest.raises(ValueError, match="dropout_p=0.0"):
        zigzag_ring_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"must be even.*multiple of 2 x world_size"):
        zigzag_ring_attn_func(q[:, :7], k[:, :7], v[:, :7])
    with pytest.raises(ValueError, match=r"\(batch, seq_local, heads, head_dim\)"):
        zigzag_ring_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match="same shape"):
        zigzag_ring_attn_func(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="local length"):
        zigzag_ring_attn_func(q, k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        zigzag_ring_attn_func(torch.randn(1, 8, 3, 16), k, v)
    with pytest.raises(ValueError, match="share a dtype"):
        zigzag_ring_attn_func(q.double(), k, v)


# ----------------------------------------------------------------------------------------------
# kernel level
# ----------------------------------------------------------------------------------------------
def _full_reference(b, c, world, hq, hkv, d, dtype, seed):
    """Full-sequence inputs and float64 oracle out/lse/grads (identical on every rank)."""
    g = torch.Generator().manual_seed(seed)
    n = 2 * world * c
    q = torch.randn(b, n, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, n, hq, d, generator=g, dtype=torch.float64)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    qr, kr, vr = (t.double().clone().requires_grad_() for t in (q, k, v))
    out, lse = kernels.attention_reference(qr, kr, vr, causal=True)
    out.backward(dout.double())
    return (q, k, v, dout), (out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad)


def _gather_unshard(x, group):
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return zigzag_unshard(parts, dim=1)


def _kernel_case(case, group, seed):
    b, c, hq, hkv, d, dtype, backend = case
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    (q, k, v, dout), (r_out, r_lse, r_dq, r_dk, r_dv) = _full_reference(b, c, world, hq, hkv, d, dtype, seed)
    os.environ[kernels.ENV_VAR] = backend
    try:
        ql, kl, vl = (zigzag_shard(t, rank, world, dim=1).clone().requires_grad_() for t in (q, k, v))
        out = zigzag_ring_attn_func(ql, kl, vl, group=group)
        out.backward(zigzag_shard(dout, rank, world, dim=1))
        _, lse = zigzag_ring_forward(ql.detach(), kl.detach(), vl.detach(), 1.0 / d ** 0.5, group)
    finally:
        del os.environ[kernels.ENV_VAR]
    tag = f"[W={world} rank {rank} b={b} c={c} hq={hq} hkv={hkv} d={d} {dtype} {backend}]"
    rel = 1e-10 if dtype == torch.float64 else 1e-5
    assert out.dtype == dtype and ql.grad.dtype == dtype and kl.grad.shape == kl.shape
    assert_close(_gather_unshard(out.detach(), group), r_out, rel, f"{tag} out")
    assert_close(_gather_unshard(lse.transpose(1, 2), group), r_lse.transpose(1, 2), rel, f"{tag} lse")
    assert_close(_gather_unshard(ql.grad, group), r_dq, rel, f"{tag} dq")
    assert_close(_gather_unshard(kl.grad, group), r_dk, rel, f"{tag} dk")
    assert_close(_gather_unshard(vl.grad, group), r_dv, rel, f"{tag} dv")


def _kernel_body(rank, world_size):
    for i, case in enumerate(KERNEL_CASES):
        _kernel_case(case, None, seed=100 + i)
    # a custom softmax scale, and the ring inside subgroups (peers resolved in the group)
    if world_size == 4:
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        mine = evens if rank % 2 == 0 else odds
        for i, case in enumerate(KERNEL_CASES[:1] + KERNEL_CASES[3:4]):
            _kernel_case(case, mine, seed=200 + i + rank % 2)  # the two rings see different data
    _scale_case(rank, world_size)


def _scale_case(rank, world):
    b, c, hq, hkv, d = 1, 4, 4, 2, 32
    (q, k, v, dout), _ = _full_reference(b, c, world, hq, hkv, d, torch.float64, 7)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = kernels.attention_reference(qr, kr, vr, causal=True, softmax_scale=0.3)
    ref.backward(dout)
    ql, kl, vl = (zigzag_shard(t, rank, world, dim=1).clone().requires_grad_() for t in (q, k, v))
    out = zigzag_ring_attn_func(ql, kl, vl, softmax_scale=0.3)
    out.backward(zigzag_shard(dout, rank, world, dim=1))
    assert_close(out, zigzag_shard(ref.detach(), rank, world), 1e-10, "softmax_scale=0.3 out")
    assert_close(kl.grad, zigzag_shard(kr.grad, rank, world), 1e-10, "softmax_scale=0.3 dk")


def test_kernel_world_1_without_process_group():
    """W=1 is plain causal attention through the facade (no torch.distributed needed)."""
    assert not dist.is_initialized()
    for i, (b, c, hq, hkv, d, dtype, backend) in enumerate(KERNEL_CASES):
        (q, k, v, dout), (r_out, _, r_dq, r_dk, r_dv) = _full_reference(b, c, 1, hq, hkv, d, dtype, 100 + i)
        os.environ[kernels.ENV_VAR] = backend
        try:
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out = zigzag_ring_attn_func(ql, kl, vl)
            out.backward(dout)
        finally:
            del os.environ[kernels.ENV_VAR]
        rel = 1e-10 if dtype == torch.float64 else 1e-5
        for name, a, e in (("out", out, r_out), ("dq", ql.grad, r_dq), ("dk", kl.grad, r_dk), ("dv", vl.grad, r_dv)):
            assert_close(a, e, rel, f"W=1 case {i} {name}")


# W=4 is slow-only (`make test-all`): the default run has zigzag at W=4 in test_packed's 4-rank spawn (packed
# rows), test_families W4 (qwen3_moe, windows) and USP's zigzag ring (test_ulysses_usp)
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_kernel_matches_full_causal_attention(world):
    run_ranks(_kernel_body, world_size=world, timeout=150)


# ----------------------------------------------------------------------------------------------
# model level: tiny HF models, logits / loss / every grad equal the single-process model
# ----------------------------------------------------------------------------------------------
def _model_body(rank, world_size):
    from tests.model_equiv import check_model_equivalence
    masks = {"llama": None, "mistral": "random"} if world_size == 2 else {"llama": "random", "mistral": None}
    masks["qwen2"] = "one_rank"  # every valid label on rank 0: the others have loss 0, not NaN
    for family, mask in masks.items():
        check_model_equivalence(rank, world_size, "zigzag_ring_attn", family, seq_len=8 * world_size,
                                labels_mask=mask)
    if world_size == 2:  # the family-string patch path, restored with "data_parallel" afterwards
        check_model_equivalence(rank, world_size, "zigzag_ring_attn", "llama", seq_len=16, patch="family")
    if world_size == 4:  # dp 2 x sp 2: the ring runs inside each sp subgroup
        sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        check_model_equivalence(rank, world_size, "zigzag_ring_attn", "mistral", seq_len=12,
                                groups={"group": sp_groups[rank // 2]}, labels_mask="random")


# W=4 (also dp 2 x sp 2) is slow-only: test_layout_data's 4-rank spawn and test_packed W=4 cover it by default
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_models_match_single_process(world):
    run_ranks(_model_body, world_size=world, timeout=180)


# ----------------------------------------------------------------------------------------------
# one device, W simulated ranks: W threads running the real forward/backward over an in-process ring.
# One GPU cannot host W NCCL ranks ("Duplicate GPU detected"), so this is how the bf16 kernel-level
# check runs on the H200; on CPU (float64) it checks the simulation itself and a W=8 ring cheaply.
# Forward/backward are called directly: autograd would run every thread's backward on the one device
# thread and deadlock the ring.
# ----------------------------------------------------------------------------------------------
def simulated_kernel_check(world, b, c, hq, hkv, d, dtype, device, backend=None, seed=0):
    """Zigzag out/dq/dk/dv of W simulated ranks vs full causal attention; returns relative errors.

    The oracle is ``attention_reference`` in float64 (float32 on GPU for speed); the errors of one full
    causal kernel of the same dtype (``attn_forward`` on the whole sequence) come back too, so low-precision
    runs can be judged against what a single kernel achieves.
    """
    from easy_context.zigzag_ring_attn import zigzag_ring_backward
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = 2 * world * c
    ref_dtype = torch.float64 if device == "cpu" else torch.float32
    full = [torch.randn(b, n, h, d, generator=g).to(device) for h in (hq, hkv, hkv, hq)]
    q, k, v, dout = (t.to(dtype) for t in full)
    qr, kr, vr = (t.to(ref_dtype).requires_grad_() for t in (q, k, v))
    r_out, _ = kernels.attention_reference(qr, kr, vr, causal=True)
    r_out.backward(dout.to(ref_dtype))
    refs = {"out": r_out.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    scale = 1.0 / d ** 0.5

    def rank_fn(r, group):
        ql, kl, vl, dl = (zigzag_shard(t, r, world) for t in (q, k, v, dout))
        out, lse = zigzag_ring_forward(ql, kl, vl, scale, group, backend)
        return (out,) + tuple(zigzag_ring_backward(dl, ql, kl, vl, out, lse, scale, group, backend))

    res, sent = run_simulated(world, rank_fn)
    # GQA: only k/v (and their grads) travel, with the kv heads, never expanded to q's heads
    assert sent and all(shape == (b, 2 * c, hkv, d) for shape in sent), set(sent)
    got = {name: zigzag_unshard([r[i] for r in res]) for i, name in enumerate(("out", "dq", "dk", "dv"))}
    one_out, one_lse = kernels.attn_forward(q, k, v, True, scale, backend)
    one = dict(zip(("out", "dq", "dk", "dv"),
                   (one_out,) + tuple(kernels.attn_backward(dout, q, k, v, one_out, one_lse, True, scale, backend))))

    def rel(a, e):
        return float((a.detach().double() - e.double()).norm() / e.double().norm())
    return ({name: rel(got[name], refs[name]) for name in refs}, {name: rel(one[name], refs[name]) for name in refs},
            got)


@pytest.mark.parametrize("world", [2, 8])
def test_simulated_ring_cpu_float64(world):
    errs, _, got = simulated_kernel_check(world, 2, 4, 4, 2, 32, torch.float64, "cpu", seed=world)
    assert all(v < 1e-10 for v in errs.values()), errs
    assert got["out"].dtype == torch.float64 and got["dk"].shape[2] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_simulated_ring_gpu_bf16(world):
    """bf16 on one GPU (auto backend: cuDNN on Hopper): the ring is as accurate as one full kernel."""
    for d in (64, 128):
        errs, single, _ = simulated_kernel_check(world, 1, 512, 8, 2, d, torch.bfloat16, "cuda", seed=world + d)
        for name in errs:
            assert errs[name] < 2e-2 and errs[name] <= 1.5 * single[name] + 2e-3, (
                f"W={world} d={d} {name}: ring rel err {errs[name]:.2e}, one full kernel {single[name]:.2e}")
