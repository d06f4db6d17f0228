"""trl.DPOTrainer and trl.GRPOTrainer under sequence parallelism equal the same trainer on one process (issue #62).

tests/rl_cases.py builds the runs: a tiny Llama, DPO 4 steps with gradient accumulation 2 on preference pairs of
varied lengths, GRPO 4 steps of 2 prompts x 4 completions (stubbed generation, rule-based reward, KL to the
reference model). One spawn at world 1 computes the references; each world-W spawn runs many cases against them:
loss curve within 1e-4, the logged rewards / margins / log-probs / KL / entropy within 1e-4, trained weights within
1e-4 relative. The default run has one case per trainer (DPO zigzag, GRPO Ulysses) and the refusals; Ulysses /
zigzag for the other trainer, LoRA, resume and USP on 4 ranks are ``slow``.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_ranks

REFS = {"dpo": ("dpo", False), "grpo": ("grpo", False)}  # name -> (kind, lora)
SLOW_REFS = {"dpo_lora": ("dpo", True), "grpo_lora": ("grpo", True), "dpo_qwen3_5": ("dpo", False, "qwen3_5")}


# ---------------------------------------------------------------------------------------------- pure logic
def test_packed_row_places_and_errors():
    from easy_context.integrations import BatchError
    from easy_context.integrations.seq_logprobs import packed_row
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 8, 9, 10, 11]])  # right padding, left padding
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, 6, 7, -100, -100], [-100, -100, -100, 10, 11]])
    row, pos, place = packed_row(ids, mask, labels)
    assert row.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    # TRL's output column j scores labels[j + 1]: row 0 columns 0, 1; row 1 columns 2, 3 (4 columns a row)
    assert place.tolist() == [[0, 1, -100, -100, 4 + 2, 4 + 3, -100]]
    with pytest.raises(BatchError, match="padding inside the sequence"):
        packed_row(ids, torch.tensor([[1, 0, 1, 0, 0], [0, 1, 1, 1, 1]]), labels)
    with pytest.raises(BatchError, match="labels at padded positions"):
        packed_row(ids, mask, torch.tensor([[-100, 6, 7, 0, -100], [-100, -100, -100, 10, 11]]))


def test_other_trl_trainers_are_refused_by_name():
    from easy_context.integrations.rl import rl_kind
    kto = type("KTOTrainer", (), {"__module__": "trl.trainer.kto_trainer"})()
    with pytest.raises(ValueError, match="trl KTOTrainer is not supported.*DPOTrainer and GRPOTrainer"):
        rl_kind(kto)
    dpo = type("DPOTrainer", (), {"__module__": "trl.trainer.dpo_trainer"})
    assert rl_kind(type("MyDPO", (dpo,), {})()) == "dpo"
    assert rl_kind(object()) is None


# ---------------------------------------------------------------------------------------------- spawned ranks
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tokenizer and tiny model saved once; the one-process reference runs (one spawn)."""
    from tests import rl_cases as rc
    root = str(tmp_path_factory.mktemp("trl_rl"))
    tok, model = rc.save_assets(root)
    path = os.path.join(root, "refs.pt")
    run_ranks(_references, world_size=1, args=(tok, model, root, path, REFS), timeout=600)
    return tok, model, root, torch.load(path, weights_only=False)


def _references(rank, world_size, tok, model, root, path, names):
    from tests import rl_cases as rc
    out = {name: rc.run(spec[0], tok, _model(model, spec), os.path.join(root, f"ref-{name}"), lora=spec[1])
           for name, spec in names.items()}
    # the integration on one process (zigzag on 1 rank: packed rows, no collective) is the plain trainer too
    got = rc.run("dpo", tok, model, os.path.join(root, "one-dpo"), sp={"mode": "zigzag_ring_attn"}) \
        if "dpo" in names else None
    if got is not None:
        rc.compare(got, out["dpo"], "DPOTrainer zigzag_ring_attn on 1 rank")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)


