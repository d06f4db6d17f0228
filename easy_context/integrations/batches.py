"""A Trainer batch -> full rows of (input_ids, position_ids, targets) ready for the sp layout (pure, no process group).

Trainer batches follow Hugging Face's convention: ``labels`` unshifted (the model predicts ``labels[:, i + 1]`` at
position ``i``; the last position has no target), or ``shift_labels`` already shifted (padding-free collators);
packed / padding-free rows carry ``position_ids`` that restart at 0 at each document. Here the targets are
shifted once, explicitly, as train.py's ``batch_targets`` does for its rows of seq_length + 1:

    targets[:, i] = labels[:, i + 1]   (-100 at the last position, and where position_ids[:, i + 1] == 0:
                                        a document's first token is never predicted from the previous document)

A row whose length the layout cannot cut (zigzag needs a multiple of 2 x ring, Ulysses of sp, ...) gets a filler
document at its end: pad tokens, targets -100, positions restarting at 0. Attention is per document and causal,
so the filler changes no other token's output and adds no target: the loss is that of the unpadded row.
"""
from __future__ import annotations

import torch

from ..loss import IGNORE_INDEX

TARGETS = "ec_target_ids"  # the key the shifted, sharded targets travel under to compute_loss
# batch keys the sharded forward does not need: collator extras for varlen kernels (recomputed from the sharded
# position_ids by our attention), the labels (turned into targets), TRL's cache switch
DROPPED = frozenset({"labels", "shift_labels", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                     "max_length_k", "seq_idx", "use_cache", "seq_lengths", "num_items_in_batch"})
PADDING_FIX = ("use a padding-free collator that marks documents with position_ids: "
               "transformers.DataCollatorWithFlattening, or trl SFTConfig(padding_free=True) / packing=True")


class BatchError(ValueError):
    """A batch sequence parallelism cannot train exactly; the message names the setting to change."""


def full_rows(batch: dict, multiple: int, pad_id: int = 0, pad_to_multiple: bool = True):
    """(input_ids, position_ids, targets) ``(batch, L')`` of a collated Trainer batch, ``L'`` a multiple of
    ``multiple`` (filler document appended when ``pad_to_multiple``). Raises BatchError naming the fix."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise BatchError(f"sequence parallelism needs batches with a 2D 'input_ids' tensor (batch, seq); got keys "
                         f"{sorted(batch)} with input_ids {type(ids).__name__}")
    extra = sorted(set(batch) - DROPPED - {"input_ids", "position_ids", TARGETS})
    if extra:
        raise BatchError(f"batch keys {extra} are not supported under sequence parallelism (the model gets only "
                         "this rank's slice of input_ids and position_ids); remove them in the collator or dataset")
    b, n = ids.shape
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise BatchError("the data collator padded the batch (attention_mask has zeros): a sequence-parallel rank "
                         "holds a slice of the row and cannot see where padding is; " + PADDING_FIX)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(n, device=ids.device).expand(b, n)
    elif tuple(pos.shape) != (b, n):
        raise BatchError(f"position_ids {tuple(pos.shape)} must match input_ids {(b, n)}")
    else:  # documents as the attention reads them: start at 0, then +1 or a restart at 0 (train.py's rule)
        ok = pos[:, 0] == 0
        if n > 1:
            step = pos[:, 1:]
            ok = ok & ((step == 0) | (step == pos[:, :-1] + 1)).all(dim=1)
        if not bool(ok.all()):
            r = int((~ok).nonzero()[0])
            raise BatchError(f"row {r} of the batch: position_ids {pos[r, :12].tolist()}... must start at 0 and, inside "
                             "a document, increase by 1 (a new document restarts at 0); rows that start inside a "
                             "document (e.g. trl packing_strategy='wrapped') are not exact under sequence "
                             "parallelism: use packing_strategy='bfd'")
    if "shift_labels" in batch:
        tgt = batch["shift_labels"].clone()
    elif "labels" in batch:
        tgt = torch.full_like(ids, IGNORE_INDEX)
        tgt[:, :-1] = batch["labels"][:, 1:]
    else:
        raise BatchError("the batch has no 'labels' (nothing to train on): the collator must return labels "
                         "(-100 where a token is not trained)")
    if tuple(tgt.shape) != (b, n):
        raise BatchError(f"labels {tuple(tgt.shape)} must match input_ids {(b, n)}")
    tgt[:, :-1][pos[:, 1:] == 0] = IGNORE_INDEX  # never across a document start (train.py's rule)
    fill = -n % multiple
    if fill:
        if not pad_to_multiple:
            raise BatchError(f"a batch of sequence length {n} is not a multiple of {multiple}, which the layout needs "
                             "to cut it; set the collator's pad_to_multiple_of / max_length to a multiple of "
                             f"{multiple}, or pass pad_to_multiple=True")
        filler = torch.arange(fill, device=ids.device).expand(b, fill)
        ids = torch.cat([ids, torch.full((b, fill), pad_id, dtype=ids.dtype, device=ids.device)], 1)
        pos = torch.cat([pos, filler.to(pos.dtype)], 1)
        tgt = torch.cat([tgt, torch.full((b, fill), IGNORE_INDEX, dtype=tgt.dtype, device=tgt.device)], 1)
    return ids, pos.contiguous(), tgt.long()


def shard_batch(batch: dict, layout, pad_id: int = 0, pad_to_multiple: bool = True, vision=None) -> dict:
    """This sp rank's slice: ``{"input_ids", "position_ids", TARGETS}`` (device of the batch). ``vision``: a VLM
    batch's vision inputs (vlm/batches.split_vision)."""
    rows = full_rows(batch, layout.seq_multiple, pad_id, pad_to_multiple)
    return cut_rows(rows if vision is None else rows + (vision,), layout)


def cut_rows(rows, layout, dispatch=None) -> dict:
    """``full_rows``' (ids, positions, targets) cut for this sp rank (``dispatch``: a packed row's table planned
    elsewhere, easy_context_train/plan_ahead.py; else planned here). A VLM's rows carry a 4th item, the vision inputs
    (model=, pixel_values=, grids): its (4, B, L) positions and vision work come back (vlm/inputs.py)."""
    ids, pos, tgt, *vision = rows
    out = layout.prepare_inputs(ids, pos, tgt, ids.device, dispatch=dispatch, **(vision[0] if vision else {}))
    # the packed rows' table rides in the batch as a plain object (the Trainer moves tensors only) and reaches the
    # model as a kwarg (compute_loss)
    return {"input_ids": out["local_input_ids"], "position_ids": out["local_position_ids"],
            TARGETS: out["local_target_ids"], **out.model_kwargs}
