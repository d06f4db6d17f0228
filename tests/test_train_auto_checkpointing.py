"""train.py --checkpointing auto (issue #31): flags, the budgets every rank agrees on, and the exact model it gives.

Pure logic and one tiny model in this process, plus one 2-rank gloo run of the agreement itself. The end-to-end
train.py run under DeepSpeed ZeRO-3 is tests/test_train.py's usp run (slow).
"""
from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import pytest
import torch

from easy_context.memory.auto import GiB, choose_checkpointing
from easy_context_train.args import build_parser, check_args, parse_args
from easy_context_train.auto_checkpointing import (agree_budgets, apply_auto_checkpointing, local_ranks,
                                                      prepare_reserve)
from easy_context_train.errors import UsageError
from tests.harness import run_ranks
from tests.model_equiv import build_model, make_batch, reference_step
from tests.tols import assert_close


def _args(tmp_path, *extra):
    args = build_parser().parse_args(["--output-dir", str(tmp_path / "out"), "--seq-length", "24", *extra])
    check_args(args)
    return args


def _accelerator(world=1, main=True):
    printed = []
    return SimpleNamespace(device=torch.device("cpu"), num_processes=world, is_main_process=main, trackers=[],
                           state=SimpleNamespace(deepspeed_plugin=None), print=printed.append, printed=printed)


# ------------------------------------------------------------------------------------------ flags
def test_flags_parse_and_validate(tmp_path, monkeypatch, capsys):
    auto = ["--checkpointing", "auto", "--gpu-budget-gib", "8"]
    args = _args(tmp_path, *auto, "--host-budget-gib", "64", "--auto-margin", "0.1")
    assert (args.gpu_budget_gib, args.host_budget_gib, args.auto_margin) == (8.0, 64.0, 0.1)
    assert args.chunked_loss and args.tiled_mlp  # what auto's memory model assumes
    plain = _args(tmp_path, "--checkpointing", "offload")
    assert plain.offload_every_k is None and not plain.chunked_loss and not plain.tiled_mlp
    for extra, needle in (([*auto, "--offload-every-k", "2"], "auto chooses k"),
                          (["--checkpointing", "auto", "--gpu-budget-gib", "0"], "--gpu-budget-gib must be > 0"),
                          ([*auto, "--host-budget-gib", "0"], "--host-budget-gib must be > 0"),
                          ([*auto, "--auto-margin", "1"], r"--auto-margin must be in \[0, 1\)"),
                          (["--host-budget-gib", "64"], "apply to --checkpointing auto only")):
        with pytest.raises(UsageError, match=needle):
            _args(tmp_path, *extra)
    # negative numbers reach the range check (not argparse's "expected one argument"); nan is refused
    for extra, needle in ((["--gpu-budget-gib", "-4"], "must be > 0"), (["--gpu-budget-gib", "nan"], "finite")):
        with pytest.raises(SystemExit):
            parse_args(["--output-dir", str(tmp_path / "o"), "--checkpointing", "auto", *extra])
        assert needle in capsys.readouterr().err
    # a machine without CUDA: one line naming the flag, before any model or process group
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        parse_args(["--output-dir", str(tmp_path / "o"), "--checkpointing", "auto", "--host-budget-gib", "64"])
    err = capsys.readouterr().err
    assert err.count("train.py: error:") == 1 and "pass --gpu-budget-gib" in err, err


# ------------------------------------------------------------------------------------------ agreement
def test_agreed_budgets_give_one_choice_that_fits_every_rank():
    from easy_context.tools.plan import load_shape
    s, T = load_shape("llama-2-7b"), 524288
    assert agree_budgets([(3.0, 5.0), (4.0, 2.0), (6.0, 9.0)]) == (3.0, 2.0)
    with pytest.raises(ValueError):
        agree_budgets([])
    gpu = (139.8 - 25.2) * GiB
    ranks = [(gpu, 70 * GiB), (gpu - 12 * GiB, 140 * GiB), (gpu - 3 * GiB, 90 * GiB)]
    agreed = choose_checkpointing(s, T, *agree_budgets(ranks))
    own = [choose_checkpointing(s, T, g, h) for g, h in ranks]
    for g, h in ranks:  # the agreed choice fits each rank's own budgets ...
        assert agreed.host_bytes <= h and agreed.gpu_extra_bytes <= g
    for c in own:  # ... and is at least as conservative as each rank's own choice
        assert agreed.offload_every_k >= c.offload_every_k
        assert len(agreed.selective_layers) <= len(c.selective_layers)
    # why not agree on the choices instead: the largest k (rank 0's host) with the fewest layers (rank 1's count,
    # planned at its own smaller k) does not fit rank 1's GPU at that larger k
    assert own[0].offload_every_k > own[1].offload_every_k
    assert len(agreed.selective_layers) < min(len(c.selective_layers) for c in own)