def _model(llama: str, spec: tuple) -> str:
    """The saved model a reference / case trains: the tiny Llama, or (spec[2]) a hybrid saved beside it."""
    if len(spec) < 3 or spec[2] is None:
        return llama
    from tests import rl_cases as rc
    from transformers import AutoTokenizer
    path = os.path.join(os.path.dirname(llama), spec[2])
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_rank() == 0:
            rc.save_hybrid(os.path.dirname(llama), len(AutoTokenizer.from_pretrained(os.path.join(
                os.path.dirname(llama), "tok"))))
        if dist.is_initialized():
            dist.barrier()
    return path


# case -> (reference, kind, sp options, lora, resume[, hybrid family])
CASES = {2: {"dpo_zigzag": ("dpo", "dpo", {"mode": "zigzag_ring_attn"}, False, False),
             "grpo_ulysses": ("grpo", "grpo", {"mode": "ulysses_attn"}, False, False)}}
SLOW_CASES = {
    2: {"dpo_ulysses": ("dpo", "dpo", {"mode": "ulysses_attn"}, False, False),
        "grpo_zigzag": ("grpo", "grpo", {"mode": "zigzag_ring_attn"}, False, False),
        "dpo_zigzag_lora": ("dpo_lora", "dpo", {"mode": "zigzag_ring_attn"}, True, False),
        "grpo_zigzag_lora": ("grpo_lora", "grpo", {"mode": "zigzag_ring_attn"}, True, False),
        "dpo_zigzag_resume": ("dpo", "dpo", {"mode": "zigzag_ring_attn"}, False, True),
        "grpo_zigzag_resume": ("grpo", "grpo", {"mode": "zigzag_ring_attn"}, False, True),
        "dpo_qwen3_5_zigzag": ("dpo_qwen3_5", "dpo", {"mode": "zigzag_ring_attn"}, False, False, "qwen3_5")},
    4: {"dpo_usp": ("dpo", "dpo", {"mode": "usp_attn", "ring_degree": 2}, False, False),
        "grpo_usp": ("grpo", "grpo", {"mode": "usp_attn", "ring_degree": 2}, False, False),
        "dpo_zigzag_sp2_dp2": ("dpo", "dpo", {"mode": "zigzag_ring_attn", "sp_size": 2}, False, False)},
}


def _world(rank, world_size, tok, model, root, refs, cases, extras=()):
    from tests import rl_cases as rc
    for name, (ref, kind, sp, lora, resume, *family) in cases.items():
        out = os.path.join(root, f"w{world_size}-{name}")
        model_dir = _model(model, (kind, lora, *family))
        what = f"{name} on {world_size} ranks"
        if not resume:
            rc.compare(rc.run(kind, tok, model_dir, out, sp=sp, world=world_size, lora=lora), refs[ref], what)
            continue
        # a run that saves at step 2, then a fresh trainer resumed from that checkpoint: both equal one process
        full = rc.run(kind, tok, model, out, sp=sp, world=world_size, save_strategy="steps", save_steps=2)
        rc.compare(full, refs[ref], what)
        again = rc.run(kind, tok, model, out, sp=sp, world=world_size, save_strategy="steps", save_steps=2,
                       resume=os.path.join(out, "checkpoint-2"))
        # (TRL's num_tokens counter restarts at 0 on resume, with or without SP: not compared)
        rc.compare({**again, "loss": full["loss"][:2] + again["loss"][-2:],
                    "metrics": {k: full["metrics"][k][:2] + v[-2:] for k, v in again["metrics"].items()}},
                   {**refs[ref], "metrics": {k: v for k, v in refs[ref]["metrics"].items() if k != "num_tokens"}},
                   f"{what}, resumed at step 2")
    for extra in extras:
        globals()[extra](rank, world_size, tok, model, root)


