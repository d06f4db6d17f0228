"""Ulysses and USP attention equal full attention (kernel level) and single-process models (model level).

Two spawns of 4 gloo ranks: one for the kernel cases and validation errors, one for the models.
"""
import pytest
import torch
import torch.distributed as dist

from easy_context import shard_sequence, ulysses_attn_func, usp_attn_func
from easy_context.kernels import attention_reference
from easy_context.ulysses_attn.attention import kv_replication, largest_valid_degree
from tests.harness import run_ranks
from tests.tols import assert_close


# ----------------------------------------------------------------------------------------------
# pure logic
# ----------------------------------------------------------------------------------------------
def test_kv_replication_plan():
    assert kv_replication(32, 8, 8) == 1       # Llama-3 8B on 8 ranks: one kv head each
    assert kv_replication(32, 8, 16) == 2      # 16 ranks: each kv head on 2 ranks
    assert kv_replication(32, 8, 32) == 4
    assert kv_replication(4, 2, 4) == 2
    assert kv_replication(12, 6, 4) == 2       # neither divides: lcm(6, 4) = 12 replicated heads
    assert kv_replication(4, 4, 2) == 1
    assert largest_valid_degree(6, 4) == 3 and largest_valid_degree(32, 12) == 8


def test_heads_error_names_largest_valid_degree():
    with pytest.raises(ValueError, match=r"largest valid one <= 4 is 3"):
        kv_replication(6, 2, 4)
    with pytest.raises(ValueError, match=r"multiple of kv heads"):
        kv_replication(6, 4, 2)


def test_single_process_equals_reference():
    # no process group: W = 1, plain attention through the facade (usp: ring of one)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 4, 8, dtype=torch.float64), torch.randn(2, 8, 2, 8, dtype=torch.float64), \
        torch.randn(2, 8, 2, 8, dtype=torch.float64)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert_close(ulysses_attn_func(q, k, v), ref, name="ulysses W=1")
    assert_close(usp_attn_func(q, k, v), ref, name="usp W=1")


