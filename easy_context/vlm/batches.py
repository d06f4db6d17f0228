"""A collated VLM batch for the Trainer integration (integrations/trainer.py): the vision inputs aside, padding as
documents.

TRL's ``DataCollatorForVisionLanguageModeling`` (and a processor called with ``padding=True``) pads rows and marks the
padding in ``attention_mask``; TRL has no padding-free mode for vision data. A sequence-parallel rank holds a slice of
a row and cannot apply a padding mask, but it needs none: every run of real tokens and every run of padding becomes
its own document (position ids restarting at 0, padding never a target). Attention is per document and causal, so the
real tokens see exactly what the padded one-process forward lets them see (left or right padding alike) and their
mRoPE positions are those ``get_rope_index`` gives under the mask; the padding documents cost a little attention and
add nothing to the loss.

``mm_token_type_ids`` is dropped: the cut derives the token types from the placeholder ids (vlm/positions.py), which
stays right after the integration appends its filler document.
"""
from __future__ import annotations

import torch

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
DROPPED = ("mm_token_type_ids",)


def runs_as_documents(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids counting 0, 1, ... inside every run of equal ``mask`` values (real tokens / padding)."""
    b, n = mask.shape
    idx = torch.arange(n, device=mask.device).expand(b, n)
    start = torch.ones_like(mask, dtype=torch.bool)
    start[:, 1:] = mask[:, 1:] != mask[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def split_vision(batch: dict, model) -> tuple[dict, dict | None]:
    """(the batch ``full_rows`` takes, the cut's VLM kwargs or None). ``model``: the VLM (None: not a VLM; the batch
    is returned as it is and ``full_rows`` names any vision key as unsupported)."""
    if model is None:
        return batch, None
    from .families import vlm_family
    vlm_family(model)  # a VLM whose positions we cannot build is named, in every mode (data_parallel included)
    vision = {k: batch.pop(k) for k in VISION_KEYS if k in batch}
    for k in DROPPED:
        batch.pop(k, None)
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool((mask != 0).all()):
        if batch.get("position_ids") is not None:
            raise ValueError("a VLM batch with both padding (attention_mask zeros) and position_ids: pass one of them")
        mask = mask != 0
        batch["position_ids"] = runs_as_documents(mask)
        for key in ("labels", "shift_labels"):
            if key in batch:
                batch[key] = batch[key].masked_fill(~mask, -100)
        batch.pop("attention_mask")
    return batch, dict(vision, model=model)


__all__ = ["split_vision", "runs_as_documents", "VISION_KEYS"]
