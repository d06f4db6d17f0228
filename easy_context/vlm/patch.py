"""The model side of a VLM under sequence parallelism (called by ``apply_seq_parallel_monkey_patch``).

* Only the language model's attention is routed through the mode (its text model is patched as any model
  instance, hf/patch.py); the vision tower keeps its own attention: it runs whole images / frames on each rank.
  Patching the whole VLM would hand the tower's bidirectional per-frame attention to the causal ring: wrong.
* A forward pre-hook on the VLM turns the ``sp_vision`` kwarg (this rank's ``VisionShard``, inputs.py) into
  ``mm_encoder_outputs``, the model's own entry for vision features computed outside, so the rest of its forward
  (placeholder scatter, Qwen3-VL's deepstack, the text model) runs unchanged on the local shard.
* What would be silently wrong is refused at the call: pixel values handed to a patched VLM (every rank would encode
  all images for its shard's placeholders), placeholder tokens without their ``sp_vision``. (B, L) position ids
  become (4, B, L) [documents; mRoPE] so that packed text-only rows stay per-document (the Qwen-VL text models read
  documents from the 4-row form only).

Unsupported VLM families are refused by name before anything is patched (families.py).
"""
from __future__ import annotations

from .families import inner_model, is_vlm, vlm_family
from .vision import VISION_KWARG

_ATTR = "_easy_context_vlm_hook"


class _RouteVision:
    """The VLM's forward pre-hook (an object, so a deep copy of the model routes the copy's tower)."""

    def __init__(self, inner, mode_name: str, strict: bool):
        self.inner, self.mode_name, self.strict = inner, mode_name, strict

    def __call__(self, module, args, kwargs):
        vision = kwargs.pop(VISION_KWARG, None)
        if not self.strict:  # data_parallel: the model as it is, plus the route of a cut batch's vision work
            if vision is not None:
                kwargs["mm_encoder_outputs"] = vision.encoder_outputs(self.inner)
            return args, kwargs
        for key in ("pixel_values", "pixel_values_videos"):
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"{self.mode_name}: {key} passed to a sequence-parallel VLM: each rank holds a shard of the "
                    "placeholders; cut the batch with prepare_seq_parallel_inputs(..., model=, pixel_values=, "
                    "image_grid_thw=, ...) and call the model with **prepared.model_kwargs (docs/vlm.md)")
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("position_ids")
        config = self.inner.config
        if vision is not None:
            if kwargs.get("mm_encoder_outputs") is not None:
                raise ValueError(f"{self.mode_name}: pass {VISION_KWARG}= or mm_encoder_outputs=, not both")
            if pos is None or pos.dim() != 3:
                raise ValueError(f"{self.mode_name}: a VLM call with {VISION_KWARG} needs the (4, B, L_local) position "
                                 "ids prepare_seq_parallel_inputs returned (local_position_ids)")
            kwargs["mm_encoder_outputs"] = vision.encoder_outputs(self.inner)
        elif ids is not None and bool(((ids == config.image_token_id) | (ids == config.video_token_id)).any()):
            raise ValueError(f"{self.mode_name}: the input holds image/video placeholder tokens but the call carries "
                             f"no {VISION_KWARG}: pass **prepared.model_kwargs of prepare_seq_parallel_inputs(..., "
                             "model=, pixel_values=, ...) (docs/vlm.md)")
        if pos is not None and pos.dim() == 2:  # text only: documents on row 0, the same positions on the 3 axes
            kwargs["position_ids"] = pos[None].expand(4, *pos.shape)
        return args, kwargs


def patch_vlm(mode, model, groups: dict, require: bool, patch_instance):
    """Route ``model``'s language model through ``mode`` (``patch_instance``: hf/patch.py's instance patch) and
    install the vision route; ``data_parallel`` puts the attention back and keeps only the route of ``sp_vision``
    (a batch cut by the Trainer integration under data_parallel carries it). Returns the model."""
    handle = getattr(model, _ATTR, None)
    if handle is not None:
        handle.remove()
        delattr(model, _ATTR)
    if mode.is_parallel:
        vlm_family(model)  # refuses unsupported families by name, before anything is patched
    inner = inner_model(model)
    text = getattr(inner, "language_model", None)
    if text is None:  # data_parallel on an unsupported VLM: nothing of ours is on it
        return model
    patch_instance(mode, text, groups, require)
    route = _RouteVision(inner, mode.name, strict=mode.is_parallel)
    setattr(model, _ATTR, model.register_forward_pre_hook(route, with_kwargs=True))
    return model


__all__ = ["patch_vlm", "is_vlm"]