def test_local_ranks_and_what_prepare_will_still_allocate(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_ranks(16) == 8 and local_ranks(4) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_ranks(4) == 4 and local_ranks(1) == 1
    from easy_context.tools.plan.constants import C
    model = torch.nn.Linear(100, 10)  # 1010 fp32 parameters on the CPU
    assert prepare_reserve(model, None, 4) == (3 * 1010 * 4, 0.0)  # weights + AdamW m, v move to the GPU
    with open(os.path.join(os.path.dirname(__file__), "..", "accelerate_configs", "zero3_offload.json")) as f:
        shipped = json.load(f)  # the shipped ZeRO-3 config: optimizer and parameters on the CPU
    host = C("host_bytes_per_param_zero3_offload") * 1010 / 4
    assert prepare_reserve(model, shipped, 4) == (0.0, pytest.approx(host))
    gpu, host = prepare_reserve(model, {"zero_optimization": {"stage": 3}}, 4)
    assert host == 0.0 and gpu == pytest.approx((C("adam_bytes_per_param_gpu") + 4) * 1010 / 4)


def _two_ranks_body(rank, world_size, out):
    """Ranks measure different host memory; both must choose the same k (the tighter rank's)."""
    import easy_context.memory.auto as auto
    args = build_parser().parse_args(["--output-dir", out, "--seq-length", "48", "--checkpointing", "auto",
                                      "--gpu-budget-gib", "1"])
    check_args(args)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = build_model("llama", num_hidden_layers=4)
    inp = 2 * model.config.hidden_size * 24  # one kept layer input at 48 / 2 tokens per rank
    # MemAvailable as the ranks see it: rank 0 room for 4 inputs per rank (k=1), rank 1 for 2 (k=2)
    auto._host_available = lambda: (4 if rank == 0 else 2) * inp * 2 / 0.8
    choice = apply_auto_checkpointing(model, args, SimpleNamespace(sp=2), _accelerator(world_size, rank == 0))
    got = [None] * world_size
    torch.distributed.all_gather_object(got, (choice.offload_every_k, choice.selective_layers))
    assert got[0] == got[1] and choice.offload_every_k == 2, got
    assert model._easy_context_offload.every_k == 2


def test_ranks_agree_on_one_choice_w2(tmp_path):
    run_ranks(_two_ranks_body, 2, args=(str(tmp_path),))


# ------------------------------------------------------------------------------------------ the model it gives
def test_auto_choice_on_a_tiny_model_is_exact(tmp_path):
    from easy_context.memory import causal_lm_loss
    from easy_context.memory.auto import MARGIN
    from easy_context.tools.plan.memory import attn_working_set
    from easy_context.tools.plan.shape import shape_from_dict
    from easy_context_train.modeling import apply_memory_options
    from easy_context_train.run_dir import RUN_FILE, atomic_write_json, read_run

    ref = build_model("llama", num_hidden_layers=4)
    T, n = 24, ref.config.num_hidden_layers
    shape = shape_from_dict(type(ref).__name__, ref.config.to_dict())
    inp, out = 2 * shape.hidden * T, (2 * shape.d_attn + 4 * shape.heads) * T
    host = 2.5 * inp  # room for 2 of the 4 layer inputs: k = 2
    gpu = (attn_working_set(shape, "cudnn", "offload", T) + (inp + out) + 2.5 * out) / (1 - MARGIN)  # 2 outputs
    gib = lambda b: repr(b / GiB)  # noqa: E731 - exact round trip through the flag
    os.makedirs(tmp_path / "out")
    atomic_write_json(str(tmp_path / "out" / RUN_FILE), {"run_id": "r1"})
    args = _args(tmp_path, "--checkpointing", "auto", "--gpu-budget-gib", gib(gpu), "--host-budget-gib", gib(host))
    acc = _accelerator()
    model = copy.deepcopy(ref)
    choice = apply_memory_options(model, args, SimpleNamespace(sp=1), acc)
    assert choice.offload_every_k == 2 and choice.selective_layers == (n - 2, n - 1)  # later layers first
    assert model._easy_context_offload.every_k == 2
    assert len(acc.printed) == 1 and choice.describe() in acc.printed[0]
    rec = read_run(str(tmp_path / "out"))
    assert rec["run_id"] == "r1" and rec["auto_checkpointing"]["offload_every_k"] == 2
    assert rec["auto_checkpointing"]["selective_layers"] == [n - 2, n - 1]

    short = _args(tmp_path, "--checkpointing", "auto", "--gpu-budget-gib", gib(gpu), "--host-budget-gib", gib(inp / 2))
    with pytest.raises(UsageError, match="^--checkpointing auto: one layer input .* --checkpointing nested"):
        apply_memory_options(copy.deepcopy(ref), short, SimpleNamespace(sp=1), _accelerator())

    layer = copy.deepcopy(ref)
    assert apply_memory_options(layer, _args(tmp_path, "--checkpointing", "layer")) is None
    ids, pos, tgt = make_batch(1, T, ref.config.vocab_size, labels_mask="random")
    _, ref_loss, ref_grads = reference_step(layer, ids, pos, tgt)
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, ids, pos, tgt)  # --chunked-loss, which auto turns on
    loss.backward()
    assert_close(loss.detach(), ref_loss, 1e-6, "auto loss")
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_grads[name], 1e-6, f"auto grad {name}")


