"""Data-parallel balance of packed rows (issue #28): sum L^2 per row, the balanced epoch order, the loader (disjoint
rows per step, resume from its state_dict, refusal of another dp size), and make_loader's flag."""

import pytest
import torch

from easy_context_train.dp_balance import (BalancedLoader, balanced_order, doc_square_sums, row_costs,
                                              step_balance)


def _rows(n_rows, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_rows):
        cuts = sorted(torch.randint(1, length, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist())
        lens = [b - a for a, b in zip([0] + cuts, cuts + [length]) if b > a]
        out.append(torch.cat([torch.arange(n) for n in lens]))
    return torch.stack(out)


def test_doc_square_sums():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [3, 4, 0, 1, 2, 3]])
    assert doc_square_sums(pos).tolist() == [9 + 4 + 1, 36, 4 + 16]


def test_balanced_order_covers_every_row_and_balances():
    costs = doc_square_sums(_rows(203, 64)).tolist()
    for dp, batch in ((4, 1), (2, 3)):
        order = balanced_order(costs, dp, batch, seed=1, epoch=0)
        per_step = dp * batch
        assert len(order) % per_step == 0 and set(order) == set(range(203)) and len(order) - 203 < per_step
        assert order == balanced_order(costs, dp, batch, seed=1, epoch=0)          # deterministic
        assert order != balanced_order(costs, dp, batch, seed=1, epoch=1)          # reshuffled per epoch
        g = torch.Generator().manual_seed(1)
        plain = torch.randperm(203, generator=g).tolist()
        plain += plain[: (-203) % per_step]
        before = step_balance(costs, plain, dp, batch)
        after = step_balance(costs, order, dp, batch)
        assert sum(after) / len(after) < sum(before) / len(before), (dp, batch)
        assert sum(after) / len(after) < 1.1


def _ds(n=40, length=33):
    from datasets import Dataset
    pos = _rows(n, length, seed=3)
    return Dataset.from_dict({"input_ids": [[i] * length for i in range(n)], "position_ids": pos.tolist()})


def test_loader_disjoint_resumable_and_refuses_another_dp():
    ds = _ds()
    costs = row_costs(ds)
    assert costs == doc_square_sums(torch.tensor(ds["position_ids"])).tolist()

    def collate(rows):
        return torch.tensor([r["input_ids"][0] for r in rows])  # the row numbers

    def loader(rank, dp=2):
        return BalancedLoader(ds, costs, 3, collate, dp, rank, shuffle=True, seed=5, drop_last=True)

    ranks = [list(loader(r)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(loader(0)) == 7  # ceil(40 / 6) steps
    steps = [ranks[0][t].tolist() + ranks[1][t].tolist() for t in range(7)]
    assert all(len(set(s)) == 6 for s in steps)  # the dp ranks of a step hold different rows
    assert set(sum(steps, [])) == set(range(40))  # every row (2 pad rows wrap around)
    first = loader(0)
    it = iter(first)
    got = [next(it), next(it)]
    state = first.state_dict()
    assert state["batch"] == 2 and len(state["dp_balance"]["order"]) == 42
    resumed = loader(0)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert all(torch.equal(a, b) for a, b in zip(got + rest, ranks[0])) and len(got + rest) == 7
    with pytest.raises(ValueError, match="4 x 3.*same data-parallel size"):
        loader(0, dp=4).load_state_dict(state)


def test_make_loader_flag():
    from easy_context_train.data import make_loader
    ds = _ds().with_format("torch")  # as train.py's validate_packed leaves it
    from easy_context import ParallelLayout
    layout = ParallelLayout.build("zigzag_ring_attn", sp_size=1, world_size=2, rank=1)  # dp 2, this is dp rank 1
    assert isinstance(make_loader(ds, layout, 2, 32, 0, None), BalancedLoader)
    assert not isinstance(make_loader(ds, layout, 2, 32, 0, None, balance="off"), BalancedLoader)
    one = ParallelLayout.build("zigzag_ring_attn", world_size=1)
    assert not isinstance(make_loader(ds, one, 2, 32, 0, None), BalancedLoader)
    assert isinstance(make_loader(ds.remove_columns("position_ids"), layout, 2, 32, 0, None,
                                  balance="on"), BalancedLoader)
    batch = next(iter(make_loader(ds, layout, 2, 32, 0, None)))
    assert set(batch) == {"input_ids", "position_ids"} and batch["input_ids"].shape == (2, 33)
