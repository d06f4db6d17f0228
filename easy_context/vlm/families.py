"""Which vision-language models sequence parallelism runs exactly, and how each is laid out.

A VLM here is a transformers model whose config has a ``vision_config``. The supported families share one anatomy
(checked at patch time, so a transformers release that changes it is refused by name instead of run wrong):

* the multimodal model (``model.model`` of ``...ForConditionalGeneration``) has ``get_rope_index`` (3-D mRoPE
  positions from the whole row and the image / video grids), ``visual`` (the vision tower) and ``language_model``;
* its ``forward`` takes ``mm_encoder_outputs`` (vision features computed outside), the route of each rank's own
  features (vision.py);
* its text model reads ``position_ids`` of shape (4, B, L) as [text positions; temporal; height; width] and hands
  row 0 to the decoder layers (the attention's ``position_ids``: the packed documents) and rows 1-3 to the rotary.

``frames_are_groups``: the family's token stream puts each video frame in its own <vision_start> ... <vision_end>
group (Qwen3-VL, Qwen3.5: timestamps between frames); Qwen2(.5)-VL holds a whole video in one group.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class VLMFamily:
    model_type: str
    frames_are_groups: bool
    video_seconds: bool = False  # get_rope_index takes second_per_grid_ts (Qwen2.5-VL's absolute time)


_TABLE = (
    VLMFamily("qwen2_5_vl", frames_are_groups=False, video_seconds=True),
    VLMFamily("qwen3_vl", frames_are_groups=True),
    VLMFamily("qwen3_5", frames_are_groups=True),
    VLMFamily("qwen2_vl", frames_are_groups=False),
    VLMFamily("qwen3_vl_moe", frames_are_groups=True),
)
VLM_FAMILIES: dict[str, VLMFamily] = {f.model_type: f for f in _TABLE}


def is_vlm(model) -> bool:
    """A transformers model with a vision tower (its config names a ``vision_config``)."""
    config = getattr(model, "config", None)
    return getattr(config, "vision_config", None) is not None


def inner_model(model):
    """The multimodal model (holds ``visual``, ``language_model`` and ``get_rope_index``)."""
    inner = getattr(model, "model", None)
    return inner if hasattr(inner, "language_model") else model


def vlm_family(model) -> VLMFamily:
    """The family record of a VLM, or a ValueError naming the model class and what is supported."""
    name, kind = type(model).__name__, getattr(model.config, "model_type", None)
    fam = VLM_FAMILIES.get(kind)
    if fam is None:
        raise ValueError(
            f"{name} (model_type {kind!r}) is a vision-language model whose positions and vision features "
            "easy_context cannot cut exactly across sequence-parallel ranks; supported VLM families: "
            f"{', '.join(VLM_FAMILIES)} (docs/vlm.md). Train it with data_parallel, or its language model alone")
    inner = inner_model(model)
    problem = _anatomy_problem(inner)
    if problem:
        import transformers
        raise ValueError(f"{name}: {problem} in transformers {transformers.__version__}; easy_context's VLM path "
                         "(docs/vlm.md) was written against transformers 5.24 and cannot run this model exactly")
    return fam


def _anatomy_problem(inner) -> str | None:
    for attr in ("get_rope_index", "visual", "language_model"):
        if not hasattr(inner, attr):
            return f"{type(inner).__name__} has no {attr!r}"
    if "mm_encoder_outputs" not in inspect.signature(type(inner).forward).parameters:
        return f"{type(inner).__name__}.forward takes no mm_encoder_outputs"
    try:
        src = inspect.getsource(type(inner.language_model).forward)
    except (OSError, TypeError):
        src = ""
    if "shape[0] == 4" not in src:
        return f"{type(inner.language_model).__name__} no longer reads (4, B, L) text + mRoPE position ids"
    return None


__all__ = ["VLMFamily", "VLM_FAMILIES", "is_vlm", "inner_model", "vlm_family"]
