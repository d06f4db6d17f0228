#!/usr/bin/env python
"""Tokenize a text dataset and pack it into rows of seq_length + 1 ``input_ids`` for train.py.

    python prepare_data.py --dataset DIR_OR_FILES_OR_HUB_NAME --tokenizer MODEL --seq-length 65536 \
        --output data/my_65536

Each document becomes BOS + tokens + EOS; documents are concatenated and cut into rows of exactly
seq_length + 1 tokens (the remainder is dropped), like EasyContext's chunked SlimPajama sets. The output
is written with ``save_to_disk`` into a new scratch directory next to it (``.OUTPUT.prepare-XXXXXXXX``, made and
removed by this tool; nothing else next to OUTPUT is touched) and renamed at the end, so OUTPUT is complete or
absent; re-running after an interruption starts over (the tokenization is cached by `datasets`).
"""
import argparse
import os

from easy_context.errors import UsageError, fail


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
    p.add_argument("--format", choices=("text", "chat"), default="text",
                   help="text: a text column; chat: a 'messages' column (role/content), the tokenizer's chat "
                   "template, labels only on assistant turns, whole conversations packed (see docs/training.md)")
    p.add_argument("--document-masking", action="store_true",
                   help="text: also write position_ids restarting at 0 per document (per-document attention)")
    p.add_argument("--messages-column", default="messages")
    args = p.parse_args(argv)
    try:
        run(args)
    except UsageError as e:
        fail(str(e), prog="prepare_data.py")
    except Exception as e:  # noqa: BLE001 - a failed write (disk full, quota, read-only) is one line and exit 74
        from easy_context_train.writes import WriteError, write_error
        err = e if isinstance(e, WriteError) else _write_error(e)
        if err is None:
            raise
        if not isinstance(err, WriteError):
            err = write_error(err, "the dataset", args.output, then="then rerun the same command (nothing of it was "
                              "kept; the tokenization is cached)")
        fail(str(err), prog="prepare_data.py", code=74)


def _write_error(e: BaseException):
    """The OSError of a failed write behind ``e`` (datasets and pyarrow wrap it), or None."""
    from easy_context_train.writes import WRITE_ERRNOS
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def run(args):
    from transformers import AutoTokenizer

    from easy_context_train.data import check_output_dataset, load_any_dataset, pack_documents

    if args.seq_length < 1:
        raise UsageError("--seq-length must be >= 1")
    check_output_dataset(args.output, args.overwrite, inputs=(args.dataset, args.tokenizer))  # before any work
    ds = load_any_dataset(args.dataset, args.split)
    if len(ds) == 0:
        raise UsageError(f"--dataset {args.dataset!r} has no rows")
    if args.format == "chat":
        return run_chat(args, ds)
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
    if args.document_masking:
        from easy_context_train.packed_data import pack_text
        return _save_rows(pack_text((r["ids"] for r in ds), args.seq_length, bos, eos), args, {})
    out = pack_documents((r["ids"] for r in ds), args.seq_length, args.output, bos, eos, progress=True)
    import datasets
    n = len(datasets.load_from_disk(out))
    print(f"wrote {n} rows of {args.seq_length + 1} tokens ({n * (args.seq_length + 1):,} tokens) to {out}")


def run_chat(args, ds):
    from transformers import AutoTokenizer

    from easy_context_train.packed_data import check_chat_tokenizer, pack_examples, render_chat
    if args.messages_column not in ds.column_names:
        raise UsageError(f"dataset {args.dataset!r} has no {args.messages_column!r} column (columns: "
                         f"{', '.join(ds.column_names)}); --format chat needs role/content messages")
    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load tokenizer {args.tokenizer!r}: {str(e).splitlines()[0]}") from None
    check_chat_tokenizer(tok, args.tokenizer)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    examples = (render_chat(tok, r[args.messages_column], i) for i, r in enumerate(ds))
    stats: dict = {}
    return _save_rows(pack_examples(examples, args.seq_length, pad, stats), args, stats)


def _save_rows(rows, args, stats):
    from tqdm.auto import tqdm

    from easy_context_train.packed_data import save_rows
    rows = list(tqdm(rows, desc="packing", unit="row"))
    if not rows:
        raise UsageError(f"not enough tokens for one row of {args.seq_length + 1}")
    save_rows(rows, args.output)
    split = f"; {stats['split']} conversations longer than a row were cut into row-sized documents" \
        if stats.get("split") else ""
    print(f"wrote {len(rows)} rows of {args.seq_length + 1} tokens with labels and position_ids to {args.output}{split}")


if __name__ == "__main__":
    main()
