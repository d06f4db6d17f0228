"""Vision features under sequence parallelism: each rank encodes what its own shard needs.

The model scatters its vision features into the placeholder tokens of ``inputs_embeds`` in order; a rank holds a
shard, so it needs the features of its own placeholders only (an image cut by the shard boundary: part of them).

The unit of encoding is one image or one video *frame* (a temporal patch: grid (1, h, w)). The Qwen vision towers
attend within a frame (their ``cu_seqlens`` / windows are per frame), merge 2x2 patches within it and embed its
positions from (h, w): a frame encoded alone gives the same features as inside its video (tests/test_vlm.py checks
it). So a rank encodes the frames and images its placeholders touch, about 1/W of the vision work plus the units cut by
a shard boundary, instead of all of them on every rank (``strategy="all"``: simpler, W times the vision work; kept
as the reference and for towers whose frames are not independent). docs/vlm.md has the measured comparison.

Gradients: every rank's loss reaches the vision tower only through its own placeholders' features, so the sum over
ranks of the tower's gradients is the one-process gradient: the tower is combined like any other weight (DDP /
DeepSpeed / the tests' all-reduce). A rank whose shard holds no placeholder of a batch that has images still encodes
one unit and keeps zero rows of it, so that every rank's tower takes part in backward (DDP's reducer waits for all).

``VisionShard`` is what one rank encodes and where each feature goes; it travels to the model call as the model
kwarg ``sp_vision`` (patch.py turns it into ``mm_encoder_outputs``), like the packed rows' ``sp_dispatch`` table.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

VISION_KWARG = "sp_vision"
STRATEGIES = ("local", "all")


@dataclass
class ModalityShard:
    kind: str                 # "image" / "video"
    pixels: torch.Tensor      # pixel rows of the units this rank encodes, in unit order
    grids: torch.Tensor       # (units, 3) their (t, h, w)
    take: torch.Tensor        # rows of the encoded features for this rank's placeholders (masked_scatter order)
    units: int                # units encoded (tests, docs)
    total_units: int          # units of the batch

    def to(self, device):
        return ModalityShard(self.kind, self.pixels.to(device), self.grids.to(device), self.take.to(device),
                             self.units, self.total_units)


@dataclass
class VisionShard:
    image: ModalityShard | None = None
    video: ModalityShard | None = None
    strategy: str = "local"

    def to(self, device):
        return VisionShard(*(None if m is None else m.to(device) for m in (self.image, self.video)), self.strategy)

    def encoder_outputs(self, inner) -> dict:
        """``mm_encoder_outputs`` for the multimodal model ``inner``: this rank's features, in placeholder order."""
        out = {}
        for m in (self.image, self.video):
            if m is None:
                continue
            encode = inner.get_image_features if m.kind == "image" else inner.get_video_features
            res = encode(m.pixels, m.grids, return_dict=True)
            res.pooler_output = (torch.cat(list(res.pooler_output), 0)[m.take],)
            if getattr(res, "deepstack_features", None):  # Qwen3-VL: per deepstack layer, the same rows
                res.deepstack_features = [(torch.cat(list(f), 0)[m.take],) for f in res.deepstack_features]
            out[m.kind] = res
        return out


def _units(grid: torch.Tensor, split_frames: bool):
    """(unit grids (U, 3), pixel rows per unit, item of each unit): a video's frames as units when ``split_frames``."""
    if not split_frames:
        return grid, grid.prod(-1), torch.arange(len(grid))
    reps = grid[:, 0]
    unit = torch.repeat_interleave(grid, reps, dim=0)
    unit[:, 0] = 1
    return unit, unit.prod(-1), torch.repeat_interleave(torch.arange(len(grid)), reps)


def modality_shard(kind, input_ids, token_id, grid, pixels, merge, shard_fn, strategy) -> ModalityShard | None:
    """This rank's ``ModalityShard`` of one modality; ``shard_fn(t)``: this rank's cut of a (B, L) tensor."""
    if grid is None:
        if bool((input_ids == token_id).any()):
            raise ValueError(f"the rows hold {kind} placeholder tokens (id {token_id}) but no {kind}_grid_thw / "
                             f"pixel values were passed: pass pixel_values{'_videos' if kind == 'video' else ''} and "
                             f"{kind}_grid_thw of the whole batch")
        return None
    if pixels is None:
        raise ValueError(f"{kind}_grid_thw was passed without pixel_values{'_videos' if kind == 'video' else ''}")
    grid = grid.detach().cpu().long()
    unit_grid, unit_rows, _ = _units(grid, strategy == "local")
    if int(unit_rows.sum()) != pixels.shape[0]:
        raise ValueError(f"pixel_values{'_videos' if kind == 'video' else ''} has {pixels.shape[0]} rows but "
                         f"{kind}_grid_thw describes {int(unit_rows.sum())} patches")
    unit_tokens = unit_rows // merge ** 2
    mask = (input_ids == token_id).cpu()
    n = int(mask.sum())
    if n != int(unit_tokens.sum()):
        raise ValueError(f"the rows hold {n} {kind} placeholder tokens but {kind}_grid_thw gives "
                         f"{int(unit_tokens.sum())} features (merge {merge}x{merge})")
    feature = torch.full(mask.shape, -1, dtype=torch.long)
    feature[mask] = torch.arange(n)  # row-major: the order masked_scatter fills placeholders in
    local = shard_fn(feature)
    needed = local[local >= 0]
    tok_start = torch.cumsum(unit_tokens, 0) - unit_tokens
    unit_of = torch.repeat_interleave(torch.arange(len(unit_grid)), unit_tokens)
    if strategy == "all":
        chosen = torch.arange(len(unit_grid))
    else:
        chosen = torch.unique(unit_of[needed]) if len(needed) else torch.zeros(1, dtype=torch.long)
    row_start = torch.cumsum(unit_rows, 0) - unit_rows
    counts = unit_rows[chosen]  # the chosen units' pixel rows, in unit order
    rows = torch.repeat_interleave(row_start[chosen] - (torch.cumsum(counts, 0) - counts), counts) \
        + torch.arange(int(counts.sum()))
    enc_start = torch.zeros(len(unit_grid), dtype=torch.long)
    enc_start[chosen] = torch.cumsum(unit_tokens[chosen], 0) - unit_tokens[chosen]
    take = enc_start[unit_of[needed]] + needed - tok_start[unit_of[needed]]
    return ModalityShard(kind, pixels.index_select(0, rows.to(pixels.device)), unit_grid[chosen], take,
                         len(chosen), len(unit_grid))


def vision_shard(config, input_ids, shard_fn, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                 video_grid_thw=None, strategy: str = "local") -> VisionShard | None:
    """What this rank encodes (module doc); None when the batch has no vision input."""
    if strategy not in STRATEGIES:
        raise ValueError(f"vision={strategy!r}: choose one of {STRATEGIES}")
    merge = config.vision_config.spatial_merge_size
    image = modality_shard("image", input_ids, config.image_token_id, image_grid_thw, pixel_values, merge,
                           shard_fn, strategy)
    video = modality_shard("video", input_ids, config.video_token_id, video_grid_thw, pixel_values_videos, merge,
                           shard_fn, strategy)
    return None if image is None and video is None else VisionShard(image, video, strategy)


__all__ = ["VISION_KWARG", "STRATEGIES", "ModalityShard", "VisionShard", "vision_shard"]
