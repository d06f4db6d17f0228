"""Tiny trl.DPOTrainer / trl.GRPOTrainer runs for tests/test_trl_rl.py (imported inside spawned gloo ranks).

Every rank loads the same tiny Llama (saved by the parent, float32, CPU) and the parent's tokenizer. Each optimizer
step sees the same rows on one process as on W ranks: the one-process run reads ``GLOBAL`` rows per micro-batch, a
rank ``GLOBAL / W`` (the trainers' own data parallelism over all ranks; the sp group scores its rows together).
DPO: 4 steps, gradient accumulation 2, 4 preference pairs of varied lengths per micro-batch. GRPO: 4 steps, 2
prompts x 4 completions per step, a stubbed generation (``stub_generation``: completions depend only on the prompt,
the completion's index in its group and the step, so one process and W ranks see the same ones) and a rule-based
reward; KL against the reference model (beta > 0).
"""
from __future__ import annotations

import os
import zlib

STEPS, LR = 4, 2e-3
DPO_GLOBAL, DPO_GA = 4, 2
GRPO_GLOBAL, GROUP = 8, 4
METRICS = {"dpo": ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                   "logps/rejected", "entropy", "mean_token_accuracy", "logits/chosen", "num_tokens"),
           "grpo": ("reward", "reward_std", "kl", "entropy", "completions/mean_length", "num_tokens")}


def save_assets(root: str) -> tuple[str, str]:
    """The tokenizer (with a chat template) and a tiny Llama saved under ``root``; returns their paths."""
    from easy_context_train.toy import build_tokenizer, make_corpus
    from tests.trainer_cases import tiny_model
    tok_dir, model_dir = os.path.join(root, "tok"), os.path.join(root, "model")
    tok = build_tokenizer(make_corpus(200), tok_dir)
    tiny_model(len(tok)).save_pretrained(model_dir)
    return tok_dir, model_dir


def save_hybrid(root: str, vocab: int) -> str:
    """A tiny Qwen3.5 hybrid (a gated delta-net layer, then a softmax layer) saved under ``root``."""
    from tests.hybrid_models import build_hybrid
    path = os.path.join(root, "qwen3_5")
    build_hybrid("qwen3_5", vocab_size=vocab, pad_token_id=2, eos_token_id=2, bos_token_id=1).save_pretrained(path)
    return path


def dpo_dataset(n: int = 40, seed: int = 0):
    """Preference pairs of varied lengths (chosen and rejected of different lengths)."""
    import datasets
    from easy_context_train.toy import make_corpus
    docs = make_corpus(n, seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i, d in enumerate(docs):
        a, b, c = 40 + 17 * (i % 4), 30 + 23 * (i % 3), 25 + 11 * (i % 5)
        rows["prompt"].append(d[:a])
        rows["chosen"].append(d[a:a + b])
        rows["rejected"].append(d[a + b:a + b + c])
    return datasets.Dataset.from_dict(rows)


def grpo_dataset(n: int = 16, seed: int = 0):
    import datasets
    from easy_context_train.toy import make_corpus
    return datasets.Dataset.from_dict({"prompt": [d[:30 + 19 * (i % 3)] for i, d in enumerate(make_corpus(n, seed))]})


def length_reward(completions, **kw):
    """Rule-based reward: how close a completion's length is to 40 characters, plus its count of the letter 'e'."""
    return [-abs(len(c) - 40) / 40 + c.count("e") / 10 for c in completions]


def stub_generation(trainer, vocab: int):
    """``_generate_single_turn`` replaced: completion ids from (prompt, index in group, step) only."""
    import torch

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        n = len(prompt_ids)
        for i, p in enumerate(prompt_ids):
            k = (trainer.accelerator.process_index * n + i) % num_generations  # the row's place in its group
            seed = zlib.crc32(bytes(str((list(p), k, trainer.state.global_step)), "utf8"))
            g = torch.Generator().manual_seed(seed)
            length = 3 + seed % 13
            out.append(torch.randint(40, vocab, (length,), generator=g).tolist())
        return out, None
    trainer._generate_single_turn = generate


def common_args(out: str, per_device: int, ga: int, **kw) -> dict:
    return {**dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=per_device,
                   gradient_accumulation_steps=ga, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                   logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, data_seed=0,
                   disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0, bf16=False), **kw}


