"""Packed rows in the balanced k-pair zigzag layout (issue #14): sharding, packed detection, the ring's pieces.

Since issue #28 packed rows are dispatched by cost by default (tests/test_dispatch.py); the k-pair layout stays
behind EASY_CONTEXT_PACKED_LAYOUT=pairs, which every test here sets.

Pure tests here; the multi-rank model checks (zigzag at W=2 / W=4, USP 2x2, k > 1, logits / loss / grads vs the
per-document reference, and the block-skip count) run inside tests/test_packed.py's spawns (``balanced_body``),
so they cost no extra process start-up.
"""
import pytest
import torch

from easy_context import api, packing, prepare_seq_parallel_inputs, shard_sequence, unshard_sequence
from easy_context.dispatch.plan import LAYOUT_ENV
from easy_context.sharding import (PAIRS_ENV, PAIRS_MIN_CHUNK, layout_pairs, pair_chunks, packed_rows, pairs_indices,
                                   pairs_min_chunk, pairs_shard, pairs_unshard, zigzag_pairs, zigzag_shard)
from easy_context.zigzag_ring_attn.attention import block_plan, ring_steps
from tests.tols import assert_close


# Short rows reach k > 1 only with small chunks: these tests use 256-token chunks (the setting every rank reads);
# the default (8192, chosen by measured wall time) is checked in test_pairs_choice_is_a_function_of_length_and_world.
SMALL_CHUNKS = "256"


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setenv(PAIRS_ENV, SMALL_CHUNKS)
    monkeypatch.setenv(LAYOUT_ENV, "pairs")


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


# ----------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_pairs_shard_round_trip_and_k1_is_zigzag(world):
    for k in (1, 2, 4):
        n = 2 * world * k
        x = torch.randn(2, 3 * n, 5)
        shards = [pairs_shard(x, r, world, k) for r in range(world)]
        assert torch.equal(pairs_unshard(shards, k), x)
        chunks = x.chunk(n, dim=1)
        for r in range(world):  # rank r: {i, n-1-i : i mod W == r}, increasing global order
            ids = pair_chunks(r, world, k)
            assert ids == sorted(ids) and len(ids) == 2 * k
            assert all(i % world == r or (n - 1 - i) % world == r for i in ids)
            assert torch.equal(shards[r], torch.cat([chunks[i] for i in ids], dim=1))
            assert torch.equal(pairs_indices(3 * n, r, world, k), pairs_shard(torch.arange(3 * n), r, world, k, 0))
        assert sorted(sum((pair_chunks(r, world, k) for r in range(world)), [])) == list(range(n))
        if k == 1:
            for r in range(world):
                assert torch.equal(shards[r], zigzag_shard(x, r, world))
        # one causal stream stays exactly balanced: every rank's pairs cost the same
        cost = [sum(i + (n - 1 - i) for i in pair_chunks(r, world, k)) for r in range(world)]
        assert len(set(cost)) == 1


