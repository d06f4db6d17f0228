#!/usr/bin/env python
"""trl.SFTTrainer with EasyContext sequence parallelism: a chat dataset, packing (bfd, padding-free), any mode.

    # CPU, 2 processes, a tiny model, tokenizer (with a chat template) and chat data made here (no downloads)
    torchrun --nproc_per_node 2 examples/sft_trainer_sp.py --tiny --mode ulysses_attn
    torchrun --nproc_per_node 4 examples/sft_trainer_sp.py --tiny --mode usp_attn --ring-degree 2 --lora-rank 8
    python examples/sft_trainer_sp.py --tiny --no-sp                  # the same SFTTrainer on one process, no SP
    # GPUs: 8 ranks share each 64K-token packed row, bf16, chunked loss, FlashAttention-4 kernels
    accelerate launch --num_processes 8 examples/sft_trainer_sp.py --model Qwen/Qwen3-1.7B \
        --dataset HuggingFaceH4/ultrachat_200k --split train_sft --seq-length 65536 --bf16 --chunked-loss \
        --attn-backend fa4 --gradient-checkpointing

The lines an SFTTrainer user adds are marked "# <- SP".
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.common import (add_flags, checkpoint_args, load_model, lora, sp_options, tiny_tokenizer,  # noqa: E402
                             train_and_report)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    p.add_argument("--dataset", default=None, help="a conversational dataset with a 'messages' column")
    p.add_argument("--split", default="train")
    args = p.parse_args()
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from easy_context.integrations import enable_sequence_parallel  # <- SP

    tok = tiny_tokenizer() if args.tiny else AutoTokenizer.from_pretrained(args.model)
    if args.tiny:
        from easy_context_train.toy import make_chat_corpus
        data = datasets.Dataset.from_dict({"messages": make_chat_corpus(400)})
    else:
        data = datasets.load_dataset(args.dataset, split=args.split)
    cfg = SFTConfig(
        output_dir=args.output_dir or os.path.join("output", "sft_trainer_sp"), max_steps=args.max_steps,
        per_device_train_batch_size=1, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr, logging_steps=1, report_to="none", bf16=args.bf16, **checkpoint_args(args),
        use_cpu=args.tiny, gradient_checkpointing=args.gradient_checkpointing, seed=0,
        packing=True, max_length=args.seq_length)  # packing "bfd" = padding-free rows with restarting position_ids
    trainer = SFTTrainer(model=load_model(args, tok), args=cfg, train_dataset=data, processing_class=tok,
                         peft_config=lora(args))
    if not args.no_sp:
        enable_sequence_parallel(trainer, **sp_options(args))  # <- SP
    train_and_report(trainer, args)


if __name__ == "__main__":
    main()
