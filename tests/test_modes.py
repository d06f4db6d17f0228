"""The Mode anatomy of every registered mode (no process group), and a mode added from outside the library
(tests/toy_mode: one package + one ``register_mode`` line) running through train.py's loader, the patch and
SeqParallelLM on 2 gloo ranks, equal to one process; the planner refuses it (it has no cost model)."""
from __future__ import annotations

import ast
import os

import pytest
import torch

from easy_context.mode import Mode
from easy_context.parallel_layout import ParallelLayout, plan_degrees
from easy_context.registry import SEQ_ALGOS, get_mode, mode_names, register_mode, unregister_mode
from tests.harness import run_ranks
from tests.tols import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = "tests.toy_mode.mode:ToyRingMode"


@pytest.fixture
def toy():
    mode = register_mode(TOY)
    try:
        yield mode
    finally:
        unregister_mode(mode.name)


def _degree_cases(name):
    """(world, kwargs) the mode accepts, with the ring degree where it takes one."""
    mode = get_mode(name)
    if not mode.is_parallel:
        return [(w, {}) for w in (1, 2, 4)]
    cases = [(w, {}) for w in (1, 2, 4)] + [(4, {"sp_size": 2})]
    if "ring_degree" in mode.degree_kwargs:
        cases += [(4, {"ring_degree": 2}), (4, {"ring_degree": 1}), (8, {"sp_size": 4, "ring_degree": 2})]
    return cases


# ------------------------------------------------------------------------------------------ anatomy, no spawn
@pytest.mark.parametrize("name", SEQ_ALGOS)
def test_mode_anatomy(name):
    mode = get_mode(name)
    assert isinstance(mode, Mode) and mode.name == name and get_mode(mode) is mode
    assert type(mode).__module__ == f"{type(mode).__module__.rsplit('.', 1)[0]}.mode"  # <package>/mode.py
    for world, kw in _degree_cases(name):
        dp, sp, ring, uly = plan_degrees(name, world, **kw)
        assert dp * sp == world and ring * uly == sp, (name, world, kw, (dp, sp, ring, uly))
        layout = ParallelLayout.build(mode, world_size=world, **kw)
        assert (layout.dp, layout.sp, layout.ring, layout.ulysses) == (dp, sp, ring, uly)
        assert layout.mode is mode and layout.seq_algo == name
        m = layout.seq_multiple
        x = torch.arange(3 * 2 * m * 5).reshape(2, 3 * m, 5)  # (batch, seq, features), cut along dim 1
        cut = mode.layout_kw(ring_degree=layout.ring)
        shards = [mode.shard(x, r, sp, dim=1, **cut) for r in range(sp)]
        assert sum(s.shape[1] for s in shards) == x.shape[1]
        assert torch.equal(mode.unshard(shards, dim=1, **cut), x), (name, world, kw)
        if sp > 1 and mode.is_parallel:
            with pytest.raises(ValueError, match=str(m)):
                layout.check_seq_len(3 * m + 1)
    if not mode.is_parallel:
        with pytest.raises(ValueError, match="no sequence parallelism"):
            plan_degrees(name, 4, sp_size=2)
    elif "ring_degree" not in mode.degree_kwargs:
        with pytest.raises(ValueError, match="only applies to usp_attn"):
            plan_degrees(name, 4, ring_degree=2)
    assert mode.plan_problem(32, 4096, 1 if not mode.is_parallel else 2, None) is None  # every built-in is costed


def test_packed_cut_roundtrip():
    """Packed rows (positions restarting at 0) go through the same shard/unshard with positions= in every mode."""
    from easy_context.sharding import PAIRS_ENV
    os.environ[PAIRS_ENV] = "4"
    try:
        pos = torch.cat([torch.arange(40), torch.arange(24)]).unsqueeze(0)  # 64 tokens, two documents
        for name in SEQ_ALGOS:
            mode = get_mode(name)
            for world, kw in _degree_cases(name):
                layout = ParallelLayout.build(mode, world_size=world, **kw)
                cut = mode.layout_kw(ring_degree=layout.ring)
                shards = [mode.shard(pos, r, layout.sp, dim=1, positions=pos, **cut) for r in range(layout.sp)]
                back = mode.unshard(shards, dim=1, positions=pos, **cut)  # the global positions (a dispatch table)
                assert torch.equal(back, pos), (name, world, kw)
    finally:
        del os.environ[PAIRS_ENV]


def test_registry_lists_and_errors(toy):
    assert tuple(SEQ_ALGOS) == mode_names()[:len(SEQ_ALGOS)] and mode_names()[-1] == "toy_ring"
    with pytest.raises(ValueError, match="already registered"):
        register_mode(TOY)
    with pytest.raises(ValueError, match="valid modes: .*toy_ring"):
        get_mode("nope")
    with pytest.raises(ValueError, match="built-in"):
        unregister_mode("zigzag_ring_attn")
    from easy_context_train.args import build_parser  # --parallel_mode's choices come from the registry
    assert build_parser().parse_args(["--output-dir", "o", "--parallel_mode", "toy_ring"]).parallel_mode == "toy_ring"


