#!/usr/bin/env python
"""trl.DPOTrainer with EasyContext sequence parallelism: every rank's chosen / rejected sequences scored sequence-
parallel by the sp group (policy and reference model), TRL's own DPO loss on the full sequences, any mode.

    # CPU, 2 processes, a tiny model, tokenizer and preference pairs made here (no downloads)
    torchrun --nproc_per_node 2 examples/dpo_trainer_sp.py --tiny --mode zigzag_ring_attn
    torchrun --nproc_per_node 2 examples/dpo_trainer_sp.py --tiny --mode ulysses_attn --lora-rank 8
    python examples/dpo_trainer_sp.py --tiny --no-sp                  # the same DPOTrainer on one process, no SP
    # GPUs: 8 ranks score each 64K-token chosen / rejected pair together, bf16, FlashAttention-4 kernels
    accelerate launch --num_processes 8 examples/dpo_trainer_sp.py --model Qwen/Qwen3-1.7B \
        --dataset trl-lib/ultrafeedback_binarized --seq-length 65536 --batch-size 8 --bf16 --attn-backend fa4 \
        --gradient-checkpointing

--batch-size is the preference pairs of one micro-batch over all ranks (each rank reads batch-size / world of
them, as TRL's data parallelism does), so --no-sp on one process trains on the same pairs. The lines a DPOTrainer
user adds are marked "# <- SP".
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.common import (add_flags, checkpoint_args, load_model, lora, per_rank, sp_options,  # noqa: E402
                             tiny_tokenizer, train_and_report)


def tiny_pairs(n: int = 200):
    """Preference pairs from the toy corpus: a prompt and two continuations of different lengths."""
    import datasets
    from easy_context_train.toy import make_corpus
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i, d in enumerate(make_corpus(n)):
        a, b, c = 40 + 17 * (i % 4), 30 + 23 * (i % 3), 25 + 11 * (i % 5)
        rows["prompt"].append(d[:a])
        rows["chosen"].append(d[a:a + b])
        rows["rejected"].append(d[a + b:a + b + c])
    return datasets.Dataset.from_dict(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    p.add_argument("--dataset", default=None, help="a preference dataset (prompt / chosen / rejected)")
    p.add_argument("--split", default="train")
    p.add_argument("--batch-size", type=int, default=4, help="preference pairs per micro-batch, over all ranks")
    p.add_argument("--beta", type=float, default=0.1)
    args = p.parse_args()
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from easy_context.integrations import enable_sequence_parallel  # <- SP

    tok = tiny_tokenizer() if args.tiny else AutoTokenizer.from_pretrained(args.model)
    data = tiny_pairs() if args.tiny else datasets.load_dataset(args.dataset, split=args.split)
    cfg = DPOConfig(
        output_dir=args.output_dir or os.path.join("output", "dpo_trainer_sp"), max_steps=args.max_steps,
        per_device_train_batch_size=per_rank(args.batch_size), gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr, logging_steps=1, report_to="none", bf16=args.bf16, **checkpoint_args(args),
        use_cpu=args.tiny, gradient_checkpointing=args.gradient_checkpointing, seed=0, beta=args.beta,
        max_length=args.seq_length, lr_scheduler_type="constant", dataset_num_proc=None)
    model = load_model(args, tok)
    # the reference: a second copy of the initial weights (LoRA: the policy with its adapter disabled)
    ref = None if args.lora_rank else load_model(args, tok)
    trainer = DPOTrainer(model=model, ref_model=ref, args=cfg, train_dataset=data, processing_class=tok,
                         peft_config=lora(args))
    if not args.no_sp:
        enable_sequence_parallel(trainer, **sp_options(args))  # <- SP
    train_and_report(trainer, args)


if __name__ == "__main__":
    main()