def make_trainer(kind: str, tok_dir: str, model_dir: str, out: str, world: int = 1, lora: bool = False, **kw):
    from transformers import AutoTokenizer
    from tests.trainer_cases import lora_config
    tok = AutoTokenizer.from_pretrained(tok_dir)
    peft = lora_config() if lora else None
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer
        cfg = DPOConfig(**common_args(out, DPO_GLOBAL // world, DPO_GA, **kw), beta=0.1, max_length=None,
                        dataset_num_proc=None, model_init_kwargs={"dtype": "float32"})
        return DPOTrainer(model=model_dir, args=cfg, train_dataset=dpo_dataset(), processing_class=tok,
                          peft_config=peft)
    from trl import GRPOConfig, GRPOTrainer
    cfg = GRPOConfig(**common_args(out, GRPO_GLOBAL // world, 1, **kw), num_generations=GROUP, beta=0.04,
                     max_completion_length=16, model_init_kwargs={"dtype": "float32"})
    t = GRPOTrainer(model=model_dir, args=cfg, reward_funcs=length_reward, train_dataset=grpo_dataset(),
                    processing_class=tok, peft_config=peft)
    stub_generation(t, len(tok))
    return t


def result(trainer, kind: str) -> dict:
    """The loss curve, the logged metrics per step and the trainable weights (unwrapped, float32)."""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"loss": [h["loss"] for h in logs],
            "metrics": {m: [h.get(m) for h in logs] for m in METRICS[kind]},
            "params": {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}}


def _full(p):
    """A parameter's whole value: gathered under ZeRO-3 (collective, same order on every rank), FSDP2's DTensor."""
    if hasattr(p, "ds_id"):
        import deepspeed
        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().float().clone()
    if hasattr(p, "full_tensor"):
        return p.full_tensor().detach().float().clone()
    return p.detach().float().clone()


def run(kind: str, tok_dir: str, model_dir: str, out: str, sp: dict | None = None, world: int = 1,
        lora: bool = False, resume: str | None = None, **kw) -> dict:
    from easy_context.integrations import enable_sequence_parallel
    t = make_trainer(kind, tok_dir, model_dir, out, world=world, lora=lora, **kw)
    if sp is not None:
        enable_sequence_parallel(t, **sp)
    t.train(resume_from_checkpoint=resume)
    return result(t, kind)


def compare(got: dict, ref: dict, what: str, tol: float = 1e-4) -> None:
    """Loss curve and metrics within ``tol`` (absolute; num_tokens equal), weights within ``tol`` relative."""
    assert len(got["loss"]) == len(ref["loss"]) == STEPS, (what, got["loss"], ref["loss"])
    diff = max(abs(a - b) for a, b in zip(got["loss"], ref["loss"]))
    assert diff < tol, f"{what}: loss curve {got['loss']} vs one process {ref['loss']} (max diff {diff:.2e})"
    for name, want in ref["metrics"].items():
        have = got["metrics"][name]
        assert None not in want and None not in have, f"{what}: metric {name} not logged: {have} vs {want}"
        d = max(abs(a - b) for a, b in zip(have, want))
        assert d < tol * max(1.0, max(abs(x) for x in want)), f"{what}: {name} {have} vs one process {want} ({d:.2e})"
    assert got["params"].keys() == ref["params"].keys(), what
    for name, p in ref["params"].items():
        rel = float((got["params"][name] - p).norm() / p.norm().clamp_min(1e-12))
        assert rel < tol, f"{what}: trained weight {name} differs by {rel:.2e} (relative)"
