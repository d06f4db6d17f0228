"""train.py's read-ahead (easy_context_train/plan_ahead.py): the next step's packed-row dispatch planned in a helper process.

The tables must be the ones prepare_seq_parallel_inputs would plan itself, the checkpointed data position must be
that of the batches handed out (not the ones read ahead), and a lost helper or a table of another batch must never
change what is trained on.
"""
import pytest
import torch

from easy_context import prepare_seq_parallel_inputs
from easy_context.dispatch.plan import DISPATCH_KWARG, DispatchError
from easy_context.registry import SEQ_ALGOS, get_mode
from easy_context_train import plan_ahead
from easy_context_train.plan_ahead import PlannedBatches, plan_table

# a ring mode whose cut deals packed rows by cost (no extra degrees)
MODE = next(get_mode(n) for n in SEQ_ALGOS if get_mode(n).dispatches and not get_mode(n).degree_kwargs)
UNDISPATCHED = next(get_mode(n) for n in SEQ_ALGOS if not get_mode(n).dispatches)


class _Layout:
    def __init__(self, mode, sp=4):
        self.mode, self.sp, self.layout_kw, self.packed_dispatch = mode, sp, {}, True


class _Loader:
    """A stateful loader: ``state_dict`` counts the batches read (like easy_context.data's)."""

    def __init__(self, rows):
        self.rows, self.read = rows, 0

    def __iter__(self):
        while self.read < len(self.rows):
            self.read += 1
            yield self.rows[self.read - 1]

    def state_dict(self):
        return {"batch": self.read}


def _row(lengths, seed=0):
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, 100, pos.shape, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "position_ids": pos}


ROWS = [_row([700, 20, 900, 1, 428]), _row([2049]), _row([30, 1500, 519], 1), _row([1024, 1025], 2),
        _row([5, 5, 2039], 3)]


@pytest.mark.parametrize("ahead", [1, 2])
def test_tables_equal_planning_here_and_the_state_is_that_of_the_batches_handed_out(ahead):
    loader = _Loader(ROWS)
    batches = PlannedBatches(iter(loader), loader, _Layout(MODE), ahead)
    try:
        got = list(batches)
        assert batches.state_dict() == {"batch": len(ROWS)}
    finally:
        batches.close()
    assert len(got) == len(ROWS)
    for (inp, pos, tgt, table), row in zip(got, ROWS):
        assert torch.equal(inp, row["input_ids"][:, :-1]) and torch.equal(pos, row["position_ids"][:, :-1])
        assert table == plan_table(MODE.name, 4, {}, pos)  # None for the one-document row
    assert [t is None for *_, t in got] == [False, True, False, False, False]
    # only the first step's tables were planned here; the rest came from the helper
    assert batches.planned_here == sum(t is not None for *_, t in got[:ahead])

    loader, states = _Loader(ROWS), []
    batches = PlannedBatches(iter(loader), loader, _Layout(MODE), ahead)
    for _ in range(3):
        next(batches)
        states.append(batches.state_dict())
    batches.close()
    assert states == [{"batch": 1}, {"batch": 2}, {"batch": 3}]
    assert loader.read == min(3 + ahead, len(ROWS))  # it did read ahead; the checkpointed position did not move


def test_a_table_planned_elsewhere_shards_exactly_like_one_planned_here():
    inp, pos = ROWS[0]["input_ids"][:, :-1], ROWS[0]["position_ids"][:, :-1]
    table = plan_table(MODE.name, 4, {}, pos)
    for rank in range(4):
        given = prepare_seq_parallel_inputs(MODE.name, inp, pos, None, rank, 4, "cpu", dispatch=table)
        here = prepare_seq_parallel_inputs(MODE.name, inp, pos, None, rank, 4, "cpu", dispatch="auto")
        assert torch.equal(given["local_input_ids"], here["local_input_ids"])
        assert given.model_kwargs[DISPATCH_KWARG] == table == here.layout.dispatch
    other = plan_table(MODE.name, 4, {}, ROWS[2]["position_ids"][:, :-1])
    with pytest.raises(DispatchError, match="dispatch=.*other position ids"):
        prepare_seq_parallel_inputs(MODE.name, inp, pos, None, 0, 4, "cpu", dispatch=other)


def test_no_helper_for_rows_without_restarts_nor_for_modes_that_never_dispatch():
    for mode, rows in ((MODE, [ROWS[1]] * 3), (UNDISPATCHED, ROWS)):
        loader = _Loader(rows)
        batches = PlannedBatches(iter(loader), loader, _Layout(mode), 1)
        assert all(t is None for *_, t in batches)
        assert batches._planner._pool is None and batches.planned_here == 0


