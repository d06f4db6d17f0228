"""TRL's fused LM head under sequence parallelism: per-token log-probs of completion tokens, computed on each rank's
shard and summed over the sp group once (DPOTrainer, GRPOTrainer; docs/trainer.md).

TRL 1.16 scores completions with ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)``: a
``FusedCausalLMOutput`` whose per-token fields (``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``,
``is_top1``) are ``(rows, seq - 1)``, zero where the next-token label is -100, and the trainer's loss and metrics
code reduces them per sequence. ``wrap_fused_forward`` replaces that call on every rank of an sp group with:

1. the group's rows: each rank keeps its own batch (the trainer's sampling, generation, rewards and gathers stay
   those of plain data parallelism over all ranks); token ids, masks and labels are all-gathered inside the group
   (integers, a few bytes per token);
2. one packed row: each row's real tokens (attention_mask 1, one contiguous run: right or left padding) are one
   document, positions restarting at 0; the target of a token is its row's next label (``targets[i] =
   labels[i+1]``), never across documents; a filler document to the layout's multiple (``batches.full_rows``);
3. the cut: ``layout.prepare_inputs`` (packed rows' dispatch table included) cuts the row and, in the target slot,
   each token's place ``row * (seq - 1) + column`` in TRL's output; the model's own fused forward runs on this
   rank's shard with ``shift_labels`` (scored without shifting, as TRL does under context parallelism);
4. one sum: each rank scatters its tokens' fields into a zero ``(fields, rows x (seq - 1))`` tensor, summed over the
   group by ``_GroupSum`` (all-reduce forward, all-reduce of the gradient backward): per-token scalars, never the
   ``(tokens x vocab)`` logits;
5. this rank's rows in TRL's shapes, so the trainer's own loss (sums, means, length normalisation, KL, entropy) runs
   unchanged on full sequences.

Gradients: every rank's loss reads its own rows of the sum; the backward all-reduce hands each rank the gradient of
all the group's losses w.r.t. its tokens, so DDP's average over the ranks is that of plain data parallelism.
"""
from __future__ import annotations

import functools
import types
from contextlib import contextmanager

import torch

from .batches import BatchError, full_rows

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# what TRL's DPO / GRPO put in a fused text-only call; anything else (images, router logits) is refused
ACCEPTED = frozenset({"input_ids", "attention_mask", "labels", "use_cache", "num_items_in_batch"})


