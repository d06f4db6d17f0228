"""ParallelLayout (dp x sp, ring x ulysses), prepare_dataloader and the token-weighted loss.

Pure-logic tests need no process group; one spawn of 4 gloo ranks checks the groups, the data split and a
dp 2 x sp 2 zigzag model step against the single-process run over both samples.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from easy_context import (ParallelLayout, apply_seq_parallel_monkey_patch, prepare_dataloader, shard_sequence,
                          unshard_sequence)
from easy_context.loss import sp_token_mean_loss, token_nll_sum
from easy_context.parallel_layout import plan_degrees
from tests.harness import run_ranks
from tests.tols import assert_close


# ----------------------------------------------------------------------------------------------
# pure logic: degrees, coordinates, messages
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(seq_algo="zigzag_ring_attn", world_size=4, sp_size=3),
     r"world_size 4 / 3 = 1.33.*valid sp sizes: \[1, 2, 4\]"),
    (dict(seq_algo="zigzag_ring_attn", world_size=4, sp_size=2, dp_size=3), r"dp\(3\) x sp\(2\) = 6 != world_size 4"),
    (dict(seq_algo="usp_attn", world_size=8, sp_size=4, ring_degree=3), r"ring x ulysses = sp\(4\).*\[1, 2, 4\]"),
    (dict(seq_algo="usp_attn", world_size=4, ring_degree=0), r"valid ring degrees"),
    (dict(seq_algo="data_parallel", world_size=4, sp_size=2), r"no sequence parallelism"),
    (dict(seq_algo="ulysses_attn", world_size=4, ring_degree=2), r"only applies to usp_attn"),
    (dict(seq_algo="ring", world_size=4), r"valid modes"),
    (dict(seq_algo="ulysses_attn", world_size=6, dp_size=4), r"valid dp sizes: \[1, 2, 3, 6\]"),
    (dict(seq_algo="data_parallel", world_size=4, dp_size=2), r"dp\(2\) x sp\(1\) = 2 != world_size 4"),
])
def test_invalid_degrees(kw, match):
    algo, world = kw.pop("seq_algo"), kw.pop("world_size")
    with pytest.raises(ValueError, match=match):
        plan_degrees(algo, world, **kw)
    with pytest.raises(ValueError, match=match):  # build validates before creating any group
        ParallelLayout.build(algo, world_size=world, **kw)


def test_coordinates_and_str():
    lay = ParallelLayout.build("usp_attn", sp_size=4, ring_degree=2, world_size=8, rank=5)
    assert str(lay) == "DP(2)-SP(4: R2\u00d7U2)"
    assert (lay.dp, lay.sp, lay.ring, lay.ulysses) == (2, 4, 2, 2)
    assert (lay.dp_rank, lay.sp_rank, lay.ring_rank, lay.ulysses_rank) == (1, 1, 0, 1)
    assert lay.seq_multiple == 8 and lay.layout_kw == {"ring_degree": 2}
    sets = lay._rank_sets()
    assert sets["sp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sets["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sets["ulysses"] == [[0, 1], [2, 3], [4, 5], [6, 7]]       # consecutive: all-to-all in a node
    assert sets["ring"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert "ring 0, ulysses 1" in lay.describe()

    assert str(ParallelLayout.build("zigzag_ring_attn", sp_size=4, world_size=8)) == "DP(2)-SP(4)"
    assert ParallelLayout.build("zigzag_ring_attn", world_size=4).seq_multiple == 8
    assert ParallelLayout.build("ulysses_attn", world_size=4).seq_multiple == 4
    dp = ParallelLayout.build("data_parallel", world_size=4, rank=3)
    assert (dp.dp, dp.sp, dp.dp_rank, str(dp)) == (4, 1, 3, "DP(4)-SP(1)")
    assert dp.attn_groups("data_parallel") == {}
    usp = ParallelLayout.build("usp_attn", world_size=4)  # ring_degree None: ring = sp, as the layout
    assert (usp.ring, usp.ulysses) == (4, 1)
    assert set(usp.attn_groups()) == {"ring_group", "ulysses_group"}
    with pytest.raises(ValueError, match="built for usp_attn"):
        usp.attn_groups("zigzag_ring_attn")


def test_length_and_heads_errors_name_the_fix():
    lay = ParallelLayout.build("usp_attn", sp_size=4, ring_degree=2, world_size=8)
    lay.check_seq_len(64)
    with pytest.raises(ValueError, match=r"multiple of 8; use 96 or 104"):
        lay.check_seq_len(100)
    uly = ParallelLayout.build("ulysses_attn", sp_size=8, world_size=8)
    uly.check_heads(32, 8)
    uly.check_heads(8, 2)  # 2 kv heads on 8 ranks: replicated
    with pytest.raises(ValueError, match=r"largest valid one <= 8 is 6"):
        uly.check_heads(12, 4)
    lay.check_heads(4, 1)


def test_shard_matches_api():
    x = torch.arange(32).view(1, 32)
    lay = ParallelLayout.build("usp_attn", sp_size=4, ring_degree=2, world_size=8, rank=6)
    assert torch.equal(lay.shard(x), shard_sequence("usp_attn", x, 2, 4, ring_degree=2))


# ----------------------------------------------------------------------------------------------
# pure logic: loss and loader
# ----------------------------------------------------------------------------------------------
def test_loss_single_process_and_no_valid_label():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 6))
    targets[0, :4] = -100
    assert_close(sp_token_mean_loss(logits, targets), F.cross_entropy(logits.view(-1, 11), targets.view(-1)),
                 name="loss")
    none = torch.full((2, 6), -100)
    s, n = token_nll_sum(logits, none)
    assert float(s.detach()) == 0.0 and int(n) == 0
    loss = sp_token_mean_loss(logits, none)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.isfinite(logits.grad).all() and float(logits.grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="disagree"):
        token_nll_sum(logits, targets[:, :5])


def _rows(loader):
    return [b.view(-1).tolist() for b in loader]


def test_sharded_loader_split_shuffle_resume():
    data = list(range(10))
    dl = DataLoader(data, batch_size=2, shuffle=True)
    plain = prepare_dataloader("zigzag_ring_attn", dl, None)   # no layout, no process group: dp 1
    assert sorted(sum(_rows(plain), [])) == data
    from easy_context.data import ShardedLoader
    shards = [ShardedLoader(data, 2, dl.collate_fn, dp=2, dp_rank=r, shuffle=True, seed=3) for r in (0, 1)]
    seen = [sum(_rows(s), []) for s in shards]
    assert sorted(seen[0] + seen[1]) == data and not set(seen[0]) & set(seen[1])
    again = ShardedLoader(data, 2, dl.collate_fn, dp=2, dp_rank=0, shuffle=True, seed=3)
    assert sum(_rows(again), []) == seen[0]                        # same seed, same order, by construction
    # resume: stop after 2 batches of epoch 0, restore into a fresh loader, get the rest
    a = ShardedLoader(data, 2, dl.collate_fn, dp=1, dp_rank=0, shuffle=True, seed=5)
    full = _rows(a)
    a.set_epoch(0)
    it = iter(a)
    head = [next(it).view(-1).tolist() for _ in range(2)]
    state = a.state_dict()
    assert state == {"epoch": 0, "batch": 2} and head == full[:2]
    b = ShardedLoader(data, 2, dl.collate_fn, dp=1, dp_rank=0, shuffle=True, seed=5)
    b.load_state_dict(state)
    assert _rows(b) == full[2:] and b.state_dict() == {"epoch": 1, "batch": 0}
    assert len(b) == 5


# ----------------------------------------------------------------------------------------------
# 4 ranks: groups, data split, dp 2 x sp 2 model step
# ----------------------------------------------------------------------------------------------
def _members(group, rank):
    """All ranks of ``group`` (checked by an all_gather inside it)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, rank, group=group)
    return out