def test_pairs_choice_is_a_function_of_length_and_world(monkeypatch):
    monkeypatch.delenv(PAIRS_ENV, raising=False)
    assert PAIRS_MIN_CHUNK == 8192 == pairs_min_chunk()  # the measured wall-time optimum (see sharding.py)
    assert zigzag_pairs(131072, 8) == 1 and zigzag_pairs(262144, 8) == 2 and zigzag_pairs(524288, 8) == 4
    assert zigzag_pairs(1 << 20, 8) == 8 and zigzag_pairs(1 << 22, 8) == 16  # capped at PAIRS_MAX
    s = dict(min_chunk=256)
    assert zigzag_pairs(131072, 8, **s) == 16 and zigzag_pairs(524288, 8, **s) == 16
    assert zigzag_pairs(4096, 2, **s) == 4 and zigzag_pairs(4096, 4, **s) == 2 and zigzag_pairs(48, 2, **s) == 1
    assert zigzag_pairs(12288, 8, **s) == 2       # 384-token chunks at k=2; k=4 would cut 192 < 256
    assert zigzag_pairs(2 * 8 * 375, 8, **s) == 1  # 375-token zigzag chunks, not a multiple of 4W: plain zigzag
    assert zigzag_pairs(1 << 20, 1) == 1          # one rank: the order is the identity anyway
    assert zigzag_pairs(96, 2, min_chunk=4) == 4 and zigzag_pairs(96, 2, min_chunk=4, max_pairs=2) == 2
    monkeypatch.setenv(PAIRS_ENV, "256")  # the setting: read at every call, so sharding and attention agree
    assert pairs_min_chunk() == 256 and zigzag_pairs(131072, 8) == 16
    for bad in ("0", "-5", "1e3", "big"):
        monkeypatch.setenv(PAIRS_ENV, bad)
        with pytest.raises(ValueError, match=PAIRS_ENV):
            zigzag_pairs(131072, 8)


def _cases():
    return {
        "restart mid row, first position not 0": torch.cat([torch.arange(7, 7 + 30), torch.arange(34)])[None],
        "no restart": torch.arange(64)[None],
        "continued document": torch.arange(9, 73)[None],
        "batch: one packed row": torch.stack([torch.arange(64), torch.cat([torch.arange(40), torch.arange(24)])]),
        "batch: none packed": torch.stack([torch.arange(64), torch.arange(3, 67)]),
        "restart at last token": torch.cat([torch.arange(63), torch.arange(1)])[None],
    }


def test_packed_detection_agrees_on_full_and_gathered_positions():
    """The sharding decides on the global positions, the attention on the rank-order concatenation of the shards
    it gathers: same answer, same k, for zigzag and USP, for every layout the answer could pick."""
    expect = {"restart mid row, first position not 0": True, "no restart": False, "continued document": False,
              "batch: one packed row": True, "batch: none packed": False, "restart at last token": True}
    for name, pos in _cases().items():
        full = packed_rows(pos)
        assert full == expect[name], name
        docs = packing.documents(pos)
        assert (docs is not None and docs.packed) == full, name
        for mode, world, kw in (("zigzag_ring_attn", 2, {}), ("zigzag_ring_attn", 4, {}),
                                ("usp_attn", 4, {"ring_degree": 2}), ("usp_attn", 8, {"ring_degree": 4})):
            for pairs in (1, 2, 4):
                if 64 % (2 * world * pairs):
                    continue
                gathered = torch.cat([shard_sequence(mode, pos, r, world, pairs=pairs, **kw) for r in range(world)], 1)
                assert packed_rows(gathered) == full, (name, mode, world, pairs)
                assert layout_pairs(gathered, 64, world, min_chunk=4) == layout_pairs(pos, 64, world, min_chunk=4)
                # and the unshard from the gathered positions restores the row
                assert torch.equal(unshard_sequence(mode, [gathered.chunk(world, 1)[r] for r in range(world)],
                                                    pairs=pairs, **kw), pos)