class _GroupSum(torch.autograd.Function):
    """Sum over ``group`` (None = the world); the gradient is summed the same way (every rank's loss reads the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _gather_rows(layout, ids, mask, labels):
    """(ids, mask, labels) of every rank of the sp group, padded to the longest, and this rank's first row and
    shape. A group of one returns its own rows."""
    b, n = ids.shape
    if layout.sp == 1:
        return ids, mask, labels, 0, (b, n), n
    import torch.distributed as dist
    shape = torch.tensor([b, n], dtype=torch.long, device=ids.device)
    shapes = [torch.empty_like(shape) for _ in range(layout.sp)]
    dist.all_gather(shapes, shape, group=layout.sp_group)
    shapes = [tuple(s.tolist()) for s in shapes]
    bmax, nmax = max(s[0] for s in shapes), max(s[1] for s in shapes)
    mine = torch.zeros(3, bmax, nmax, dtype=torch.long, device=ids.device)
    mine[2].fill_(-100)
    mine[0, :b, :n], mine[1, :b, :n], mine[2, :b, :n] = ids, mask.long(), labels
    got = [torch.empty_like(mine) for _ in range(layout.sp)]
    dist.all_gather(got, mine, group=layout.sp_group)
    rows = torch.cat([g[:, :s[0]] for g, s in zip(got, shapes)], dim=1)  # (3, group rows, nmax)
    first = sum(s[0] for s in shapes[:layout.sp_rank])
    return rows[0], rows[1], rows[2], first, (b, n), nmax


def packed_row(ids, mask, labels):
    """One row of documents (each row's real tokens) and, per token, its place in TRL's ``(rows, seq - 1)`` output
    (-100: no target). Raises BatchError for masks that are not one contiguous run or labels the run cannot score."""
    rows, n = ids.shape
    toks, pos, place = [], [], []
    scored = labels[:, 1:] != -100  # TRL scores label j from the hidden state at j - 1
    for r in range(rows):
        real = mask[r].nonzero().flatten()
        if real.numel() == 0:
            if bool(scored[r].any()):
                raise BatchError(f"row {r} has labels but no attention_mask tokens")
            continue
        s, e = int(real[0]), int(real[-1]) + 1
        if e - s != real.numel():
            raise BatchError(f"row {r}: attention_mask {mask[r].tolist()[:24]}... has padding inside the sequence; "
                             "sequence parallelism packs each row's real tokens as one document (right or left "
                             "padding only)")
        outside = scored[r].clone()
        outside[s:e - 1] = False
        if bool(outside.any()):
            raise BatchError(f"row {r}: labels at padded positions (outside the attention_mask run {s}..{e - 1}) "
                             "cannot be scored under sequence parallelism; set them to -100")
        cols = torch.arange(s, e, device=ids.device)
        slot = torch.where(scored[r, s:e - 1], r * (n - 1) + cols[:-1], torch.full_like(cols[:-1], -100))
        toks.append(ids[r, s:e])
        pos.append(cols - s)
        place.append(torch.cat([slot, slot.new_full((1,), -100)]))
    return torch.cat(toks)[None], torch.cat(pos)[None], torch.cat(place)[None]


def sp_fused_call(fused, layout, pad_id, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None,
                  **kwargs):
    """TRL's fused forward (``fused``: the model's own, bound) on this rank's shard of the group's packed rows;
    returns a ``FusedCausalLMOutput`` of this rank's rows, as the unsharded call would."""
    from trl.trainer.utils import FusedCausalLMOutput
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in ACCEPTED)
    if extra or input_ids is None or labels is None:
        raise ValueError(f"sequence parallelism: the fused LM head call got {extra or 'no input_ids/labels'}; only "
                         f"text models called with {sorted(ACCEPTED)} are supported (no images, router logits, "
                         "inputs_embeds or position_ids)")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    ids, mask, labs, first, (b, n), nmax = _gather_rows(layout, input_ids, attention_mask, labels.long())
    row, pos, place = packed_row(ids, mask, labs)
    row, pos, place = full_rows({"input_ids": row, "position_ids": pos, "shift_labels": place},
                                layout.seq_multiple, pad_id)
    cut = layout.prepare_inputs(row, pos, place, row.device)
    slot = cut["local_target_ids"]
    flat_labels = labs[:, 1:].reshape(-1)
    local_labels = torch.where(slot >= 0, flat_labels[slot.clamp(min=0)], torch.full_like(slot, -100))
    out = fused(input_ids=cut["local_input_ids"], position_ids=cut["local_position_ids"], shift_labels=local_labels,
                fused_lm_head=True, use_cache=False, **cut.model_kwargs)
    names = [f for f in FIELDS if getattr(out, f, None) is not None]
    vals = torch.stack([getattr(out, f).float() for f in names]).reshape(len(names), -1)
    keep = (slot >= 0).reshape(-1)
    total = torch.zeros(len(names), ids.shape[0] * (nmax - 1), dtype=vals.dtype, device=vals.device)
    total = total.index_add(1, slot.reshape(-1)[keep], vals[:, keep])
    if layout.sp > 1:
        total = _GroupSum.apply(total, layout.sp_group)
    total = total.view(len(names), ids.shape[0], nmax - 1)[:, first:first + b, :n - 1]
    fields = {f: total[i].to(getattr(out, f).dtype) if f != "is_top1" else total[i] > 0.5
              for i, f in enumerate(names)}
    label_mask = labels[:, 1:] != -100
    lp = fields["log_probs"]
    loss = -lp.sum() / (label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
    return FusedCausalLMOutput(loss=loss, label_mask=label_mask, aux_loss=None, **fields)


@contextmanager
def plain_attention(model):
    """The model's own attention (not the sp mode's) inside the block: generation sees whole sequences."""
    prev = getattr(model, "_easy_context_prev_attn", None)
    cur = model.config._attn_implementation
    model._ec_plain = True
    if prev is not None:
        model.set_attn_implementation(prev)
    try:
        yield model
    finally:
        if prev is not None:
            model.set_attn_implementation(cur)
        model._ec_plain = False


def wrap_fused_forward(model, layout, pad_id: int) -> None:
    """Route ``model``'s fused LM head calls (``fused_lm_head=True``) through ``sp_fused_call`` and its ``generate``
    through the plain attention (``model``: the transformers model TRL patched with ``add_fused_lm_head``)."""
    fused = model.__dict__.get("forward")
    if fused is None or getattr(fused, "_ec_sp", False):
        raise ValueError(f"sequence parallelism: {type(model).__name__} has no TRL fused LM head (add_fused_lm_head) "
                         "or is already wrapped; pass the model to the TRL trainer before enable_sequence_parallel")

    @functools.wraps(type(model).forward)  # generate validates its kwargs against this signature
    def forward(self, *args, fused_lm_head=False, **kwargs):
        if fused_lm_head:
            if args:
                kwargs["input_ids"] = args[0]
            return sp_fused_call(fused, layout, pad_id, **kwargs)
        if not getattr(self, "_ec_plain", False):
            raise ValueError("sequence parallelism: a full-logits forward of the whole sequence (fused_lm_head=False) "
                             "outside generation; every rank would run the sp attention on a whole sequence. Drop "
                             "compute_metrics / set prediction_loss_only=True")
        return fused(*args, **kwargs)

    forward._ec_sp = True
    model.forward = types.MethodType(forward, model)
    generate = model.generate

    @functools.wraps(generate)
    def plain_generate(*args, **kwargs):
        with plain_attention(model):
            return generate(*args, **kwargs)

    model.generate = plain_generate


__all__ = ["wrap_fused_forward", "sp_fused_call", "packed_row", "plain_attention"]
