"""easy_context.integrations: transformers.Trainer / trl.SFTTrainer under every sequence-parallel mode give the loss
curve of the same trainer on one process, and of train.py's own loss path on the same rows.

One spawn per world size runs many cases (tests/trainer_cases.py builds them): world 1 computes the plain trainers'
reference curves (3 optimizer steps, gradient accumulation 2, eval loss), worlds 2 and 4 compare against them
within 1e-4, check LoRA, resume_from_checkpoint, train.py's loop on the Trainer's rows, and the errors that must
come before any collective. Extra combinations are in the ``slow`` tests.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from easy_context.registry import SEQ_ALGOS, get_mode
from tests.harness import run_ranks

TOL = 1e-4


# ---------------------------------------------------------------------------------------------- pure logic
def test_full_rows_shift_mask_and_filler():
    from easy_context.integrations import full_rows
    ids = torch.arange(10, 17).unsqueeze(0)  # 7 tokens: documents [10 11 12] [13 14 15 16]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    labels = torch.tensor([[-100, 11, 12, -100, 14, 15, 16]])
    inp, p, tgt = full_rows({"input_ids": ids, "labels": labels, "position_ids": pos}, multiple=4, pad_id=0)
    assert inp.tolist() == [[10, 11, 12, 13, 14, 15, 16, 0]]  # one filler token: 8 = a multiple of 4
    assert p.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert tgt.tolist() == [[11, 12, -100, 14, 15, 16, -100, -100]]  # shifted, none across a document start
    # the same as train.py's batch_targets on a row with one more (filler) token
    from easy_context_train.packed_data import batch_targets
    row = {"input_ids": torch.cat([inp, torch.zeros(1, 1, dtype=torch.long)], 1),
           "labels": torch.cat([torch.tensor([[-100, 11, 12, 13, 14, 15, 16, -100]]), torch.tensor([[-100]])], 1),
           "position_ids": torch.cat([p, torch.zeros(1, 1, dtype=torch.long)], 1)}
    i2, p2, t2 = batch_targets(row)
    assert torch.equal(i2, inp) and torch.equal(p2, p) and torch.equal(t2, tgt)


def test_full_rows_errors_name_the_setting():
    from easy_context.integrations import BatchError, full_rows
    ids = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(BatchError, match="padded the batch.*DataCollatorWithFlattening"):
        full_rows({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])}, 4)
    with pytest.raises(BatchError, match="multiple of 16.*pad_to_multiple_of"):
        full_rows({"input_ids": ids, "labels": ids}, 16, pad_to_multiple=False)
    with pytest.raises(BatchError, match="packing_strategy='bfd'"):
        full_rows({"input_ids": ids[:, :4], "labels": ids[:, :4], "position_ids": torch.tensor([[5, 6, 0, 1]] * 2)}, 4)
    with pytest.raises(BatchError, match="no 'labels'"):
        full_rows({"input_ids": ids}, 4)
    with pytest.raises(BatchError, match=r"\['pixel_values'\]"):
        full_rows({"input_ids": ids, "labels": ids, "pixel_values": ids}, 4)


def test_options_errors():
    from easy_context.integrations import SeqParallelOptions, enable_sequence_parallel
    with pytest.raises(ValueError, match="zigzag_ring_attn"):
        SeqParallelOptions(mode="ring").validate()
    with pytest.raises(TypeError, match="chunked_los"):
        enable_sequence_parallel(object(), chunked_los=True)
    with pytest.raises(ValueError, match="checkpointing='everything'"):
        SeqParallelOptions(checkpointing="everything").validate()
    with pytest.raises(ValueError, match="head_chunks=0"):
        SeqParallelOptions(head_chunks=0).validate()
    plain = next(m for m in SEQ_ALGOS if not get_mode(m).is_parallel)
    with pytest.raises(ValueError, match="needs a sequence-parallel mode's attention"):
        SeqParallelOptions(mode=plain, head_chunks=2).validate()


# ---------------------------------------------------------------------------------------------- spawned ranks
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tokenizer (with a chat template) and the one-process reference curves."""
    import time
    from easy_context_train.toy import build_tokenizer, make_corpus
    root = tmp_path_factory.mktemp("integrations")
    tok = str(root / "tok")
    t0 = time.time()
    build_tokenizer(make_corpus(200), tok)
    _timing(0, "tokenizer", t0)
    refs = str(root / "refs.json")
    run_ranks(_references, world_size=1, args=(tok, str(root), refs), timeout=300)
    with open(refs) as f:
        return tok, str(root), json.load(f)


REFERENCES = {  # name -> (kind, lora, gradient accumulation)
    "trainer": ("trainer", False, 2), "sft": ("sft", False, 2), "sft_lora": ("sft", True, 2),
}
SLOW_REFERENCES = {"trainer_lora": ("trainer", True, 2), "trainer_ga4": ("trainer", False, 4)}