def test_prepare_and_shard_use_the_pair_layout_only_for_packed_rows():
    n, world = 4096, 2
    ids = torch.arange(2 * n).view(2, n)
    packed = torch.stack([_positions([5, 1, 700, 3390])[0], torch.arange(n)])  # only row 0 packed
    dense = torch.arange(n).expand(2, -1)
    for r in range(world):
        got = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, packed, ids, r, world, "cpu")
        assert torch.equal(got["local_input_ids"], pairs_shard(ids, r, world, 4))
        assert torch.equal(got["local_position_ids"], pairs_shard(packed, r, world, 4))
        plain = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, dense, ids, r, world, "cpu")
        assert torch.equal(plain["local_input_ids"], zigzag_shard(ids, r, world))  # rows without restarts: as before
        assert torch.equal(shard_sequence("zigzag_ring_attn", ids, r, world), zigzag_shard(ids, r, world))  # default
        assert torch.equal(shard_sequence("zigzag_ring_attn", ids, r, world, positions=dense),
                           zigzag_shard(ids, r, world))
    for mode, w, kw, k in (("zigzag_ring_attn", 2, {}, 4), ("usp_attn", 4, {"ring_degree": 2}, 4),
                           ("usp_attn", 4, {"ring_degree": 4}, 2), ("ulysses_attn", 4, {}, 1)):
        shards = [shard_sequence(mode, ids, r, w, positions=packed, **kw) for r in range(w)]
        assert torch.equal(unshard_sequence(mode, shards, positions=packed, **kw), ids)
        gathered = torch.cat([shard_sequence(mode, packed, r, w, positions=packed, **kw) for r in range(w)], 1)
        assert torch.equal(unshard_sequence(mode, shards, positions=gathered, **kw), ids)
        assert torch.equal(api.global_indices(mode, n, 1, w, positions=packed, **kw),
                           shard_sequence(mode, torch.arange(n), 1, w, dim=0, pairs=k, **kw))
        if mode == "usp_attn":  # the ring rank's local sequence (Ulysses pieces together) is the k-pair shard
            u = w // kw["ring_degree"]
            assert torch.equal(torch.cat(shards[:u], 1), pairs_shard(ids, 0, kw["ring_degree"], k))


def test_bad_lengths_fail_with_the_lengths_that_work():
    pos = _positions([100, 150])
    with pytest.raises(ValueError, match=r"multiple of 8; got 250 \(use 248 or 256\).*packed.*multiple of 16 of "
                                         r"at least 4096 tokens.*chunks >= 256"):
        prepare_seq_parallel_inputs("zigzag_ring_attn", torch.zeros(1, 250, dtype=torch.long), pos, None, 0, 4, "cpu")
    with pytest.raises(ValueError, match=r"multiple of 16 for packed rows over 2 ranks with 4 mirrored pairs"):
        pairs_shard(torch.zeros(1, 100), 0, 2, 4)
    q = torch.zeros(1, 8, 2, 4)
    docs = packing.documents(_positions([4, 6]))  # 10 tokens described, 8 held
    from easy_context.zigzag_ring_attn.attention import zigzag_ring_forward
    with pytest.raises(ValueError, match="docs describe a sequence of 10 tokens"):
        zigzag_ring_forward(q, q, q, 0.5, docs=docs)


