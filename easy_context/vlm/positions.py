"""3-D mRoPE positions of whole rows, computed before the cut.

The model's ``get_rope_index`` builds (temporal, height, width) positions from the *whole* row and the image / video
grids; a sequence-parallel rank holds a shard, so the positions are computed here on the full rows, per document,
and cut along the sequence like any other tensor. The result is the (4, B, L) form the Qwen VL text models read:

    row 0      text positions: 0, 1, 2, ... inside each document, restarting at 0 (the packed documents the
               sequence-parallel attention reads, Hugging Face's packing convention)
    rows 1-3   the mRoPE positions of each document, as ``get_rope_index`` gives them for that document alone

Documents come from the caller's (B, L) ``position_ids`` (restarts at 0) or are whole rows. Images and videos are
matched to documents by their order of appearance (the order ``get_rope_index`` and ``masked_scatter`` consume them):
a vision group straddling a document boundary is an error, never a guess.
"""
from __future__ import annotations

import torch

IMAGE, VIDEO = 1, 2  # mm_token_type_ids values (Hugging Face's processors)


def token_types(config, input_ids: torch.Tensor) -> torch.Tensor:
    """mm_token_type_ids from the placeholder ids: text 0, image 1, video 2."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    types[input_ids == config.image_token_id] = IMAGE
    types[input_ids == config.video_token_id] = VIDEO
    return types


def group_grids(family, grid: torch.Tensor | None) -> torch.Tensor | None:
    """One (t, h, w) row per token group of a modality: a video is one group, or one per frame (frames_are_groups)."""
    if grid is None or not family.frames_are_groups:
        return grid
    out = torch.repeat_interleave(grid, grid[:, 0], dim=0)
    out[:, 0] = 1
    return out


def _groups(types_row: torch.Tensor):
    """(modality, start, end) of the maximal runs of equal token type in one row (text runs included)."""
    t = types_row.tolist()
    out, s = [], 0
    for i in range(1, len(t) + 1):
        if i == len(t) or t[i] != t[s]:
            out.append((t[s], s, i))
            s = i
    return out


def _doc_bounds(doc_pos_row: torch.Tensor) -> list[tuple[int, int]]:
    starts = (doc_pos_row == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return list(zip(starts, starts[1:] + [len(doc_pos_row)]))


def mrope_positions(model, family, input_ids, doc_positions, image_grid_thw=None, video_grid_thw=None,
                    second_per_grid_ts=None, mm_token_type_ids=None) -> torch.Tensor:
    """(4, B, L): the documents' text positions on row 0, their mRoPE positions on rows 1-3 (module doc).

    ``model``: the multimodal model (``inner_model``); ``doc_positions`` (B, L): 0, 1, ... per document."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    types = token_types(config, input_ids) if mm_token_type_ids is None else mm_token_type_ids.to(torch.int)
    cpu = (lambda g: None if g is None else g.detach().cpu().long())
    grids = {IMAGE: group_grids(family, cpu(image_grid_thw)), VIDEO: group_grids(family, cpu(video_grid_thw))}
    used = {IMAGE: 0, VIDEO: 0}
    secs = None if second_per_grid_ts is None else torch.as_tensor(second_per_grid_ts).flatten()
    out = torch.zeros(4, *input_ids.shape, dtype=torch.long)
    cpu_ids, cpu_types = input_ids.detach().cpu(), types.detach().cpu()
    for b in range(input_ids.shape[0]):
        bounds = _doc_bounds(doc_positions[b].detach().cpu())
        for s, e in bounds:
            out[0, b, s:e] = torch.arange(e - s)
        for s, e in bounds:
            taken = {IMAGE: [], VIDEO: []}
            for kind, gs, ge in _groups(cpu_types[b, s:e]):
                if kind == 0:
                    continue
                g, i, what = grids[kind], used[kind], "image" if kind == IMAGE else "video"
                if g is None or i >= len(g):
                    raise ValueError(f"row {b} holds more {what} placeholder groups than {what}_grid_thw has rows "
                                     f"({0 if g is None else len(g)})")
                n = int(g[i].prod()) // merge ** 2
                if ge - gs != n:
                    raise ValueError(
                        f"row {b}, tokens [{s + gs}, {s + ge}): a run of {ge - gs} {what} placeholder tokens where "
                        f"grid {g[i].tolist()} needs {n} (a group cut by a document boundary, two groups without a "
                        "token between them, or grids out of order)")
                taken[kind].append(i)
                used[kind] += 1
            if not taken[IMAGE] and not taken[VIDEO]:
                out[1:, b, s:e] = torch.arange(e - s)
                continue
            kw = {}
            if taken[IMAGE]:
                kw["image_grid_thw"] = grids[IMAGE][taken[IMAGE]]
            if taken[VIDEO]:
                kw["video_grid_thw"] = grids[VIDEO][taken[VIDEO]]
                if secs is not None and family.video_seconds:
                    kw["second_per_grid_ts"] = secs[taken[VIDEO]]
            pos, _ = model.get_rope_index(cpu_ids[b:b + 1, s:e], mm_token_type_ids=cpu_types[b:b + 1, s:e], **kw)
            out[1:, b, s:e] = pos[:, 0].cpu()
    for kind, name in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw")):
        g = grids[kind]
        if g is not None and used[kind] != len(g):
            raise ValueError(f"{name} describes {len(g)} groups but the rows hold {used[kind]} placeholder groups")
    return out.to(input_ids.device)


__all__ = ["mrope_positions", "token_types", "group_grids", "IMAGE", "VIDEO"]