def _refusals(rank, world_size, tok, model, root):
    """Settings the path cannot run exactly: one-line ValueErrors on every rank, before training (no collective)."""
    from easy_context.integrations import enable_sequence_parallel
    from tests import rl_cases as rc
    out = os.path.join(root, f"w{world_size}-refusals")
    t = rc.make_trainer("dpo", tok, model, out, world=world_size)
    with pytest.raises(ValueError, match="chunked_loss=True does not apply to DPOTrainer"):
        enable_sequence_parallel(t, mode="zigzag_ring_attn", chunked_loss=True)
    t.compute_metrics = lambda p: {}
    with pytest.raises(ValueError, match="compute_metrics"):
        enable_sequence_parallel(t, mode="zigzag_ring_attn")
    t.compute_metrics = None
    t._is_vision_dataset = True
    with pytest.raises(ValueError, match="image data"):
        enable_sequence_parallel(t, mode="zigzag_ring_attn")
    t._is_vision_dataset, t.aux_loss_enabled, t.router_aux_loss_coef = False, True, 0.01
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        enable_sequence_parallel(t, mode="ulysses_attn")
    t.aux_loss_enabled = False
    enable_sequence_parallel(t, mode="zigzag_ring_attn")  # the same trainer, now accepted
    ids = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="full-logits forward"):  # e.g. compute_metrics' extra forward
        t.model(input_ids=ids)
    with pytest.raises(ValueError, match="already enabled"):
        enable_sequence_parallel(t, mode="zigzag_ring_attn")
    g = rc.make_trainer("grpo", tok, model, out + "-g", world=world_size)
    with pytest.raises(ValueError, match="chunked_loss=True does not apply to GRPOTrainer"):
        enable_sequence_parallel(g, mode="ulysses_attn", chunked_loss=True)


def test_dpo_and_grpo_two_ranks(assets):
    tok, model, root, refs = assets
    run_ranks(_world, world_size=2, args=(tok, model, root, refs, CASES[2], ["_refusals"]), timeout=600,
              collective_timeout=120)


def _slow_refs(assets, tmp_path):
    tok, model, root, refs = assets
    path = str(tmp_path / "slow_refs.pt")
    run_ranks(_references, world_size=1, args=(tok, model, root, path, SLOW_REFS), timeout=600)
    return {**refs, **torch.load(path, weights_only=False)}


@pytest.mark.slow
def test_dpo_and_grpo_more_two_ranks(assets, tmp_path):
    tok, model, root, _ = assets
    refs = _slow_refs(assets, tmp_path)
    run_ranks(_world, world_size=2, args=(tok, model, root, refs, SLOW_CASES[2]), timeout=900, collective_timeout=120)


@pytest.mark.slow
def test_dpo_and_grpo_usp_four_ranks(assets):
    tok, model, root, refs = assets
    run_ranks(_world, world_size=4, args=(tok, model, root, refs, SLOW_CASES[4]), timeout=900, collective_timeout=120)


ENGINES = {  # the trainers' own DeepSpeed ZeRO-3 / FSDP2 wrapping (CPU: gloo), as tests/test_integrations.py
    "zero3": dict(deepspeed={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                             "train_batch_size": "auto"}, ddp_backend="gloo"),
    "fsdp2": dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2}, ddp_backend="gloo"),
}


def _engine(rank, world_size, tok, model, root, refs, engine):
    from tests import rl_cases as rc
    if engine == "zero3":  # the trainers load models under zero.Init, which reads DeepSpeed's own world (as the
        import deepspeed  # deepspeed / accelerate launchers set it up); here: on the ranks' gloo group
        deepspeed.init_distributed(dist_backend="gloo")
    for kind, mode in (("dpo", "zigzag_ring_attn"), ("grpo", "ulysses_attn")):
        got = rc.run(kind, tok, model, os.path.join(root, f"w{world_size}-{engine}-{kind}"), sp={"mode": mode},
                     world=world_size, **ENGINES[engine])
        rc.compare(got, refs[kind], f"{kind} + {engine} + {mode} on {world_size} ranks")


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_dpo_and_grpo_deepspeed_zero3_and_fsdp2(assets, engine):
    """Policy and reference model wrapped by the trainer's engine (ZeRO-3: the reference as an inference engine)."""
    tok, model, root, refs = assets
    run_ranks(_engine, world_size=2, args=(tok, model, root, refs, engine), timeout=900, collective_timeout=300)