def test_planner_refuses_a_mode_without_cost_model(toy):
    from easy_context.tools.plan import Env, Option, load_shape, predict
    from easy_context.tools.plan.options import layout_problem
    from easy_context.tools.plan.search import layouts
    shape = load_shape("llama-2-7b")
    opt = Option("toy_ring", 1, 8, "layer", True, False, "zero3-offload")
    assert "no planner cost model" in layout_problem(shape, opt, 65536)
    assert not any(m == "toy_ring" for m, *_ in layouts(shape, 8, 65536))
    assert {m for m, *_ in layouts(shape, 8, 65536)} == set(SEQ_ALGOS)
    with pytest.raises(ValueError, match="cannot cost toy_ring"):
        predict(shape, opt, Env("h200", 8, 1, 65536))


def test_no_mode_literals_outside_their_packages():
    """Mode names as string constants (not docstrings) appear only in the registry, their own package, the
    planner's nothing, train.py's nothing: code asks the Mode, never compares names."""
    pkg_of = {n: type(get_mode(n)).__module__.split(".")[1] for n in SEQ_ALGOS}
    files = [os.path.join(ROOT, f) for f in ("train.py", "eval_ppl.py", "eval_needle.py", "eval_ruler.py")]
    for d, _, names in os.walk(os.path.join(ROOT, "easy_context")):
        files += [os.path.join(d, f) for f in names if f.endswith(".py")]
    found = []
    for path in files:
        rel = os.path.relpath(path, ROOT)
        if rel == os.path.join("easy_context", "registry.py"):
            continue
        tree = ast.parse(open(path).read())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in pkg_of and id(node) not in docs:
                if not rel.startswith(os.path.join("easy_context", pkg_of[node.value]) + os.sep):
                    found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, found


# ------------------------------------------------------------------------------------------ toy mode, 2 ranks
def _toy_body(rank, world_size):
    import datasets
    import torch.distributed as dist

    from easy_context import apply_seq_parallel_monkey_patch
    from easy_context.inference import SeqParallelLM
    from easy_context.loss import token_nll_sum
    from easy_context_train.data import make_loader
    from easy_context_train.packed_data import batch_targets
    from tests.model_equiv import build_model

    register_mode(TOY)  # the one registry line, in every rank
    layout = ParallelLayout.build("toy_ring")
    assert (layout.dp, layout.sp) == (1, 2) and layout.mode.name == "toy_ring", layout.describe()

    # train.py's loader: rows of seq + 1 tokens with packed documents (positions restart at 0)
    seq, vocab = 32, 128
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(0, vocab, (4, seq + 1), generator=g)
    pos = torch.cat([torch.arange(20), torch.arange(seq + 1 - 20)]).expand(4, -1)
    ds = datasets.Dataset.from_dict({"input_ids": rows.tolist(), "position_ids": pos.tolist()}).with_format("torch")
    loader = make_loader(ds, layout, batch_size=2, seq_length=seq, seed=0, accelerator=None)
    inp, p, tgt = batch_targets(next(iter(loader)))
    other = [None] * world_size
    dist.all_gather_object(other, inp)
    assert torch.equal(other[0], other[1]), "the sp ranks of one group must get the same rows"

    ref_model = build_model("llama")  # the reference: each document on its own, in one process
    ref_logits = torch.cat([ref_model(inp[:, d], position_ids=p[:, d], use_cache=False).logits
                            for d in (slice(0, 20), slice(20, seq))], dim=1)
    ref_sum, _ = token_nll_sum(ref_logits, tgt)
    ref_sum.backward()
    ref_grads = {n: q.grad for n, q in ref_model.named_parameters()}

    model = apply_seq_parallel_monkey_patch(build_model("llama"), layout)  # the (model, layout) order
    w = layout.prepare_inputs(inp, p, tgt, "cpu")
    logits = model(w["local_input_ids"], position_ids=w["local_position_ids"], use_cache=False).logits
    local_sum, _ = token_nll_sum(logits, w["local_target_ids"])
    local_sum.backward()
    parts = [torch.empty_like(logits) for _ in range(world_size)]
    dist.all_gather(parts, logits.detach().contiguous())
    assert_close(layout.mode.unshard(parts, dim=1), ref_logits, name="toy_ring logits")
    total = local_sum.detach().clone()
    dist.all_reduce(total)
    assert_close(total, ref_sum, name="toy_ring loss")
    for n, q in model.named_parameters():
        grad = q.grad.clone()
        dist.all_reduce(grad)
        assert_close(grad, ref_grads[n], name=f"toy_ring grad {n}")

    with torch.no_grad():  # evaluation: SeqParallelLM(model, layout), the same NLL as one process
        engine = SeqParallelLM(build_model("llama").eval(), layout)
        s, c = engine.nll(inp[:1], tgt[:1])
        ref = token_nll_sum(ref_model.eval()(inp[:1], use_cache=False).logits, tgt[:1])[0]
    assert c == int((tgt[:1] != -100).sum()) and abs(s - ref.item()) <= 1e-4 * abs(ref.item()), (s, ref.item())


def test_toy_mode_equals_one_process():
    run_ranks(_toy_body, 2, timeout=300)