# ------------------------------------------------------------------------------------------ head chunks
def test_auto_takes_head_groups_when_they_buy_selective_layers():
    """At 1M tokens of the 7B shape on one H200 the whole-head working set does not fit at k=4; in head groups it
    does (the planner's numbers, memory/head_chunks.py), and with room to spare the fewest groups win."""
    from easy_context.tools.plan import load_shape
    shape = load_shape("llama-2-7b")
    gpu, host = 110 * GiB, 100 * GiB  # an H200 less 27 GiB of bf16 weights + grads; ~100 GiB of host
    with pytest.raises(ValueError, match="one layer's backward needs"):
        choose_checkpointing(shape, 1 << 20, gpu, host)
    c = choose_checkpointing(shape, 1 << 20, gpu, host, head_chunks=(1, 2, 4, 8))
    assert c.head_chunks in (2, 4, 8) and "head groups" in c.describe()
    roomy = choose_checkpointing(shape, 1 << 15, gpu, host, head_chunks=(1, 2, 4, 8))
    assert roomy.head_chunks == 1 and len(roomy.selective_layers) == shape.layers


def test_auto_head_groups_on_a_tiny_model_are_exact(tmp_path):
    """A mode's attention: auto may chunk the heads; the gradients stay those of plain checkpointing."""
    from easy_context import apply_seq_parallel_monkey_patch
    from easy_context.memory import causal_lm_loss, head_chunks_of
    from easy_context.memory.auto import MARGIN
    from easy_context.registry import SEQ_ALGOS, get_mode
    from easy_context.tools.plan.memory import attn_working_set
    from easy_context.tools.plan.shape import shape_from_dict
    from easy_context_train.modeling import apply_memory_options
    mode = next(m for m in SEQ_ALGOS if get_mode(m).supports_attention_cache)
    ref = build_model("llama", num_hidden_layers=4, num_key_value_heads=4)  # MHA: groups save the most
    T = 24
    shape = shape_from_dict(type(ref).__name__, ref.config.to_dict())
    out = (2 * shape.d_attn + 4 * shape.heads) * T
    # room for every layer's output only with the heads in 4 groups (2 groups: 3 layers, none: 1)
    gpu = (attn_working_set(shape, "cudnn", "offload", T, 4) + 4.5 * out) / (1 - MARGIN)
    model = apply_seq_parallel_monkey_patch(mode, copy.deepcopy(ref))
    args = _args(tmp_path, "--checkpointing", "auto", "--gpu-budget-gib", repr(gpu / GiB), "--host-budget-gib", "1")
    choice = apply_memory_options(model, args, SimpleNamespace(sp=1), _accelerator())
    assert choice.head_chunks == 4 and head_chunks_of(model) == 4 and len(choice.selective_layers) == 4, choice
    ids, pos, tgt = make_batch(1, T, ref.config.vocab_size, labels_mask="random")
    _, ref_loss, ref_grads = reference_step(copy.deepcopy(ref), ids, pos, tgt)
    loss = causal_lm_loss(model, ids, pos, tgt)
    loss.backward()
    assert_close(loss.detach(), ref_loss, 1e-5, "auto head groups loss")
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_grads[name], 1e-5, f"auto head groups grad {name}")
    # under ZeRO-3 an explicit --head-chunks is taken (the blocks gather their parameters: test_head_chunks_zero3.py);
    # with the model's own attention it is refused up front
    zero3 = _accelerator()
    zero3.state.deepspeed_plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3}})
    taken = apply_seq_parallel_monkey_patch(mode, copy.deepcopy(ref))
    apply_memory_options(taken, _args(tmp_path, "--head-chunks", "2", "--parallel_mode", mode), SimpleNamespace(sp=1),
                         zero3)
    assert head_chunks_of(taken) == 2
    plain = next(m for m in SEQ_ALGOS if not get_mode(m).is_parallel)
    with pytest.raises(UsageError, match="--head-chunks needs a sequence-parallel mode"):
        _args(tmp_path, "--head-chunks", "2", "--parallel_mode", plain)
    with pytest.raises(UsageError, match="--head-chunks must be >= 1"):
        _args(tmp_path, "--head-chunks", "0")
