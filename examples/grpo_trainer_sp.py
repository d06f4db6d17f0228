#!/usr/bin/env python
"""trl.GRPOTrainer with EasyContext sequence parallelism: TRL's own generation (HF generate with the model's own
attention, or its vLLM client) and rewards; the policy and reference log-probs of prompt + completion scored
sequence-parallel by the sp group, TRL's own GRPO loss (advantages, clipping, KL) on the full sequences.

    # CPU, 2 processes, a tiny model, tokenizer and prompts made here; a rule-based reward (no downloads)
    torchrun --nproc_per_node 2 examples/grpo_trainer_sp.py --tiny --mode ulysses_attn
    torchrun --nproc_per_node 2 examples/grpo_trainer_sp.py --tiny --mode zigzag_ring_attn --lora-rank 8
    python examples/grpo_trainer_sp.py --tiny --no-sp                 # the same GRPOTrainer on one process, no SP
    # GPUs: 8 ranks score each 32K-token completion together, bf16, FlashAttention-4 kernels
    accelerate launch --num_processes 8 examples/grpo_trainer_sp.py --model Qwen/Qwen3-1.7B \
        --dataset trl-lib/DeepMath-103K --max-completion-length 32768 --batch-size 16 --num-generations 8 --bf16 \
        --attn-backend fa4 --gradient-checkpointing

--batch-size is the completions of one step over all ranks (each rank reads batch-size / world of them), so --no-sp
on one process sees the same prompts. --tiny seeds each completion's sampling from (prompt, its index in the group,
step), so one process and N ranks sample the same completions and their losses can be compared (--report). The
lines a GRPOTrainer user adds are marked "# <- SP".
"""
import argparse
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.common import (add_flags, checkpoint_args, load_model, lora, per_rank, sp_options,  # noqa: E402
                             tiny_tokenizer, train_and_report)


def reward_length_and_letters(completions, **kw):
    """A rule-based reward: completions near 40 characters, with many letter 'e's."""
    return [-abs(len(c) - 40) / 40 + c.count("e") / 10 for c in completions]


def seeded_rollouts(trainer):
    """Sample each completion with a seed of its own (one generate call per completion): one process and N ranks,
    which read the rows of a step in different splits, then sample the same completions."""
    import torch
    generate_rows = trainer._generate_single_turn

    def generate(prompt_ids, images, multimodal_fields, num_generations, **kw):
        out, n = [], len(prompt_ids)
        for i, prompt in enumerate(prompt_ids):
            k = (trainer.accelerator.process_index * n + i) % num_generations  # its index in its group
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(repr((list(prompt), k, trainer.state.global_step)).encode()))
                out += generate_rows([prompt], images, multimodal_fields, 1, **kw)[0]
        return out, None
    trainer._generate_single_turn = generate


def save_for_reference(model, path: str) -> str:
    """Rank 0 saves the model, every rank waits for it (the config above started the process group)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    p.add_argument("--dataset", default=None, help="a prompt dataset (a 'prompt' column)")
    p.add_argument("--split", default="train")
    p.add_argument("--batch-size", type=int, default=8, help="completions per step, over all ranks")
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (a group)")
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient against the reference model")
    args = p.parse_args()
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from easy_context.integrations import enable_sequence_parallel  # <- SP

    tok = tiny_tokenizer() if args.tiny else AutoTokenizer.from_pretrained(args.model)
    if args.tiny:
        from easy_context_train.toy import make_corpus
        data = datasets.Dataset.from_dict({"prompt": [d[:30 + 19 * (i % 3)] for i, d in enumerate(make_corpus(64))]})
    else:
        data = datasets.load_dataset(args.dataset, split=args.split)
    cfg = GRPOConfig(
        output_dir=args.output_dir or os.path.join("output", "grpo_trainer_sp"), max_steps=args.max_steps,
        per_device_train_batch_size=per_rank(args.batch_size), gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr, logging_steps=1, report_to="none", bf16=args.bf16, **checkpoint_args(args),
        use_cpu=args.tiny, gradient_checkpointing=args.gradient_checkpointing, seed=0, beta=args.beta,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        lr_scheduler_type="constant")
    model = load_model(args, tok)
    # beta > 0 without LoRA: TRL loads the reference model from the policy's path; a tiny model is saved first
    if args.tiny and args.beta and not args.lora_rank:
        model = save_for_reference(model, os.path.join(cfg.output_dir, "initial-model"))
    trainer = GRPOTrainer(model=model, args=cfg, reward_funcs=reward_length_and_letters, train_dataset=data,
                          processing_class=tok, peft_config=lora(args))
    if args.tiny:
        seeded_rollouts(trainer)
    if not args.no_sp:
        enable_sequence_parallel(trainer, **sp_options(args))  # <- SP
    train_and_report(trainer, args)


if __name__ == "__main__":
    main()
