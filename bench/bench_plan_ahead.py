"""What planning a packed row's dispatch costs on train.py's critical path, with and without plan-ahead (CPU).

    python bench/bench_plan_ahead.py [--lengths 131072 524288] [--world 8] [--rows 3]

Rows as bench_packed.py (log-normal documents, median 1500, sigma 1.5, seeds 0..rows-1). "planning here" is
``prepare_seq_parallel_inputs`` as train.py called it before (it plans the table); "table given" is the same call
with the table planned ahead by easy_context_train/plan_ahead.py's helper process (``dispatch=``), which is what train.py
does now from its second step on. Median over the rows; the ratio is the part of the critical path removed.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.bench_packed import doc_lengths, positions  # noqa: E402
from easy_context import prepare_seq_parallel_inputs  # noqa: E402
from easy_context.dispatch import plan as dispatch  # noqa: E402
from easy_context.registry import SEQ_ALGOS, get_mode  # noqa: E402
from easy_context_train.plan_ahead import plan_table  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rows", type=int, default=3)
    args = ap.parse_args()
    mode = next(get_mode(n) for n in SEQ_ALGOS if get_mode(n).dispatches and not get_mode(n).degree_kwargs)
    print(f"| L | W | planning here ms | table given ms | ratio |  ({mode.name}, torch {torch.__version__}, CPU)")
    print("|---|---|---|---|---|")
    for L in args.lengths:
        here, given = [], []
        for seed in range(args.rows):
            pos = positions(doc_lengths(L, 1500, 1.5, seed=seed))
            ids = torch.zeros_like(pos)
            dispatch._CACHE.clear()  # a new batch: nothing planned yet
            t = time.perf_counter()
            prepare_seq_parallel_inputs(mode.name, ids, pos, ids, 0, args.world, "cpu", dispatch="auto")
            here.append(time.perf_counter() - t)
            table = plan_table(mode.name, args.world, {}, pos)
            dispatch._CACHE.clear()
            t = time.perf_counter()
            prepare_seq_parallel_inputs(mode.name, ids, pos, ids, 0, args.world, "cpu", dispatch=table)
            given.append(time.perf_counter() - t)
        h, g = statistics.median(here) * 1e3, statistics.median(given) * 1e3
        print(f"| {L} | {args.world} | {h:.0f} | {g:.1f} | {h / g:.0f}x |")


if __name__ == "__main__":
    main()