def _references(rank, world_size, tok, root, path, names=None):
    from tests import trainer_cases as tc
    table = {**REFERENCES, **SLOW_REFERENCES}
    out = {}
    import time
    for name in names or REFERENCES:
        kind, lora, ga = table[name]
        t0 = time.time()
        out[name] = tc.run(kind, tok, os.path.join(root, f"ref-{name}"), lora=lora, ga=ga,
                           eval_rows=4 if not lora and ga == 2 else 0)
        _timing(rank, f"ref-{name}", t0)
    if names is None:  # the integration on one process (zigzag on 1 rank) is the plain trainer too
        t0 = time.time()
        got = tc.run("sft", tok, os.path.join(root, "one-sft"), sp={"mode": "zigzag_ring_attn", "chunked_loss": True},
                     eval_rows=4)
        _close(got, out["sft"], "sft zigzag_ring_attn on 1 rank, chunked loss")
        _timing(rank, "one-sft", t0)
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def _close(got: dict, ref: dict, what: str) -> None:
    assert len(got["loss"]) == len(ref["loss"]) >= 3, f"{what}: {got} vs {ref}"
    diff = max(abs(a - b) for a, b in zip(got["loss"], ref["loss"]))
    assert diff < TOL, f"{what}: loss curve {got['loss']} vs one process {ref['loss']} (max diff {diff:.2e})"
    if "eval_loss" in ref and "eval_loss" in got:
        d = abs(got["eval_loss"] - ref["eval_loss"])
        assert d < TOL, f"{what}: eval_loss {got['eval_loss']} vs {ref['eval_loss']} ({d:.2e})"


# case -> (reference, kind, sp options, lora, gradient accumulation, eval rows[, more TrainingArguments])
CASES = {
    2: {"trainer_zigzag_offload_tiled_heads": ("trainer", "trainer", {"mode": "zigzag_ring_attn",
                                                                     "checkpointing": "offload", "tiled_mlp": True,
                                                                     "head_chunks": 2}, False, 2, 4),
        "sft_zigzag_chunked": ("sft", "sft", {"mode": "zigzag_ring_attn", "chunked_loss": True}, False, 2, 4),
        "trainer_ulysses_ckpt": ("trainer", "trainer", {"mode": "ulysses_attn"}, False, 2, 0,
                                 {"gradient_checkpointing": True}),
        "sft_ulysses_lora": ("sft_lora", "sft", {"mode": "ulysses_attn"}, True, 2, 0)},
    4: {"trainer_usp": ("trainer", "trainer", {"mode": "usp_attn", "ring_degree": 2}, False, 2, 4),
        "sft_usp_lora": ("sft_lora", "sft", {"mode": "usp_attn", "ring_degree": 2, "chunked_loss": True}, True, 2, 0,
                         {"gradient_checkpointing": True})},
}
SLOW_CASES = {
    2: {"trainer_zigzag_lora": ("trainer_lora", "trainer", {"mode": "zigzag_ring_attn"}, True, 2, 0),
        "trainer_dp2": ("trainer_ga4", "trainer", {"mode": "data_parallel"}, False, 2, 0),
        "sft_dist_flash": ("sft", "sft", {"mode": "dist_flash_attn"}, False, 2, 0)},
    4: {"sft_zigzag4": ("sft", "sft", {"mode": "zigzag_ring_attn"}, False, 2, 0),
        "sft_ulysses4": ("sft", "sft", {"mode": "ulysses_attn"}, False, 2, 0),
        "trainer_zigzag_sp2_dp2": ("trainer_ga4", "trainer", {"mode": "zigzag_ring_attn", "sp_size": 2,
                                                              "checkpointing": "offload", "head_chunks": 2},
                                   False, 2, 0),  # DDP over dp = 2: head groups' gradients reach its hooks once
        "sft_usp_chunked": ("sft", "sft", {"mode": "usp_attn", "ring_degree": 2, "chunked_loss": True}, False, 2, 4)},
}


def _world(rank, world_size, tok, root, refs, cases, extras):
    import time
    from tests import trainer_cases as tc
    for name, (ref, kind, sp, lora, ga, ev, *more) in cases.items():
        t0 = time.time()
        got = tc.run(kind, tok, os.path.join(root, f"w{world_size}-{name}"), sp=sp, lora=lora, ga=ga, eval_rows=ev,
                     **(more[0] if more else {}))
        _close(got, refs[ref], f"{name} on {world_size} ranks")
        _timing(rank, name, t0)
    for extra in extras:
        t0 = time.time()
        globals()[extra](rank, world_size, tok, root, refs)
        _timing(rank, extra, t0)