def _dp_sp_step(rank, layout, family, labels_mask, seed):
    """dp2 x sp2: dp rank d trains on sample d; summed grads == single process on both samples."""
    from tests.model_equiv import build_model, make_batch, reference_step
    ref = build_model(family, seed=seed)
    seq = 32
    if labels_mask == "one_rank":  # every valid label on world rank 0 (dp 0, sp 0); ranks 1-3 have none
        valid = torch.zeros(2, seq, dtype=torch.bool)
        valid[0, shard_sequence(layout.seq_algo, torch.arange(seq), 0, layout.sp, dim=0, **layout.layout_kw)] = True
        labels_mask = valid
    ids, pos, tgt = make_batch(2, seq, ref.config.vocab_size, seed=seed + 1, labels_mask=labels_mask)
    import copy
    model = copy.deepcopy(ref)
    ref_logits, ref_loss, ref_grads = reference_step(ref, ids, pos, tgt)

    # the samples come through prepare_dataloader: dp rank d gets sample d, both sp ranks the same one
    samples = [{"input_ids": ids[i], "position_ids": pos[i], "target_ids": tgt[i]} for i in range(2)]
    loader = prepare_dataloader(layout.seq_algo, DataLoader(samples, batch_size=1), None, layout=layout)
    (batch,) = list(loader)
    assert torch.equal(batch["input_ids"][0], ids[layout.dp_rank])

    apply_seq_parallel_monkey_patch(layout.seq_algo, model, layout=layout)
    prep = layout.prepare_inputs(batch["input_ids"], batch["position_ids"], batch["target_ids"], "cpu")
    logits = model(prep["local_input_ids"], position_ids=prep["local_position_ids"], use_cache=False).logits
    # DDP / DeepSpeed average over the 4 ranks: scale by 4 so that average == sum
    loss = sp_token_mean_loss(logits, prep["local_target_ids"], grads_averaged_over=layout.world_size)
    assert torch.isfinite(loss), f"rank {rank}: loss {loss}"
    loss.backward()

    tag = f"[dp2xsp2 {layout.seq_algo} {family} mask={'one_rank' if torch.is_tensor(labels_mask) else labels_mask}]"
    total = loss.detach() / layout.world_size
    dist.all_reduce(total)
    assert_close(total, ref_loss, 1e-5, f"{tag} loss")
    parts = [torch.empty_like(logits) for _ in range(layout.sp)]
    dist.all_gather(parts, logits.detach().contiguous(), group=layout.sp_group)
    full = unshard_sequence(layout.seq_algo, parts, dim=1, **layout.layout_kw)
    assert_close(full[0], ref_logits[layout.dp_rank], 1e-5, f"{tag} logits of sample {layout.dp_rank}")
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        g /= layout.world_size  # what DDP's average does (gloo has no AVG)
        assert_close(g, ref_grads[name], 1e-5, f"{tag} grad {name}")