def test_a_lost_helper_falls_back_to_planning_here(monkeypatch):
    class Broken:
        def result(self):
            raise RuntimeError("helper died")

    loader = _Loader(ROWS)
    batches = PlannedBatches(iter(loader), loader, _Layout(MODE), 1)
    planner = batches._planner
    monkeypatch.setattr(planner, "submit", lambda pos: Broken() if planner.wants(pos) else None)
    got = [t for *_, t in batches]
    assert got == [plan_table(MODE.name, 4, {}, r["position_ids"][:, :-1]) for r in ROWS]
    assert batches.planned_here == 4  # the first, inline; three lost jobs (the one-document row needs none)

    from easy_context.dispatch import ahead as dispatch_ahead  # the helper's pool is library code (train.py's read-ahead uses it)
    monkeypatch.setattr(dispatch_ahead, "ProcessPoolExecutor",
                        lambda **kw: (_ for _ in ()).throw(OSError("no spawn")))
    loader = _Loader(ROWS)
    batches = PlannedBatches(iter(loader), loader, _Layout(MODE), 1)
    assert [t for *_, t in batches][1:] == [None] * 4  # submit failed: prepare_seq_parallel_inputs plans them


def test_trainer_windows_get_the_next_windows_tables_from_the_helper(monkeypatch):
    """The Trainer integration (integrations/trainer.py get_batch_samples) reads the next window while cutting this
    one: its tables come from the helper, equal the ones prepare_seq_parallel_inputs plans, and every batch is cut
    once, in order, across windows (GA = 2, 5 rows: windows of 2, 2, 1)."""
    from types import SimpleNamespace

    from easy_context.integrations.trainer import SeqParallelTrainerMixin
    from easy_context.integrations.batches import TARGETS, shard_batch
    from easy_context.parallel_layout import ParallelLayout

    layout = ParallelLayout(MODE.name, 4, 1, 1, 4, 4, 1)
    t = SeqParallelTrainerMixin()  # the methods under test only need these attributes
    t._ec_layout, t._ec_pad_id = layout, 0
    t._ec_opts = SimpleNamespace(pad_to_multiple=True)
    t.args = SimpleNamespace(gradient_accumulation_steps=2)
    rows = [dict(r, labels=r["input_ids"]) for r in ROWS]
    it, got, planned = iter(rows), [], []
    orig = plan_ahead.HelperPlanner.result
    monkeypatch.setattr(plan_ahead.HelperPlanner, "result",
                        lambda self, job, pos: planned.append(hasattr(job, "result")) or orig(self, job, pos))
    try:
        for n in (2, 2, 1):
            shards, count = t.get_batch_samples(it, n, torch.device("cpu"))
            assert len(shards) == n and count is not None
            got += shards
        assert t.get_batch_samples(it, 2, torch.device("cpu")) == ([], None)
    finally:
        t._ec_ahead["planner"].close()
    for shard, row in zip(got, rows):
        want = shard_batch(dict(row), layout)  # planned here, by prepare_seq_parallel_inputs
        for k in ("input_ids", "position_ids", TARGETS):
            assert torch.equal(shard[k], want[k]), k
        assert shard.get(DISPATCH_KWARG) == want.get(DISPATCH_KWARG)
    # the first window is planned in prepare_inputs; the packed rows of the later ones by the helper
    assert planned[:2] == [False, False] and planned[2] and planned[4], planned


def test_the_models_window_reaches_the_helpers_planner_and_the_cut_alike():
    """A model whose every attention layer is windowed (hf.config.attention_window): train.py's layout
    (easy_context_train/parallel.build_layout(..., config)) carries the window, the helper plans with it, and
    prepare_inputs cuts by the same table. Long documents then deal by their windowed cost, not their causal square:
    another table than the window-blind one. Models mixing global and local layers, or without a window: None."""
    import transformers as tf

    from easy_context.hf.config import attention_window
    from easy_context.parallel_layout import ParallelLayout
    from easy_context_train.parallel import build_layout
    small = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                 intermediate_size=64, vocab_size=64)
    assert attention_window(tf.MistralConfig(sliding_window=256, **small)) == 256
    assert attention_window(tf.MistralConfig(sliding_window=None, **small)) is None
    assert attention_window(tf.Qwen2Config(use_sliding_window=False, sliding_window=256, **small)) is None
    assert attention_window(tf.Qwen2Config(use_sliding_window=True, sliding_window=256, max_window_layers=0,
                                           **small)) == 256
    gemma = dict(small, num_hidden_layers=6, head_dim=16, sliding_window=256)  # 5 local layers, then a global one
    assert attention_window(tf.Gemma3TextConfig(**gemma)) is None
    assert build_layout(MODE.name, None, None, 2048, tf.MistralConfig(sliding_window=256, **small)).dispatch_window \
        == 256
    assert build_layout(MODE.name, None, None, 2048).dispatch_window is None

    layout = ParallelLayout(MODE, 4, 0, 1, 4, 4, 1, dispatch_window=256)
    assert layout.layout_kw == {"window": 256}
    rows = [_row([1500, 100, 300, 149]), _row([100, 1200, 749], 1)]  # documents far past the window
    loader = _Loader(rows)
    batches = PlannedBatches(iter(loader), loader, layout, 1)
    try:
        got = list(batches)
    finally:
        batches.close()
    assert batches.planned_here == 1  # the second table came from the helper
    for inp, pos, _, table in got:
        assert table == plan_table(MODE.name, 4, {"window": 256}, pos) != plan_table(MODE.name, 4, {}, pos)
        for rank in range(4):
            layout.rank = rank
            here = layout.prepare_inputs(inp, pos, None, "cpu")
            assert here.model_kwargs[DISPATCH_KWARG] == table
