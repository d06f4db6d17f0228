"""Public API (the names docs/library.md lists), pure logic: names, layouts, input preparation, error messages."""
from __future__ import annotations

import pytest
import torch

import easy_context
from easy_context import (SEQ_ALGOS, apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs,
                          seq_multiple, shard_sequence, unshard_sequence)


def _kw_variants(mode, world):
    """Layout kwargs to try for ``mode`` on ``world`` ranks (usp: every ring degree that divides W)."""
    if mode == "usp_attn":
        return [{"ring_degree": r} for r in range(1, world + 1) if world % r == 0]
    return [{}]


def test_seq_algos_names():
    assert SEQ_ALGOS == ("data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")


def test_public_names_exported():
    for name in ("SEQ_ALGOS", "apply_seq_parallel_monkey_patch", "prepare_seq_parallel_inputs", "shard_sequence",
                 "unshard_sequence", "zigzag_ring_attn_func"):
        assert name in easy_context.__all__ and getattr(easy_context, name) is not None
    from easy_context.zigzag_ring_attn import zigzag_ring_attn_func
    assert easy_context.zigzag_ring_attn_func is zigzag_ring_attn_func


@pytest.mark.parametrize("mode", SEQ_ALGOS)
@pytest.mark.parametrize("world", [1, 2, 4, 6])
def test_shard_unshard_round_trip(mode, world):
    for kw in _kw_variants(mode, world):
        mult = seq_multiple(mode, world, **kw)
        for shape, dim in (((2, 3 * mult, 5), 1), ((3 * mult,), 0), ((2, 4, 2 * mult), -1),
                           ((2, 2 * mult, 3, 4), 1)):
            x = torch.randn(*shape)
            shards = [shard_sequence(mode, x, r, world, dim=dim, **kw) for r in range(world)]
            if mode != "data_parallel":
                assert all(s.shape[dim] == x.shape[dim] // world for s in shards), (mode, kw, shape)
            assert torch.equal(unshard_sequence(mode, shards, dim=dim, **kw), x), (mode, world, kw, shape, dim)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_zigzag_layout_is_chunks_r_and_2w_minus_1_minus_r(world):
    c = 3
    x = torch.arange(2 * world * c).unsqueeze(0)
    chunks = x.chunk(2 * world, dim=1)
    for r in range(world):
        got = shard_sequence("zigzag_ring_attn", x, r, world)
        assert torch.equal(got, torch.cat([chunks[r], chunks[2 * world - 1 - r]], dim=1))
        assert got[0, :c].tolist() == list(range(r * c, (r + 1) * c))
        assert got[0, c:].tolist() == list(range((2 * world - 1 - r) * c, (2 * world - r) * c))


def test_seq_multiples():
    assert seq_multiple("data_parallel", 4) == 1
    assert seq_multiple("zigzag_ring_attn", 4) == 8
    assert seq_multiple("ulysses_attn", 4) == 4
    assert seq_multiple("dist_flash_attn", 4) == 4
    assert seq_multiple("usp_attn", 4, ring_degree=2) == 8


@pytest.mark.parametrize("mode,world,kw,n,mult", [
    ("zigzag_ring_attn", 4, {}, 20, 8),
    ("zigzag_ring_attn", 2, {}, 6, 4),
    ("ulysses_attn", 4, {}, 10, 4),
    ("dist_flash_attn", 3, {}, 10, 3),
    ("usp_attn", 4, {"ring_degree": 2}, 12, 8),
])
def test_prepare_rejects_bad_length_naming_the_multiple(mode, world, kw, n, mult):
    ids = torch.zeros(2, n, dtype=torch.long)
    with pytest.raises(ValueError, match=f"multiple of {mult}"):
        prepare_seq_parallel_inputs(mode, ids, None, ids, 0, world, "cpu", **kw)


def test_prepare_positions_are_global():
    world, c, b = 4, 3, 2
    n = 2 * world * c
    ids = torch.arange(b * n).view(b, n)
    tgt = ids + 1000
    for r in range(world):
        out = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, None, tgt, r, world, torch.device("cpu"))
        assert set(out) == {"local_input_ids", "local_position_ids", "local_target_ids"}
        want = list(range(r * c, (r + 1) * c)) + list(range((2 * world - 1 - r) * c, (2 * world - r) * c))
        assert out["local_position_ids"].tolist() == [want] * b
        assert torch.equal(out["local_input_ids"], ids[:, want])
        assert torch.equal(out["local_target_ids"], tgt[:, want])
    # explicit positions (e.g. an offset) are sharded the same way, not recomputed
    pos = torch.arange(n).unsqueeze(0).expand(b, -1) + 7
    out = prepare_seq_parallel_inputs("ulysses_attn", ids, pos, None, 1, 2, "cpu")
    assert out["local_target_ids"] is None
    assert out["local_position_ids"].tolist() == [list(range(7 + n // 2, 7 + n))] * b
    # usp: zigzag over the ring, contiguous inside each Ulysses group
    out = prepare_seq_parallel_inputs("usp_attn", ids, None, None, 3, 4, "cpu", ring_degree=2)
    ring_local = list(range(1 * c * 2, 2 * c * 2)) + list(range(2 * c * 2, 3 * c * 2))  # chunks 1 and 2 of 4
    assert out["local_position_ids"][0].tolist() == ring_local[len(ring_local) // 2:]


def test_unknown_mode_and_family_errors_name_valid_ones():
    with pytest.raises(ValueError, match="valid modes: data_parallel, zigzag_ring_attn"):
        apply_seq_parallel_monkey_patch("ring_attn", "llama")
    with pytest.raises(ValueError, match="valid modes"):
        shard_sequence("nope", torch.zeros(4), 0, 1)
    with pytest.raises(ValueError, match="valid modes"):
        prepare_seq_parallel_inputs("nope", torch.zeros(1, 4, dtype=torch.long), None, None, 0, 1, "cpu")
    with pytest.raises(ValueError, match="valid families: llama, mistral, qwen2, qwen3"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", "gpt2")
    with pytest.raises(ValueError, match="family string"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", object())


def test_bad_rank_and_shapes():
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="rank must be in"):
        prepare_seq_parallel_inputs("zigzag_ring_attn", ids, None, None, 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        prepare_seq_parallel_inputs("zigzag_ring_attn", ids[0], None, None, 0, 2, "cpu")
    with pytest.raises(ValueError, match="target_ids has length"):
        prepare_seq_parallel_inputs("zigzag_ring_attn", ids, None, ids[:, :4], 0, 2, "cpu")
    with pytest.raises(ValueError, match="at least one shard"):
        unshard_sequence("zigzag_ring_attn", [])
    with pytest.raises(ValueError, match="ring_degree"):
        seq_multiple("usp_attn", 4, ring_degree=3)


def test_patched_instance_without_process_group_and_padding_error():
    """With no process group, W=1: the patched model equals the plain one; padding is refused."""
    from tests.model_equiv import build_model, make_batch
    plain = build_model("llama")
    patched = build_model("llama")
    assert apply_seq_parallel_monkey_patch("zigzag_ring_attn", patched) is patched
    assert patched.config._attn_implementation.startswith("easy_context_zigzag_ring_attn")
    ids, pos, _ = make_batch(2, 16, plain.config.vocab_size)
    with torch.no_grad():
        a = patched(ids, position_ids=pos, use_cache=False).logits
        e = plain(ids, position_ids=pos, use_cache=False).logits
    from tests.tols import assert_close
    assert_close(a, e, 1e-5, "patched W=1 logits")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="does not support padding"):
        patched(ids, attention_mask=mask, position_ids=pos, use_cache=False)
    apply_seq_parallel_monkey_patch("data_parallel", patched)
    assert patched.config._attn_implementation == "sdpa"


def test_patched_family_without_process_group_then_restored():
    """Family string: a model built after the patch routes through the mode; padding refused; restore."""
    from tests.model_equiv import build_model, make_batch
    from tests.tols import assert_close
    ref = build_model("qwen2")
    ids, pos, _ = make_batch(1, 12, ref.config.vocab_size)
    with torch.no_grad():
        e = ref(ids, position_ids=pos, use_cache=False).logits
    try:
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", "qwen2")
        patched = build_model("qwen2")
        with torch.no_grad():
            assert_close(patched(ids, position_ids=pos, use_cache=False).logits, e, 1e-5, "family W=1 logits")
        mask = torch.ones_like(ids)
        mask[0, -1] = 0
        with pytest.raises(ValueError, match="does not support padding"):
            patched(ids, attention_mask=mask, position_ids=pos, use_cache=False)
    finally:
        apply_seq_parallel_monkey_patch("data_parallel", "qwen2")
    with torch.no_grad():  # plain attention again: a padding mask is accepted
        build_model("qwen2")(ids, attention_mask=torch.ones_like(ids), position_ids=pos, use_cache=False)


def test_transformers_guard_names_installed_version(monkeypatch):
    import transformers

    from easy_context.hf import patch as hf  # the version guard lives in hf/patch.py
    for family in hf.FAMILIES:
        hf.check_transformers_compat(family)
    monkeypatch.setattr(hf, "_EXPECTED", ("module", "q", "k", "v", "mask"))
    with pytest.raises(RuntimeError, match=f"transformers {transformers.__version__}"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