def _timing(rank, name, t0):
    import time
    if rank == 0 and os.environ.get("EC_TEST_TIMES"):
        with open(os.environ["EC_TEST_TIMES"], "a") as f:
            f.write(f"{name} {time.time() - t0:.1f}s\n")


def _resume(rank, world_size, tok, root, refs):
    """A run stopped after step 2 and resumed from its checkpoint equals the unbroken run (curve and weights)."""
    from tests import trainer_cases as tc
    sp = {"mode": "zigzag_ring_attn"}
    out = os.path.join(root, f"w{world_size}-resume")
    a = tc.make_trainer("sft", tok, out, save_strategy="steps", save_steps=2)
    from easy_context.integrations import enable_sequence_parallel
    enable_sequence_parallel(a, **sp)
    a.train()
    full = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    b = tc.make_trainer("sft", tok, out, save_strategy="steps", save_steps=2)
    enable_sequence_parallel(b, **sp)
    b.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    la, lb = tc.losses(a), tc.losses(b)
    assert len(la) == len(lb) == 3 and max(abs(x - y) for x, y in zip(la, lb)) < TOL, (la, lb)
    assert abs(la[0] - refs["sft"]["loss"][0]) < TOL
    worst = max((p.detach() - full[n]).abs().max().item() for n, p in b.model.named_parameters())
    assert worst < 1e-5, f"resumed weights differ from the unbroken run's by {worst:.2e}"


def _train_py_loop(rank, world_size, tok, root, refs):
    """train.py's loop (batch_targets, layout.prepare_inputs, nll_sum, scale = W * GA / N_window, DDP's gradient
    average, clipping, AdamW) on the rows the SP Trainer reads gives the Trainer's loss curve."""
    import torch.distributed as dist

    from easy_context.integrations import enable_sequence_parallel
    from easy_context.loss import IGNORE_INDEX, global_sum
    from easy_context_train.packed_data import batch_targets
    from easy_context_train.parallel import nll_sum
    from tests import trainer_cases as tc

    t = tc.make_trainer("trainer", tok, os.path.join(root, f"w{world_size}-trainpy"))
    enable_sequence_parallel(t, mode="zigzag_ring_attn")
    layout, model = t._ec_layout, t.model
    dl = t.get_train_dataloader()
    dl.set_epoch(0)
    it = iter(dl)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.LR, weight_decay=0.0)
    W, GA, curve = world_size, tc.GA, []
    for _ in range(tc.STEPS):
        window = []
        for _ in range(GA):
            b = next(it)
            n = b["input_ids"].shape[1]
            fill = -(n + 1 - 1) % layout.seq_multiple + 1  # train.py rows hold L + 1 tokens; L a multiple
            row = {"input_ids": torch.cat([b["input_ids"], torch.zeros(1, fill, dtype=torch.long)], 1),
                   "labels": torch.cat([b["labels"], torch.full((1, fill), IGNORE_INDEX)], 1),
                   "position_ids": torch.cat([b["position_ids"], torch.arange(fill)[None]], 1)}
            inp, pos, tgt = batch_targets(row)
            window.append(layout.prepare_inputs(inp, pos, tgt, torch.device("cpu")))
        n_tokens = global_sum(sum((w["local_target_ids"] != IGNORE_INDEX).sum() for w in window).float()).clamp(min=1)
        scale = W * GA / n_tokens
        nll_window = torch.zeros(())
        for w in window:
            nll = nll_sum(model, model, w["local_input_ids"], w["local_position_ids"], w["local_target_ids"], False,
                          model_kwargs=w.model_kwargs)
            (nll * scale / GA).backward()  # Accelerate divides by GA ...
            nll_window += nll.detach()
        for p in model.parameters():  # ... and DDP averages over the W ranks
            dist.all_reduce(p.grad)
            p.grad /= W
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        curve.append((global_sum(nll_window) / n_tokens).item())
    _close({"loss": curve}, refs["trainer"], f"train.py's loop on the Trainer's rows ({world_size} ranks)")


def _mixin(rank, world_size, tok, root, refs):
    """The mixin spelling: class SPTrainer(SeqParallelTrainerMixin, Trainer)(..., sequence_parallel={...})."""
    from transformers import AutoTokenizer, DataCollatorWithFlattening, Trainer, TrainingArguments

    from easy_context.integrations import SeqParallelTrainerMixin
    from tests import trainer_cases as tc

    class SPTrainer(SeqParallelTrainerMixin, Trainer):
        pass
    tokenizer = AutoTokenizer.from_pretrained(tok)
    t = SPTrainer(model=tc.tiny_model(len(tokenizer)),
                  args=TrainingArguments(**tc.common_args(os.path.join(root, f"w{world_size}-mixin"))),
                  train_dataset=tc.doc_dataset(tokenizer), data_collator=DataCollatorWithFlattening(),
                  processing_class=tokenizer, sequence_parallel={"mode": "zigzag_ring_attn", "fused_ops": True})
    t.train()
    _close({"loss": tc.losses(t)}, refs["trainer"], f"SeqParallelTrainerMixin + fused ops on {world_size} ranks")


