"""Long-document perplexity, sequence-parallel (EasyContext's eval_ppl, adapted from YaRN's script, fixed).

    # one process, a local JSON-lines file with a "text" field
    python eval_ppl.py -m MODEL_DIR -d docs.jsonl -f text --min-tokens 256 --max-tokens 1024 --truncate \
        --output-file out/ppl.csv
    # 8 GPUs, zigzag ring attention, the README's proof-pile run
    accelerate launch --num_processes 8 eval_ppl.py --tokenized emozilla/proofpile-test-tokenized \
        -m OUT --dataset-min-tokens 500000 --samples 2 --min-tokens 50000 --max-tokens 500000 \
        --tokens-step 50000 --truncate --aggressive-memory --output-file ppl.csv
    python plot.py ppl.csv --xmax 550000 --ymax 2 --ymin 1.5

Perplexity = exp(total NLL / total scored tokens) over every window, document and rank (EasyContext
averaged per-window means, and its sliding mode put all scored tokens on one rank -> NaN elsewhere).
Logits are computed only for scored tokens, a chunk at a time (easy_context/inference.py).
CSV as EasyContext wrote it: header ",len1,len2,...", one row "model,ppl1,ppl2,..." per model.
"""
from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import random

import torch
import torch.distributed as dist

from easy_context.loss import IGNORE_INDEX, global_sum


def parse_args(argv=None):
    from easy_context.registry import DEFAULT_MODE, mode_names
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", action="append", nargs="+", required=True,
                   help="model directory or Hub id; repeat -m (or list several) for several models")
    p.add_argument("-d", "--dataset", help="datasets name, a save_to_disk folder, or a .json/.jsonl/.txt/.parquet file")
    p.add_argument("-s", "--subset", help="dataset config name")
    p.add_argument("-f", "--feature", default="text", help="text column to tokenize")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--min-tokens", type=int, default=256)
    p.add_argument("--dataset-min-tokens", type=int, default=None, help="drop documents shorter than this")
    p.add_argument("--tokens-step", type=int, default=None, help="length grid step (default: doubling)")
    p.add_argument("--sliding-window", type=int, default=256, help="stride of the strided windows")
    p.add_argument("--truncate", action="store_true", help="one window per document: its first tokens")
    p.add_argument("--split", default="test")
    p.add_argument("--samples", type=int, default=None, help="documents to evaluate (a seeded sample)")
    p.add_argument("--save-tokenized", default=None, help="tokenize the dataset, save_to_disk here, exit")
    p.add_argument("--tokenized", default=None, help="a pre-tokenized dataset (input_ids column)")
    p.add_argument("--output-file", default=None, help="CSV file to write")
    p.add_argument("--aggressive-memory", action="store_true", help="free memory after every window")
    p.add_argument("--hide-progress", action="store_true")
    p.add_argument("--beyond-max-positions", action="store_true",
                   help="also measure lengths above the model's max_position_embeddings (default: marked n/a)")
    p.add_argument("--parallel_mode", "--parallel-mode", dest="parallel_mode", default=DEFAULT_MODE,
                   choices=mode_names(), help="sequence parallelism; data_parallel splits documents over ranks")
    p.add_argument("--ring_degree", type=int, default=None, help="usp_attn only: ring size")
    p.add_argument("--rope-theta", "--rope_theta", dest="rope_theta", type=float, default=None,
                   help="override the config's RoPE theta")
    return p.parse_args(argv)


def length_grid(min_tokens: int, max_tokens: int, step: int | None) -> list[int]:
    if min_tokens < 2 or max_tokens < min_tokens:
        raise ValueError(f"impossible length grid: need 2 <= --min-tokens ({min_tokens}) <= --max-tokens "
                         f"({max_tokens})")
    if step is not None:
        if step < 1:
            raise ValueError(f"--tokens-step must be >= 1; got {step}")
        return list(range(min_tokens, max_tokens + 1, step))
    out, n = [], min_tokens
    while n <= max_tokens:
        out.append(n)
        n *= 2
    return out


def windows(n_tokens: int, max_tokenized_len: int, stride: int, truncate: bool):
    """(begin, end, trg_len) per window; the last trg_len tokens of [begin, end) are scored (HF strided ppl)."""
    if truncate:
        end = min(n_tokens, max_tokenized_len)
        return [(0, end, end)]
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_tokenized_len, n_tokens)
        out.append((begin, end, end - prev_end))
        prev_end = end
        if end == n_tokens:
            break
    return out


def window_tensors(ids, begin, end, trg_len, bos):
    """Inputs (BOS + ids[begin:end]) and targets: next token where it is one of the trg_len new ones."""
    inp = ([bos] if bos is not None else []) + list(ids[begin:end])
    n = len(inp)
    tgt = [IGNORE_INDEX] * n
    for i in range(n - 1):
        if i + 1 >= n - trg_len:
            tgt[i] = inp[i + 1]
    return torch.tensor([inp]), torch.tensor([tgt])