# ----------------------------------------------------------------------------------------------
# the ring's pieces in the pair layout
# ----------------------------------------------------------------------------------------------
def _global_mask(world, length, docs, pairs):
    """Sum over every rank and ring step of the pieces' keep-masks, in global (query, key) coordinates."""
    m = torch.zeros(length, length, dtype=torch.long)
    for r in range(world):
        for st in ring_steps(r, world, length // world, docs, pairs=pairs):
            if st.docs is None:
                continue
            for qs, ks, c in st.docs.pieces():
                qi, ki = st.docs.q_idx[qs], st.docs.k_idx[ks]
                keep = packing.piece_mask(c, len(qi), len(ki))
                m[qi[:, None], ki[None, :]] += keep.long()
    return m


@pytest.mark.parametrize("window", [None, 5])
def test_pair_ring_pieces_are_exactly_the_document_mask(window):
    """Every rank, every ring step of the k-pair layout: the pieces cover each kept (query, key) exactly once."""
    for world, k, lengths in ((2, 2, [5, 1, 11, 7, 24]), (3, 2, [1, 40, 7]), (4, 4, [96]), (4, 2, [3] * 16),
                              (2, 4, [13, 2, 30, 1, 18])):
        n = sum(lengths)
        docs = packing.documents(_positions(lengths), window=window)
        if docs is None:
            docs = packing.Documents(torch.zeros(1, n, dtype=torch.long), window)
        d = docs.doc_ids[0]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        want = (d[:, None] == d[None, :]) & (j <= i)
        if window is not None:
            want &= j > i - window
        got = _global_mask(world, n, docs, k)
        assert int(got.max()) <= 1, (world, k, lengths)
        assert torch.equal(got.bool(), want), (world, k, lengths)


def test_ring_steps_dense_rows_keep_the_zigzag_plan():
    for world in (2, 4):
        for r in range(world):
            steps = ring_steps(r, world, 16, None)
            plan = block_plan(r, world)
            assert [(s.src, s.qs, s.ks, s.causal, s.docs) for s in steps] == \
                [(b.src, b.q_slice(8), b.kv_slice(8), b.causal, None) for b in plan]
    one_doc = packing.Documents(torch.zeros(1, 8192, dtype=torch.long), window=64)  # a sliding window, no packing
    assert not one_doc.packed and one_doc.pairs(4) == 1
    packed = packing.documents(_positions([100, 8092]))
    assert packed.packed and packed.pairs(4) == 4 and packed.with_window(64).pairs(4) == 4


def test_rectangles_of_one_document_are_joined():
    """One document over the whole row, W=2, k=2 (chunks [0,2,5,7] and [1,3,4,6] of 8): rank 0's second step
    needs, per q chunk, the kv chunks before it -- a staircase of one rectangle per q chunk, not one per
    (q chunk, kv chunk) pair."""
    n = 16
    docs = packing.Documents(torch.zeros(1, 2 * n, dtype=torch.long))  # one document of 32 tokens
    st = ring_steps(0, 2, n, docs, pairs=2)[1]  # rank 0, kv of rank 1; chunk size 4
    pieces = st.docs.pieces()
    assert [(q.start, q.stop, k.start, k.stop, c) for q, k, c in pieces] == \
        [(4, 8, 0, 4, False), (8, 12, 0, 12, False), (12, 16, 0, 16, False)]
    # and the joined rectangles equal the unjoined document attention
    g = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(1, n, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    from easy_context import kernels
    out, lse = kernels.attn_forward(q, kk, v, True, 0.5, "math", docs=st.docs)
    qi, ki = st.docs.q_idx, st.docs.k_idx
    for s, e in ((4, 8), (8, 12), (12, 16)):
        keys = [c for c in range(n) if ki[c] < qi[s]]
        ro, rl = kernels.attention_reference(q[:, s:e], kk[:, keys], v[:, keys], False, 0.5)
        assert_close(out[:, s:e], ro, 1e-12, f"rows {s}:{e}")


# ----------------------------------------------------------------------------------------------
# multi-rank (called from tests/test_packed.py's spawned ranks)
# ----------------------------------------------------------------------------------------------
def balanced_body(rank, world_size, usp_layout=None):
    """Packed rows long enough for k > 1 (4096 tokens: k=4 at W=2, k=2 at W=4, k=4 on USP's ring of 2): logits,
    loss and every gradient equal the per-document reference, as in test_packed's model checks."""
    import os
    from tests.model_equiv import check_model_equivalence
    before = {k: os.environ.get(k) for k in (PAIRS_ENV, LAYOUT_ENV)}
    os.environ[PAIRS_ENV] = SMALL_CHUNKS  # every rank of the spawn sets it alike: sharding and attention agree
    os.environ[LAYOUT_ENV] = "pairs"      # the fixed k-pair layout (the default dispatches packed rows by cost)
    try:
        _balanced_cases(rank, world_size, usp_layout, check_model_equivalence)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _balanced_cases(rank, world_size, usp_layout, check_model_equivalence):
    n = 4096
    c = n // (2 * world_size * zigzag_pairs(n, world_size))  # the fine chunk: 256 in every case here
    assert c == 256 and zigzag_pairs(n, world_size) > 1
    packings = {
        "short docs, 1-token doc, edges on and off fine chunks": _positions([5, 1, c - 6, c, 3 * c + 7, n - 5 * c - 7]),
        "one packed row, one not": torch.stack([_positions([n - 300, 300])[0], torch.arange(n)]),
    }
    cases = [("zigzag_ring_attn", {}, {}, pos) for pos in packings.values()]
    if usp_layout is not None:  # W=4: USP gets both packings, zigzag (also run at W=2) the first only
        cases = cases[:1] + [("usp_attn", usp_layout.layout_kw, usp_layout.attn_groups(), pos)
                             for pos in packings.values()]
    for mode, layout_kw, groups, pos in cases:
        check_model_equivalence(rank, world_size, mode, "llama", seq_len=n, batch=pos.shape[0], layout_kw=layout_kw,
                                groups=groups, position_ids=pos, labels_mask="random")
    if world_size == 4:
        _count_pair_blocks(rank, world_size)
    else:
        _plain_zigzag_shard_of_packed_rows_is_refused(rank, world_size, packings)


def _plain_zigzag_shard_of_packed_rows_is_refused(rank, world_size, packings):
    """A long packed row cut in plain zigzag (no positions=) while the attention expects k pairs: the same clear
    error on every rank (no hang, no silently wrong attention)."""
    import copy

    from easy_context import apply_seq_parallel_monkey_patch
    from tests.model_equiv import build_model
    model = apply_seq_parallel_monkey_patch("zigzag_ring_attn", copy.deepcopy(build_model("llama")))
    pos = next(iter(packings.values()))
    ids = torch.zeros_like(pos)
    local = [shard_sequence("zigzag_ring_attn", t, rank, world_size) for t in (ids, pos)]
    with pytest.raises(packing.PackedPositionsError, match=r"jumps from .* balanced k-pair zigzag layout.*prepare_seq_parallel_inputs"):
        model(local[0], position_ids=local[1], use_cache=False)


def _count_pair_blocks(rank, world_size):
    """k=2 at W=4 (16 chunks of 256), documents of 128 tokens that never cross a chunk: every ring step but the
    first is skipped (no kernel, no merge) and the first runs one causal piece per local document."""
    from easy_context import kernels, zigzag_ring_attn_func
    from easy_context.zigzag_ring_attn.attention import zigzag_ring_forward
    n, calls = 4096, {"fwd": 0, "merge": 0}
    docs = packing.documents(_positions([128] * 32))
    assert docs.pairs(world_size) == 2
    orig_fwd, orig_merge = kernels._FORWARD["cpu"], kernels.merge_attn_out

    def fwd(*a):
        calls["fwd"] += 1
        return orig_fwd(*a)

    def merge(*a):
        calls["merge"] += 1
        return orig_merge(*a)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 2, 8, generator=g) for _ in range(3))
    loc = [shard_sequence("zigzag_ring_attn", t, rank, world_size, pairs=2) for t in (q, k, v)]
    kernels._FORWARD["cpu"], kernels.merge_attn_out = fwd, merge
    try:
        packed = zigzag_ring_forward(*loc, 0.35, docs=docs)
    finally:
        kernels._FORWARD["cpu"], kernels.merge_attn_out = orig_fwd, orig_merge
    assert calls == {"fwd": 8, "merge": 8}, calls  # 4 local chunks x 2 documents, merged into the step-0 block
    ref = torch.cat([kernels.attention_reference(q[:, s:s + 128], k[:, s:s + 128], v[:, s:s + 128], True, 0.35)[0]
                     for s in range(0, n, 128)], dim=1)
    want = shard_sequence("zigzag_ring_attn", ref, rank, world_size, pairs=2)
    assert_close(packed[0], want, 1e-5, "pair ring out")
    out = zigzag_ring_attn_func(*(t.clone().requires_grad_() for t in loc), softmax_scale=0.35, docs=docs)
    assert_close(out, want, 1e-5, "pair ring func out")
