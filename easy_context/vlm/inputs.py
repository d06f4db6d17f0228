"""A VLM batch through ``prepare_seq_parallel_inputs``: 3-D positions and vision inputs cut with the text.

    prepared = prepare_seq_parallel_inputs("zigzag_ring_attn", input_ids, position_ids, labels, rank, world, device,
                                           model=vlm, pixel_values=pv, image_grid_thw=ig,
                                           pixel_values_videos=pvv, video_grid_thw=vg)
    out = vlm(prepared["local_input_ids"], position_ids=prepared["local_position_ids"], **prepared.model_kwargs)

``position_ids``: None (one document per row), (B, L) documents restarting at 0 (packed rows), or positions the caller
built: (4, B, L) [text; t; h; w] or (3, B, L) mRoPE (one document per row). The cut is decided on the (B, L) text
positions (row 0), exactly as for a text model, and every row of the (4, B, L) positions follows it;
``local_position_ids`` is this rank's (4, B, L_local), which the model reads as text positions (the documents the
attention sees) and mRoPE positions (the rotary). ``model_kwargs`` carries this rank's ``VisionShard`` (vision.py)
beside the packed rows' dispatch table.
"""
from __future__ import annotations

import torch

from ..batch_layout import SeqParallelInputs
from .vision import VISION_KWARG

# the keyword arguments of prepare_seq_parallel_inputs that make it a VLM batch (api.py routes them here)
VLM_KEYS = ("model", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
            "mm_token_type_ids", "vision")


class VLMInputs(SeqParallelInputs):
    """``SeqParallelInputs`` whose ``model_kwargs`` also carry this rank's vision work (``sp_vision``)."""

    def __init__(self, tensors: dict, layout, vision):
        super().__init__(tensors, layout)
        self.vision = vision

    @property
    def model_kwargs(self) -> dict:
        kw = dict(self.layout.model_kwargs)
        if self.vision is not None:
            kw[VISION_KWARG] = self.vision
        return kw


class VLMRows:
    """One VLM batch before the cut: the (B, L) positions the cut is decided on and the (4, B, L) positions."""

    def __init__(self, input_ids, position_ids, model=None, pixel_values=None, image_grid_thw=None,
                 pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None, mm_token_type_ids=None,
                 vision="local"):
        self.input_ids, self.model, self.strategy = input_ids, model, vision
        self.visual = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                           pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)
        has_vision = image_grid_thw is not None or video_grid_thw is not None
        if (has_vision or pixel_values is not None or pixel_values_videos is not None) and model is None:
            raise ValueError("prepare_seq_parallel_inputs got vision inputs without model=: pass model= the "
                             "vision-language model (its get_rope_index builds the 3-D positions of the whole rows)")
        if model is not None:
            from .families import is_vlm
            if not is_vlm(model):
                raise ValueError(f"prepare_seq_parallel_inputs(model=...) is for vision-language models; "
                                 f"{type(model).__name__} has no vision_config (a text model needs no model=)")
        b, n = input_ids.shape
        if position_ids is not None and position_ids.dim() == 3:
            if position_ids.shape[0] not in (3, 4) or tuple(position_ids.shape[1:]) != (b, n):
                raise ValueError(f"3-D position_ids must be (3, B, L) mRoPE or (4, B, L) text + mRoPE positions for "
                                 f"input_ids {(b, n)}; got {tuple(position_ids.shape)}")
            if position_ids.shape[0] == 3:
                text = torch.arange(n, device=position_ids.device).expand(b, n)
                position_ids = torch.cat([text[None].to(position_ids.dtype), position_ids])
            self.doc_positions, self.positions = position_ids[0], position_ids
            return
        doc = position_ids
        if doc is None:
            doc = torch.arange(n, device=input_ids.device).expand(b, n)
        if doc.shape != (b, n):
            raise ValueError(f"position_ids {tuple(doc.shape)} must be (B, L) like input_ids {(b, n)} (or (3|4, B, L))")
        self.doc_positions = doc
        if model is not None and has_vision:
            from .families import inner_model, vlm_family
            from .positions import mrope_positions
            inner = inner_model(model)
            self.positions = mrope_positions(inner, vlm_family(model), input_ids, doc, image_grid_thw, video_grid_thw,
                                             second_per_grid_ts, mm_token_type_ids)
        else:  # text only: the mRoPE positions of text are its text positions on every axis
            self.positions = doc[None].expand(4, b, n)

    def finish(self, prepared: SeqParallelInputs, rank: int, device, tag_attr: str) -> VLMInputs:
        """The VLM form of what the text cut returned: (4, B, L_local) positions and this rank's vision work."""
        layout = prepared.layout
        local = layout.shard(self.positions, rank, dim=-1).to(device)
        if local is self.positions:
            local = local.view_as(local)
        tag = getattr(prepared["local_position_ids"], tag_attr, None)
        if tag is not None:
            setattr(local, tag_attr, tag)
        vision = None
        if self.model is not None:
            from .vision import vision_shard
            from .families import inner_model
            vision = vision_shard(inner_model(self.model).config, self.input_ids,
                                  lambda t: layout.shard(t, rank, dim=-1), strategy=self.strategy, **self.visual)
            vision = None if vision is None else vision.to(device)
        tensors = dict(prepared, local_position_ids=local)
        return VLMInputs(tensors, layout, vision)


__all__ = ["VLM_KEYS", "VLMInputs", "VLMRows"]
