"""The documented example commands (docs/trainer.md), run as written under torchrun's CPU device path, equal one
process (issue #45): trl.SFTTrainer packing chat documents of varying length (bfd, padding-free), 4 steps, GA 2,
under zigzag (2 ranks), USP (4 ranks, ring 2) with LoRA, and a zigzag run resumed from its step-2 checkpoint; the
Trainer example under zigzag; trl.DPOTrainer under zigzag and trl.GRPOTrainer (HF generation, seeded per completion)
under Ulysses, 2 ranks, and their LoRA commands (issue #62). Loss curves within 1e-4, trained weights within 1e-4
relative.

This is the path a user runs: the Trainer moves each micro-batch with ``.to(device)`` and two micro-batches of one
step can give a rank identical local positions, which lost or swapped the packed rows' dispatch table before it
travelled in the model call (dispatch/plan.py)."""
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.background import Background
from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4


class _Launch:
    """One launch of ``cmd`` (torchrun with ``nproc`` > 1), started now (``tests/background.py``); ``result()`` waits
    for it and loads its report."""

    def __init__(self, cmd: list[str], report: Path, nproc: int = 1, **extra_env):
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
                  "127.0.0.1", "--master_port", str(free_port())] if nproc > 1 else [sys.executable]
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
                   TOKENIZERS_PARALLELISM="false", **extra_env)
        self.cmd, self.report, self.nproc = cmd, report, nproc
        self.job = Background(launch + cmd + ["--report", str(report)], env, ROOT, timeout=900)
        self.stop = self.job.stop

    def result(self) -> dict:
        r = self.job.wait()
        assert r.returncode == 0, \
            f"{' '.join(self.cmd)} (nproc {self.nproc}) failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
        return torch.load(self.report, weights_only=True)


def _run(cmd: list[str], report: Path, nproc: int = 1, **extra_env) -> dict:
    return _Launch(cmd, report, nproc, **extra_env).result()


def _results(*launches: _Launch) -> list[dict]:
    """Every launch's report, in order; the first failure stops the others."""
    try:
        return [launch.result() for launch in launches]
    finally:
        for launch in launches:
            launch.stop()


def _same(got: dict, ref: dict, what: str) -> None:
    assert len(got["loss"]) == len(ref["loss"]) == 4, (what, got["loss"], ref["loss"])
    diff = max(abs(a - b) for a, b in zip(got["loss"], ref["loss"]))
    assert diff < TOL, f"{what}: loss curve {got['loss']} vs one process {ref['loss']} ({diff:.2e})"
    assert got["params"].keys() == ref["params"].keys(), what
    for name, p in ref["params"].items():
        rel = float((got["params"][name] - p).norm() / p.norm().clamp_min(1e-12))
        assert rel < TOL, f"{what}: {name} differs by {rel:.2e} (relative)"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("examples")


SFT = ["examples/sft_trainer_sp.py", "--tiny"]


def test_sft_trainer_examples_equal_one_process(out):
    # the one-process reference (one core) runs beside the 2-rank launch: separate directories, no port
    ref_launch = _Launch(SFT + ["--no-sp", "--output-dir", str(out / "ref")], out / "ref.pt")
    run = SFT + ["--mode", "zigzag_ring_attn", "--output-dir", str(out / "zz"), "--save-steps", "2"]
    zz, ref = _results(_Launch(run, out / "zz.pt", nproc=2), ref_launch)
    assert ref["loss"][-1] < ref["loss"][0]  # it trains
    _same(zz, ref, "SFTTrainer zigzag_ring_attn, 2 ranks")
    # resumed from that run's step-2 checkpoint (as after a crash at step 3): the same curve and weights
    res = _run(run + ["--resume", str(out / "zz" / "checkpoint-2")], out / "res.pt", nproc=2)
    _same(res, ref, "SFTTrainer zigzag_ring_attn, resumed at step 2")