# ----------------------------------------------------------------------------------------------
# kernel level: 4 ranks
# ----------------------------------------------------------------------------------------------
def _case(tag, fn, seq_algo, sp_rank, sp_size, layout_kw, hq, hkv, dtype, causal=True, scale=None,
          batch=2, seq=24, dim=8, seed=0):
    """Shard full q/k/v/dout like training does; compare out, dq, dk, dv with full float64 attention."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(batch, seq, h, dim, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]
    ref_in = [t.clone().requires_grad_() for t in full[:3]]
    ref_out, _ = attention_reference(*ref_in, causal=causal, softmax_scale=scale)
    ref_out.backward(full[3])
    cut = [shard_sequence(seq_algo, t, sp_rank, sp_size, dim=1, **layout_kw) for t in
           (*full, ref_out.detach(), *(t.grad for t in ref_in))]
    q, k, v = (t.to(dtype).requires_grad_() for t in cut[:3])
    out = fn(q, k, v, softmax_scale=scale, causal=causal)
    out.backward(cut[3].to(dtype))
    tag = f"[{tag} hq={hq} hkv={hkv} {dtype} causal={causal}]"
    for name, a, e in (("out", out, cut[4]), ("dq", q.grad, cut[5]), ("dk", k.grad, cut[6]),
                       ("dv", v.grad, cut[7])):
        assert a.dtype == dtype, f"{tag} {name} dtype {a.dtype}"
        assert_close(a, e, None, f"{tag} {name}")


def _expect_error(match, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except ValueError as e:
        import re
        assert re.search(match, str(e)), f"wrong message: {e}"
        return
    raise AssertionError(f"expected ValueError matching {match!r}")


def _kernel_body(rank, world_size):
    # every rank creates every group in the same order
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]     # Ulysses W=2 / USP ulysses groups
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]     # USP ring groups (stride U=2)
    singles = [dist.new_group([r]) for r in range(4)]
    pair, ring, single = pairs[rank // 2], rings[rank % 2], singles[rank]

    # --- validation errors first: every rank raises before any collective, so the collectives that
    # follow still line up (a half-issued all-to-all would deadlock or mismatch below)
    x = torch.randn(1, 6, 6, 8)
    _expect_error(r"largest valid one <= 4 is 3", ulysses_attn_func, x, x[:, :, :2], x[:, :, :2])
    _expect_error(r"largest valid one <= 2 is 1", usp_attn_func, x[:, :, :3], x[:, :, :3], x[:, :, :3],
                  ring_group=ring, ulysses_group=pair)
    _expect_error(r"dropout", ulysses_attn_func, x[:, :, :4], x[:, :, :4], x[:, :, :4], dropout_p=0.1)
    _expect_error(r"causal=True", usp_attn_func, x[:, :, :4], x[:, :, :4], x[:, :, :4], causal=False,
                  ring_group=ring, ulysses_group=pair)
    _expect_error(r"agree on batch", ulysses_attn_func, x[:, :, :4], x[:, :4, :4], x[:, :4, :4])
    _expect_error(r"must be even", usp_attn_func, x[:, :3, :4], x[:, :3, :4], x[:, :3, :4],
                  ring_group=ring, ulysses_group=single)

    f64, f32 = torch.float64, torch.float32
    # Ulysses over the world (W=4): equal heads, GQA without/with kv replication, lcm replication
    uly4 = lambda q, k, v, **kw: ulysses_attn_func(q, k, v, **kw)  # noqa: E731
    for hq, hkv, dtype in ((4, 4, f64), (8, 8, f64), (8, 4, f64), (4, 2, f64), (4, 2, f32), (8, 2, f64),
                           (4, 1, f32), (12, 6, f64), (12, 6, f32)):
        _case("ulysses W=4", uly4, "ulysses_attn", rank, 4, {}, hq, hkv, dtype)
    _case("ulysses W=4", uly4, "ulysses_attn", rank, 4, {}, 4, 2, f64, causal=False)
    _case("ulysses W=4", uly4, "ulysses_attn", rank, 4, {}, 8, 2, f32, scale=0.3)

    # Ulysses over pairs (W=2): two independent sp groups in one world
    uly2 = lambda q, k, v, **kw: ulysses_attn_func(q, k, v, group=pair, **kw)  # noqa: E731
    for hq, hkv, dtype in ((4, 2, f64), (4, 1, f64), (2, 2, f32), (6, 3, f32)):
        _case("ulysses W=2", uly2, "ulysses_attn", rank % 2, 2, {}, hq, hkv, dtype, seed=rank // 2)

    # USP ring 2 x ulysses 2 over the world (sp rank = ring_rank * 2 + ulysses_rank = rank)
    usp22 = lambda q, k, v, **kw: usp_attn_func(q, k, v, ring_group=ring, ulysses_group=pair, **kw)  # noqa
    for hq, hkv, dtype in ((4, 2, f64), (4, 2, f32), (4, 1, f64), (8, 2, f32), (2, 2, f64)):
        _case("usp R2xU2", usp22, "usp_attn", rank, 4, {"ring_degree": 2}, hq, hkv, dtype)
    _case("usp R2xU2", usp22, "usp_attn", rank, 4, {"ring_degree": 2}, 4, 2, f32, scale=0.25, seq=40)
    # the degenerate corners: R1 x U4 (= Ulysses) and R4 x U1 (= zigzag ring)
    usp14 = lambda q, k, v, **kw: usp_attn_func(q, k, v, ring_group=single, ulysses_group=None, **kw)  # noqa
    _case("usp R1xU4", usp14, "usp_attn", rank, 4, {"ring_degree": 1}, 4, 2, f64)
    usp41 = lambda q, k, v, **kw: usp_attn_func(q, k, v, ring_group=None, ulysses_group=single, **kw)  # noqa
    _case("usp R4xU1", usp41, "usp_attn", rank, 4, {"ring_degree": 4}, 4, 2, f64)
    usp_default = lambda q, k, v, **kw: usp_attn_func(q, k, v, **kw)  # noqa: E731  (both None: ring = world)
    _case("usp default", usp_default, "usp_attn", rank, 4, {}, 4, 2, f32)


def test_kernels_4_ranks():
    run_ranks(_kernel_body, world_size=4, timeout=180)


# ----------------------------------------------------------------------------------------------
# model level: tiny Llama / Qwen2 (4 q heads, 2 kv heads), float32, logits/loss/grads within 1e-5
# ----------------------------------------------------------------------------------------------
def _model_body(rank, world_size):
    from easy_context import ParallelLayout
    from tests.model_equiv import check_model_equivalence

    # Ulysses W=4 over the world: 4 q heads / 2 kv heads on 4 ranks (kv replicated x2)
    for family in ("llama", "qwen2"):
        check_model_equivalence(rank, world_size, "ulysses_attn", family, labels_mask="random")
    check_model_equivalence(rank, world_size, "ulysses_attn", "llama", labels_mask="one_rank", patch="family")

    # Ulysses W=2: dp 2 x sp 2 layout, each sp group its own sample
    uly = ParallelLayout.build("ulysses_attn", sp_size=2)
    assert str(uly) == "DP(2)-SP(2)"
    for family in ("llama", "qwen2"):
        check_model_equivalence(rank, world_size, "ulysses_attn", family, groups=uly.attn_groups(),
                                sp_group=uly.sp_group, seed=uly.dp_rank)

    # USP ring 2 x ulysses 2 on 4 ranks
    usp = ParallelLayout.build("usp_attn", ring_degree=2)
    assert str(usp) == "DP(1)-SP(4: R2\u00d7U2)"
    for family in ("llama", "qwen2"):
        check_model_equivalence(rank, world_size, "usp_attn", family, layout_kw=usp.layout_kw,
                                groups=usp.attn_groups(), sp_group=usp.sp_group, labels_mask="random")
    check_model_equivalence(rank, world_size, "usp_attn", "llama", layout_kw=usp.layout_kw,
                            groups=usp.attn_groups(), sp_group=usp.sp_group, labels_mask="one_rank")


    # usp with ring_degree= on the patch itself (groups built from the world), instance and family patch
    check_model_equivalence(rank, world_size, "usp_attn", "llama", layout_kw={"ring_degree": 2},
                            groups={"ring_degree": 2})
    check_model_equivalence(rank, world_size, "usp_attn", "qwen2", layout_kw={"ring_degree": 2},
                            groups={"ring_degree": 2}, patch="family")
    _layout_mismatch_is_an_error(rank, world_size)


def _layout_mismatch_is_an_error(rank, world_size):
    """Inputs sharded for one layout, attention patched for another: an error on every rank, not wrong logits."""
    import copy

    import pytest

    from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
    from tests.model_equiv import build_model, make_batch
    base = build_model("llama")
    ids, pos, _ = make_batch(1, 32, base.config.vocab_size)
    cases = [  # (prepare mode, prepare kw, patch mode, patch kw, message)
        ("usp_attn", {"ring_degree": 2}, "usp_attn", {}, r"sharded for usp_attn on 4 sp ranks, ring_degree=2 but "
         r"attention runs usp_attn with ring 4 x ulysses 1"),
        ("usp_attn", {"ring_degree": 2}, "usp_attn", {"ring_degree": 4}, "ring 4 x ulysses 1"),
        ("usp_attn", {}, "usp_attn", {"ring_degree": 2}, "ring 2 x ulysses 2"),
        ("usp_attn", {"ring_degree": 2}, "zigzag_ring_attn", {}, "attention runs zigzag_ring_attn on 4 sp ranks"),
        ("zigzag_ring_attn", {}, "ulysses_attn", {}, "sharded for zigzag_ring_attn"),
    ]
    for mode, kw, pmode, pkw, msg in cases:
        model = apply_seq_parallel_monkey_patch(pmode, copy.deepcopy(base), **pkw)
        prep = prepare_seq_parallel_inputs(mode, ids, pos, None, rank, world_size, "cpu", **kw)
        with pytest.raises(ValueError, match=msg):
            model(prep["local_input_ids"], position_ids=prep["local_position_ids"], use_cache=False)
    # the same cut under another name is fine: zigzag over 4 == usp ring 4 x ulysses 1
    model = apply_seq_parallel_monkey_patch("usp_attn", copy.deepcopy(base), ring_degree=4)
    prep = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, pos, None, rank, world_size, "cpu")
    model(prep["local_input_ids"], position_ids=prep["local_position_ids"], use_cache=False)


def test_patch_ring_degree_validation():
    from easy_context import ParallelLayout, apply_seq_parallel_monkey_patch
    with pytest.raises(ValueError, match="ring_degree applies to usp_attn only"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama", ring_degree=2)
    with pytest.raises(ValueError, match="positive int"):
        apply_seq_parallel_monkey_patch("usp_attn", "llama", ring_degree=0)
    with pytest.raises(ValueError, match="disagrees with the layout"):
        apply_seq_parallel_monkey_patch("usp_attn", "llama", ring_degree=2,
                                        layout=ParallelLayout.build("usp_attn", world_size=1))


def test_models_4_ranks():
    run_ranks(_model_body, world_size=4, timeout=240)
