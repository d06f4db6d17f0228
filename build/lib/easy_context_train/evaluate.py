"""Held-out loss during training (``--eval-every N --eval-dataset D --eval-rows K``).

The eval loss is the token mean of the next-token NLL over the first K rows of D, computed exactly like the
training loss (same ``layout.prepare_inputs`` shards, same ``nll_sum``, labels / packed-document positions
honoured), so a run with W ranks reports the same number as one process: NLL sums and valid-token counts are
summed over every rank and divided once; nothing is scaled by the number of ranks.

Rows are dealt round-robin to the data-parallel groups (the sp ranks of a group share a row). Every rank runs
the same number of forwards, because ZeRO-3 gathers weights collectively: a dp group with fewer rows runs a
filler row whose targets are all ignored.
"""
from __future__ import annotations

import torch

from easy_context.loss import global_sum
from .data import load_any_dataset, validate_packed
from .packed_data import IGNORE_INDEX, batch_targets
from .parallel import nll_sum


def load_eval_rows(args, vocab_size: int | None = None):
    """The first ``--eval-rows`` rows of ``--eval-dataset`` (validated like --dataset: token ids against the
    model's ``vocab_size`` too), or None."""
    if args.eval_dataset is None:
        return None
    ds = validate_packed(load_any_dataset(args.eval_dataset, args.eval_split or args.dataset_split),
                         args.eval_dataset, args.seq_length, vocab_size, args.model)
    return ds.select(range(min(args.eval_rows, len(ds))))


def due(args, step: int) -> bool:
    """Evaluate after optimizer step ``step`` (1-based): every --eval-every steps and after the last."""
    if args.eval_dataset is None:
        return False
    return step == args.max_train_steps or bool(args.eval_every) and step % args.eval_every == 0


def _row(ds, i: int, seq_length: int) -> dict:
    r = ds[i]
    return {c: r[c][: seq_length + 1].long().unsqueeze(0) for c in r}


@torch.no_grad()
def eval_loss(model, unwrapped, rows, layout, args, device) -> float:
    """Token-weighted mean NLL over ``rows`` (all ranks), model in eval mode during the pass."""
    was_training = model.training
    model.eval()
    try:
        per_dp = -(-len(rows) // layout.dp)  # forwards per rank (ceil)
        nll = torch.zeros((), device=device, dtype=torch.float64)
        count = torch.zeros((), device=device, dtype=torch.float64)
        for j in range(per_dp):
            i = j * layout.dp + layout.dp_rank
            inp, pos, tgt = batch_targets(_row(rows, min(i, len(rows) - 1), args.seq_length))
            if i >= len(rows):
                tgt = torch.full_like(tgt, IGNORE_INDEX)  # filler forward: counts nothing
            w = layout.prepare_inputs(inp, pos, tgt, device)
            nll += nll_sum(model, unwrapped, w["local_input_ids"], w["local_position_ids"], w["local_target_ids"],
                           args.chunked_loss, model_kwargs=w.model_kwargs).double()
            count += (w["local_target_ids"] != IGNORE_INDEX).sum()
        return (global_sum(nll) / global_sum(count).clamp(min=1)).item()
    finally:
        if was_training:
            model.train()
