#!/usr/bin/env python
"""Tokenize a text dataset and pack it into rows of seq_length + 1 ``input_ids`` for train.py.

    python prepare_data.py --dataset DIR_OR_FILES_OR_HUB_NAME --tokenizer MODEL --seq-length 65536 \
        --output data/my_65536

Each document becomes BOS + tokens + EOS; documents are concatenated and cut into rows of exactly
seq_length + 1 tokens (the remainder is dropped), like EasyContext's chunked SlimPajama sets. The output
is written with ``save_to_disk`` into OUTPUT.tmp and renamed at the end, so OUTPUT is complete or absent;
re-running after an interruption starts over (the tokenization is cached by `datasets`).
"""
import argparse
import os

from easy_context.training.errors import UsageError, fail


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="hub name, save_to_disk dir, folder or .txt/.json/.jsonl/.parquet file")
    p.add_argument("--tokenizer", required=True, help="hub name or local dir (usually the model)")
    p.add_argument("--seq-length", type=int, required=True, help="training length; rows hold seq_length + 1 tokens")
    p.add_argument("--output", required=True)
    p.add_argument("--text-column", default="text")
    p.add_argument("--split", default="train")
    p.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    p.add_argument("--no-bos", action="store_true")
    p.add_argument("--no-eos", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it holds a dataset this tool wrote")
    args = p.parse_args(argv)
    try:
        run(args)
    except UsageError as e:
        fail(str(e), prog="prepare_data.py")


def run(args):
    from transformers import AutoTokenizer

    from easy_context.training.data import check_output_dataset, load_any_dataset, pack_documents

    if args.seq_length < 1:
        raise UsageError("--seq-length must be >= 1")
    check_output_dataset(args.output, args.overwrite, inputs=(args.dataset, args.tokenizer))  # before any work
    ds = load_any_dataset(args.dataset, args.split)
    if len(ds) == 0:
        raise UsageError(f"--dataset {args.dataset!r} has no rows")
    if args.text_column not in ds.column_names:
        raise UsageError(f"dataset {args.dataset!r} has no {args.text_column!r} column (columns: "
                         f"{', '.join(ds.column_names)}); pass --text-column")
    if args.max_docs:
        ds = ds.select(range(min(args.max_docs, len(ds))))
    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load tokenizer {args.tokenizer!r}: {str(e).splitlines()[0]}") from None
    ds = ds.map(lambda b: {"ids": tok(b[args.text_column], add_special_tokens=False)["input_ids"]}, batched=True,
                remove_columns=ds.column_names, num_proc=args.num_proc if len(ds) > 1000 else None, desc="tokenizing")
    bos = None if args.no_bos else tok.bos_token_id
    eos = None if args.no_eos else tok.eos_token_id
    out = pack_documents((r["ids"] for r in ds), args.seq_length, args.output, bos, eos, progress=True)
    import datasets
    n = len(datasets.load_from_disk(out))
    print(f"wrote {n} rows of {args.seq_length + 1} tokens ({n * (args.seq_length + 1):,} tokens) to {out}")


if __name__ == "__main__":
    main()