def load_documents(args, tokenizer):
    """Token-id lists of the documents to evaluate (identical on every rank)."""
    from easy_context_train.data import load_any_dataset  # the loader train.py and prepare_data.py use
    if args.tokenized:
        ds = load_any_dataset(args.tokenized, args.split, args.subset)
    else:
        if not args.dataset:
            raise ValueError("give a dataset: -d/--dataset (text) or --tokenized (pre-tokenized)")
        ds = load_any_dataset(args.dataset, args.split, args.subset)
        if args.feature not in ds.column_names:
            raise ValueError(f"feature {args.feature!r} not in the dataset columns {ds.column_names}")
        ds = ds.map(lambda b: {"input_ids": tokenizer(b[args.feature], add_special_tokens=False)["input_ids"]},
                    batched=True, remove_columns=[c for c in ds.column_names if c != args.feature])
        ds = ds.map(lambda b: {"tokenized_len": [len(x) for x in b["input_ids"]]}, batched=True)
        if args.save_tokenized:
            ds.save_to_disk(args.save_tokenized)
            return None
    if "tokenized_len" not in ds.column_names:
        ds = ds.map(lambda b: {"tokenized_len": [len(x) for x in b["input_ids"]]}, batched=True)
    if args.dataset_min_tokens:
        ds = ds.filter(lambda b: [n >= args.dataset_min_tokens for n in b["tokenized_len"]], batched=True)
    idx = list(range(len(ds)))
    if args.samples is not None and args.samples < len(idx):
        # a controlled, seeded sample (EasyContext took the first N), kept in dataset order
        idx = sorted(random.Random(0).sample(idx, args.samples))
    if not idx:
        raise ValueError("no documents left to evaluate (check --dataset-min-tokens / --samples)")
    return [list(ds[i]["input_ids"]) for i in idx]


def compute_perplexity(engine, docs, max_length, args, tokenizer, rank=0, world=1, dp_split=False,
                       device="cpu"):
    """exp(total NLL / total scored tokens) over all windows of all documents (and ranks)."""
    from tqdm import tqdm
    bos = tokenizer.bos_token_id
    max_tok = max_length - 1 if bos is not None else max_length
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    total = torch.zeros(2, dtype=torch.float64)
    # a document shorter than the length would be scored at its own length under this length's name: skipped
    long_enough = [d for d in docs if len(d) >= max_tok]
    if rank == 0 and len(long_enough) < len(docs):
        print(f"note: ppl@{max_length}: {len(docs) - len(long_enough)} of {len(docs)} documents are shorter than "
              f"{max_tok} tokens and are not counted" + ("" if long_enough else " (no value: n/a)"), flush=True)
    mine = [d for i, d in enumerate(long_enough) if not dp_split or i % world == rank]
    for ids in tqdm(mine, desc=f"ppl@{max_length}", disable=rank != 0 or args.hide_progress, leave=False):
        for begin, end, trg in windows(len(ids), max_tok, args.sliding_window, args.truncate):
            inp, tgt = window_tensors(ids, begin, end, trg, bos)
            s, c = engine.nll(inp.to(device), tgt.to(device), pad_id=pad)
            total += torch.tensor([s, c], dtype=torch.float64)
            if args.aggressive_memory:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    if dp_split:
        total = global_sum(total)
    nll, count = total.tolist()
    return math.exp(nll / count) if count > 0 else float("nan"), nll, int(count)


def main(argv=None):
    args = parse_args(argv)
    if args.output_file:  # checked before any work: the results are never lost at the end
        from easy_context.paths import check_writable_file
        check_writable_file(args.output_file, "--output-file")
    lengths = length_grid(args.min_tokens, args.max_tokens, args.tokens_step)
    models = [m for group in args.model for m in group]  # every -m item (EasyContext used the first only)

    from easy_context.inference import SeqParallelLM, init_distributed, load_model

    rank, world, device = init_distributed()
    results = {}
    tokenizer = None
    docs = None
    for name in models:
        model, tok = load_model(name, rope_theta=args.rope_theta, device=device)
        if docs is None or tok.get_vocab() != tokenizer.get_vocab():
            tokenizer = tok
            if dist.is_initialized() and rank != 0:
                dist.barrier()  # rank 0 fills the datasets cache first; the others then read it
            docs = load_documents(args, tok)
            if dist.is_initialized() and rank == 0:
                dist.barrier()
            if docs is None:  # --save-tokenized
                if rank == 0:
                    print(f"saved the tokenized dataset to {args.save_tokenized}")
                break
        engine = SeqParallelLM(model, args.parallel_mode, ring_degree=args.ring_degree)
        dp_split = engine.world == 1 and world > 1
        results[name] = []
        max_pos = getattr(model.config, "max_position_embeddings", None)
        for length in lengths:
            if max_pos and length > max_pos and not args.beyond_max_positions:
                if rank == 0:
                    print(f"note: {name}: {length} tokens exceed max_position_embeddings ({max_pos}): not measured "
                          "(n/a in the CSV; --beyond-max-positions measures it anyway)", flush=True)
                results[name].append(float("nan"))
                continue
            ppl, nll, count = compute_perplexity(engine, docs, length, args, tok, rank, world, dp_split, device)
            results[name].append(ppl)
            if rank == 0:
                print(f"{name}: {length}={ppl:.4f} (nll {nll:.4f} over {count} tokens)")
        engine.close()
        del engine, model
        gc.collect()
    if rank == 0 and results:
        for name, ppls in results.items():
            print(f"{name}: {ppls}")
        if args.output_file:
            d = os.path.dirname(args.output_file)
            if d:
                os.makedirs(d, exist_ok=True)
            with open(args.output_file, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow([""] + lengths)
                for name, ppls in results.items():
                    w.writerow([name] + ppls)
            print(f"wrote {args.output_file}")
    return results


if __name__ == "__main__":
    from easy_context.cli import run_cli
    run_cli(main, "eval_ppl.py")