def _errors(rank, world_size, tok, root, refs):
    """Settings that would break exactness: a ValueError naming them, on every rank, before any collective."""
    from transformers import DataCollatorForLanguageModeling

    from easy_context.integrations import BatchError, enable_sequence_parallel
    from tests import trainer_cases as tc
    out = os.path.join(root, f"w{world_size}-errors")
    t = tc.make_trainer("trainer", tok, out, train_sampling_strategy="group_by_length")
    with pytest.raises(ValueError, match="group_by_length"):
        enable_sequence_parallel(t, mode="zigzag_ring_attn")
    t = tc.make_trainer("trainer", tok, out)
    t.data_collator = DataCollatorForLanguageModeling(t.processing_class, mlm=False)
    with pytest.raises(ValueError, match="DataCollatorForLanguageModeling.*position_ids"):
        enable_sequence_parallel(t, mode="ulysses_attn")
    t = tc.make_trainer("trainer", tok, out)
    t.compute_metrics = lambda p: {}
    with pytest.raises(ValueError, match="compute_metrics"):
        enable_sequence_parallel(t, mode="zigzag_ring_attn")
    with pytest.raises(ValueError, match="sp_size"):
        enable_sequence_parallel(tc.make_trainer("trainer", tok, out), mode="zigzag_ring_attn", sp_size=3)
    # a bad batch on one rank: every rank stops with an error at the window's one all-reduce (no hang)
    t = enable_sequence_parallel(tc.make_trainer("trainer", tok, out), mode="zigzag_ring_attn")
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, -2:] = 0 if rank == 1 else 1
    with pytest.raises(BatchError, match="padded the batch" if rank == 1 else r"rank\(s\) \[1\]"):
        t.get_batch_samples(iter([{"input_ids": ids, "labels": ids, "attention_mask": mask}]), 1, torch.device("cpu"))


def test_trainers_two_ranks(assets):
    tok, root, refs = assets
    run_ranks(_world, world_size=2, args=(tok, root, refs, CASES[2], ["_train_py_loop", "_resume", "_mixin", "_errors"]),
              timeout=600, collective_timeout=120)


def test_trainers_four_ranks(assets):
    tok, root, refs = assets
    run_ranks(_world, world_size=4, args=(tok, root, refs, CASES[4], []), timeout=600, collective_timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_trainers_more_modes(assets, world_size, tmp_path):
    tok, root, refs = assets
    path = str(tmp_path / "slow_refs.json")
    run_ranks(_references, world_size=1, args=(tok, root, path, list(SLOW_REFERENCES)), timeout=300)
    with open(path) as f:
        refs = {**refs, **json.load(f)}
    run_ranks(_world, world_size=world_size, args=(tok, root, refs, SLOW_CASES[world_size], []),
              timeout=900, collective_timeout=120)


ENGINES = {  # Trainer settings of the engines (CPU: gloo)
    "zero3": dict(deepspeed={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                             "train_batch_size": "auto"}, ddp_backend="gloo"),
    "fsdp2": dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2}, ddp_backend="gloo"),
}


def _engine(rank, world_size, tok, root, refs, engine, lora):
    from tests import trainer_cases as tc
    got = tc.run("trainer", tok, os.path.join(root, f"w{world_size}-{engine}-{lora}"), lora=lora,
                 sp={"mode": "zigzag_ring_attn", "chunked_loss": True}, **ENGINES[engine])
    _close(got, refs["trainer_lora" if lora else "trainer"],
           f"Trainer + {engine} + zigzag_ring_attn + chunked loss{' + LoRA' if lora else ''} on {world_size} ranks")


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_trainer_deepspeed_zero3_and_fsdp2(assets, engine, lora, tmp_path):
    """The Trainer's own DeepSpeed ZeRO-3 / FSDP2 wrapping (first ZeRO-3 run JIT-builds DeepSpeed's CPU ops)."""
    tok, root, refs = assets
    if lora:
        path = str(tmp_path / "lora_ref.json")
        run_ranks(_references, world_size=1, args=(tok, root, path, ["trainer_lora"]), timeout=300)
        with open(path) as f:
            refs = {**refs, **json.load(f)}
    run_ranks(_engine, world_size=2, args=(tok, root, refs, engine, lora), timeout=900, collective_timeout=300)