def _body(rank, world_size):
    # --- invalid layouts raise on every rank before any new_group (else the groups below would mismatch)
    for kw in (dict(sp_size=3), dict(sp_size=2, dp_size=3), dict(world_size=8)):
        try:
            ParallelLayout.build("zigzag_ring_attn", **kw)
        except ValueError:
            pass
        else:
            raise AssertionError(f"no error for {kw}")
    try:
        ParallelLayout.build("usp_attn", ring_degree=3)
    except ValueError as e:
        assert "valid ring degrees: [1, 2, 4]" in str(e)
    else:
        raise AssertionError("no error for ring_degree=3")

    # --- groups: membership checked by collectives inside each group
    zz = ParallelLayout.build("zigzag_ring_attn", sp_size=2)
    assert (str(zz), zz.dp_rank, zz.sp_rank) == ("DP(2)-SP(2)", rank // 2, rank % 2)
    assert _members(zz.sp_group, rank) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert _members(zz.dp_group, rank) == [rank % 2, rank % 2 + 2]
    assert zz.attn_groups("zigzag_ring_attn") == {"group": zz.sp_group}
    usp = ParallelLayout.build("usp_attn", ring_degree=2)
    assert usp.sp_group is None and usp.dp_group is not None        # sp spans the world
    assert _members(usp.ulysses_group, rank) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert _members(usp.ring_group, rank) == [rank % 2, rank % 2 + 2]
    dpl = ParallelLayout.build("data_parallel")
    assert dpl.dp_group is None and dist.get_world_size(dpl.sp_group) == 1

    # --- data: sp peers see identical batches, dp groups disjoint, union = dataset (zigzag dp2 x sp2)
    data = list(range(12))
    seen = sum(_rows(prepare_dataloader("zigzag_ring_attn", DataLoader(data, batch_size=2, shuffle=True),
                                        None, layout=zz, seed=7)), [])
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    assert everyone[0] == everyone[1] and everyone[2] == everyone[3], everyone
    assert sorted(everyone[0] + everyone[2]) == data
    # no layout, sp mode: one sp group over the world, everyone the same batches
    seen = _rows(prepare_dataloader("ulysses_attn", DataLoader(data, batch_size=3), None))
    dist.all_gather_object(everyone, seen)
    assert all(e == everyone[0] for e in everyone) and sorted(sum(everyone[0], [])) == data
    # data_parallel without a layout: dp over the world
    seen = sum(_rows(prepare_dataloader("data_parallel", DataLoader(data, batch_size=1), None)), [])
    dist.all_gather_object(everyone, seen)
    assert sorted(sum(everyone, [])) == data

    # --- dp 2 x sp 2 zigzag over 2 different samples, then all valid labels on one rank
    for family in ("llama", "qwen2"):
        _dp_sp_step(rank, zz, family, "random", seed=0)
    _dp_sp_step(rank, zz, "llama", "one_rank", seed=3)
    # and with USP inside each dp group: dp 2 x sp 2 (ring 1 x ulysses 2)
    usp2 = ParallelLayout.build("usp_attn", sp_size=2, ring_degree=1)
    assert str(usp2) == "DP(2)-SP(2: R1\u00d7U2)"
    _dp_sp_step(rank, usp2, "llama", "random", seed=5)


def test_dp_sp_4_ranks():
    run_ranks(_body, world_size=4, timeout=240)
