#!/usr/bin/env python
"""transformers.Trainer with EasyContext sequence parallelism: padding-free rows (DataCollatorWithFlattening), any mode.

    # CPU, 2 processes, a tiny model and data made here (no downloads)
    torchrun --nproc_per_node 2 examples/trainer_sp.py --tiny --mode zigzag_ring_attn
    torchrun --nproc_per_node 4 examples/trainer_sp.py --tiny --mode usp_attn --ring-degree 2
    python examples/trainer_sp.py --tiny --no-sp                    # the same Trainer on one process, no SP
    # GPUs: 8 ranks share each 64K-token row, bf16, chunked loss
    accelerate launch --num_processes 8 examples/trainer_sp.py --model meta-llama/Llama-3.2-1B \
        --dataset DATA --seq-length 65536 --docs-per-row 16 --bf16 --chunked-loss --gradient-checkpointing

The lines a Trainer user adds are marked "# <- SP".
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.common import (add_flags, checkpoint_args, load_model, lora, sp_options, tiny_tokenizer,  # noqa: E402
                             train_and_report)


def documents(args, tok):
    """Token lists of documents: the toy corpus (--tiny) or a dataset's "text" column."""
    if args.tiny:
        from easy_context_train.toy import make_corpus
        return [tok(d)["input_ids"] for d in make_corpus(400)]
    from easy_context_train.data import load_any_dataset
    return [tok(t)["input_ids"] for t in load_any_dataset(args.dataset)["text"]]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    p.add_argument("--dataset", default=None, help="a dataset with a 'text' column (without --tiny)")
    p.add_argument("--docs-per-row", type=int, default=8,
                   help="documents flattened into one row (the per-device batch of DataCollatorWithFlattening)")
    args = p.parse_args()
    from transformers import AutoTokenizer, DataCollatorWithFlattening, Trainer, TrainingArguments

    from easy_context.integrations import enable_sequence_parallel  # <- SP

    tok = tiny_tokenizer() if args.tiny else AutoTokenizer.from_pretrained(args.model)
    model = load_model(args, tok)
    if args.lora_rank:
        from peft import get_peft_model
        model = get_peft_model(model, lora(args))
    docs = [{"input_ids": d[: args.seq_length // args.docs_per_row]} for d in documents(args, tok)]
    targs = TrainingArguments(
        output_dir=args.output_dir or os.path.join("output", "trainer_sp"), max_steps=args.max_steps,
        per_device_train_batch_size=args.docs_per_row, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr, logging_steps=1, report_to="none", bf16=args.bf16, **checkpoint_args(args),
        use_cpu=args.tiny, gradient_checkpointing=args.gradient_checkpointing, seed=0)
    # padding-free: the collator flattens a batch of documents into one row, position_ids restarting at each one
    trainer = Trainer(model=model, args=targs, train_dataset=docs,
                      data_collator=DataCollatorWithFlattening(), processing_class=tok)
    if not args.no_sp:
        enable_sequence_parallel(trainer, **sp_options(args))  # <- SP
    train_and_report(trainer, args)


if __name__ == "__main__":
    main()