def test_documented_usp_lora_command_equals_one_process(out):
    """docs/trainer.md: torchrun --nproc_per_node 4 examples/sft_trainer_sp.py --tiny --mode usp_attn
    --ring-degree 2 --lora-rank 8 (LoRA through the USP patch), against the same SFTTrainer without SP."""
    ref_launch = _Launch(SFT + ["--no-sp", "--lora-rank", "8", "--output-dir", str(out / "lref")], out / "lref.pt")
    usp, ref = _results(_Launch(SFT + ["--mode", "usp_attn", "--ring-degree", "2", "--lora-rank", "8", "--output-dir",
                                       str(out / "usp")], out / "usp.pt", nproc=4), ref_launch)
    _same(usp, ref, "SFTTrainer usp_attn ring 2 x ulysses 2, LoRA r8, 4 ranks")


@pytest.mark.slow  # the Trainer zigzag 2 ranks: test_integrations.py
def test_documented_trainer_command_equals_one_process(out):
    """docs/trainer.md: torchrun --nproc_per_node 2 examples/trainer_sp.py --tiny --mode zigzag_ring_attn."""
    cmd = ["examples/trainer_sp.py", "--tiny"]
    ref_launch = _Launch(cmd + ["--no-sp", "--output-dir", str(out / "tref")], out / "tref.pt")
    zz, ref = _results(_Launch(cmd + ["--mode", "zigzag_ring_attn", "--output-dir", str(out / "tzz")], out / "tzz.pt",
                               nproc=2), ref_launch)
    _same(zz, ref, "Trainer zigzag_ring_attn, 2 ranks")


DPO = ["examples/dpo_trainer_sp.py", "--tiny"]
GRPO = ["examples/grpo_trainer_sp.py", "--tiny"]


def test_dpo_and_grpo_examples_equal_one_process(out):
    """docs/trainer.md (issue #62): torchrun --nproc_per_node 2 examples/dpo_trainer_sp.py --tiny --mode
    zigzag_ring_attn and examples/grpo_trainer_sp.py --tiny --mode ulysses_attn (TRL's HF generation, seeded per
    completion) against the same trainers with --no-sp on one process."""
    launches = [_Launch(DPO + ["--no-sp", "--output-dir", str(out / "dref")], out / "dref.pt"),
                _Launch(DPO + ["--mode", "zigzag_ring_attn", "--output-dir", str(out / "dzz")], out / "dzz.pt", nproc=2),
                _Launch(GRPO + ["--no-sp", "--output-dir", str(out / "gref")], out / "gref.pt"),
                _Launch(GRPO + ["--mode", "ulysses_attn", "--output-dir", str(out / "guly")], out / "guly.pt", nproc=2)]
    dref, dzz, gref, guly = _results(*launches)
    assert dref["loss"][-1] < dref["loss"][0]  # DPO learns
    _same(dzz, dref, "DPOTrainer zigzag_ring_attn, 2 ranks")
    _same(guly, gref, "GRPOTrainer ulysses_attn, 2 ranks")


@pytest.mark.slow
def test_dpo_and_grpo_lora_examples_equal_one_process(out):
    """docs/trainer.md: the --lora-rank 8 commands (reference = the policy with its adapter disabled)."""
    launches = [_Launch(DPO + ["--no-sp", "--lora-rank", "8", "--output-dir", str(out / "dlref")], out / "dlref.pt"),
                _Launch(DPO + ["--mode", "ulysses_attn", "--lora-rank", "8", "--output-dir", str(out / "dl")],
                        out / "dl.pt", nproc=2),
                _Launch(GRPO + ["--no-sp", "--lora-rank", "8", "--output-dir", str(out / "glref")], out / "glref.pt"),
                _Launch(GRPO + ["--mode", "zigzag_ring_attn", "--lora-rank", "8", "--output-dir", str(out / "gl")],
                        out / "gl.pt", nproc=2)]
    dlref, dl, glref, gl = _results(*launches)
    _same(dl, dlref, "DPOTrainer ulysses_attn + LoRA r8, 2 ranks")
    _same(gl, glref, "GRPOTrainer zigzag_ring_attn + LoRA r8, 2 ranks")
