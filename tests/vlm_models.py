"""Tiny vision-language models and packed text + image + video rows for tests/test_vlm.py (no downloads).

``make_vlm(family)``: a float32 Qwen2.5-VL / Qwen3-VL / Qwen3.5 with a 2-layer vision tower (window attention and a
full-attention block on Qwen2.5-VL, a deepstack layer on Qwen3-VL) and a 2-layer text model (GQA 4/2, mRoPE sections
[2, 3, 3] of head_dim 16). ``make_rows(family, docs)``: a batch whose rows pack documents of text, images and videos
the way the family's processor lays them out (Qwen3-VL / Qwen3.5: a timestamp token and a <vision_start> ...
<vision_end> group per video frame; Qwen2.5-VL: one group per video), with the pixel rows, grids and per-document
slices the one-process reference needs.
"""
from __future__ import annotations

import torch

VOCAB, IMG, VID, VS, VE = 160, 150, 151, 152, 153
PATCH = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen2_vl", "qwen3_vl_moe")
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096, rope_theta=50000.0,
             tie_word_embeddings=False, head_dim=16)
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=2,
               temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
_IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)


def make_config(family: str):
    import transformers as tf
    if family == "qwen2_5_vl":
        return tf.Qwen2_5_VLConfig(
            text_config=dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(_VISION, window_size=8, fullatt_block_indexes=[1], tokens_per_second=2), **_IDS)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    if family == "qwen3_vl":
        return tf.Qwen3VLConfig(text_config=dict(_TEXT, rope_scaling=rope),
                                vision_config=dict(_VISION, deepstack_visual_indexes=[0], num_position_embeddings=64),
                                **_IDS)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=2,
                      temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
        return tf.Qwen2VLConfig(text_config=dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                                vision_config=vision, **_IDS)
    if family == "qwen3_vl_moe":
        text = dict(_TEXT, rope_scaling=rope, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    decoder_sparse_step=1)
        return tf.Qwen3VLMoeConfig(text_config=text, vision_config=dict(_VISION, deepstack_visual_indexes=[0],
                                                                        num_position_embeddings=64), **_IDS)
    if family == "qwen3_5":  # hybrid: gated DeltaNet then full attention
        text = dict(_TEXT, rope_parameters=dict(rope, partial_rotary_factor=1.0), layer_types=["linear_attention",
                    "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4)
        return tf.Qwen3_5Config(text_config=text, vision_config=dict(_VISION, num_position_embeddings=64), **_IDS)
    raise ValueError(family)


def make_vlm(family: str, seed: int = 0):
    import transformers as tf
    cls = {"qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration, "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
           "qwen3_5": tf.Qwen3_5ForConditionalGeneration, "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
           "qwen3_vl_moe": tf.Qwen3VLMoeForConditionalGeneration}[family]
    torch.manual_seed(seed)
    model = cls(make_config(family)).float()
    with torch.no_grad():  # a non-trivial tower: random (not zero) biases / norms
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.train()


def _text(g, n):
    return torch.randint(0, 140, (n,), generator=g).tolist()


def make_doc(family: str, segments, g):
    """One document: ``segments`` of ("t", n) / ("img", (h, w)) / ("vid", (t, h, w)) in patches (h, w even)."""
    frames = family in ("qwen3_vl", "qwen3_5", "qwen3_vl_moe")
    ids, images, videos = [], [], []
    for kind, arg in segments:
        if kind == "t":
            ids += _text(g, arg)
        elif kind == "img":
            h, w = arg
            ids += [VS] + [IMG] * (h * w // 4) + [VE]
            images.append((1, h, w))
        else:
            t, h, w = arg
            if frames:  # <t_i> <vs> frame i <ve> per frame (timestamps: one text token here)
                for _ in range(t):
                    ids += _text(g, 1) + [VS] + [VID] * (h * w // 4) + [VE]
            else:
                ids += [VS] + [VID] * (t * h * w // 4) + [VE]
            videos.append((t, h, w))
    return ids, images, videos


def make_rows(family: str, rows, seed: int = 1, pad_to: int | None = None):
    """A batch: ``rows`` = list of rows, each a list of documents (segment lists). Returns a dict with input_ids,
    position_ids (0.. per document), targets (next token inside a document, -100 elsewhere), pixel_values /
    image_grid_thw / pixel_values_videos / video_grid_thw (None when absent) and ``docs``: per row the documents'
    (start, end, image indices, video indices)."""
    g = torch.Generator().manual_seed(seed)
    all_ids, all_pos, images, videos, docs = [], [], [], [], []
    for row in rows:
        ids, pos, row_docs = [], [], []
        for seg in row:
            d_ids, d_img, d_vid = make_doc(family, seg, g)
            row_docs.append((len(ids), len(ids) + len(d_ids), list(range(len(images), len(images) + len(d_img))),
                             list(range(len(videos), len(videos) + len(d_vid)))))
            ids += d_ids
            pos += list(range(len(d_ids)))
            images += d_img
            videos += d_vid
        all_ids.append(ids)
        all_pos.append(pos)
        docs.append(row_docs)
    n = max(len(r) for r in all_ids) if pad_to is None else pad_to
    for r, (ids, pos) in enumerate(zip(all_ids, all_pos)):
        if len(ids) > n:
            raise ValueError(f"row {r} has {len(ids)} tokens > {n}")
        if len(ids) < n:  # a filler text document
            docs[r].append((len(ids), n, [], []))
            pos += list(range(n - len(ids)))
            ids += _text(g, n - len(ids))
    input_ids, position_ids = torch.tensor(all_ids), torch.tensor(all_pos)
    targets = torch.full_like(input_ids, -100)
    for r, row_docs in enumerate(docs):
        for s, e, _, _ in row_docs:
            targets[r, s:e - 1] = input_ids[r, s + 1:e]
    targets[(input_ids == IMG) | (input_ids == VID)] = -100  # as a collator masks the placeholders
    grid_i = torch.tensor(images) if images else None
    grid_v = torch.tensor(videos) if videos else None
    pv = torch.randn(int(grid_i.prod(-1).sum()), PATCH, generator=g) if images else None
    pvv = torch.randn(int(grid_v.prod(-1).sum()), PATCH, generator=g) if videos else None
    # Qwen2.5-VL spaces a video's temporal positions by its seconds per frame (tokens_per_second 2 here)
    secs = torch.tensor([0.5 + 1.5 * i for i in range(len(videos))]) if videos and family == "qwen2_5_vl" else None
    return dict(input_ids=input_ids, position_ids=position_ids, targets=targets, pixel_values=pv,
                image_grid_thw=grid_i, pixel_values_videos=pvv, video_grid_thw=grid_v, second_per_grid_ts=secs,
                docs=docs)


def _rows_of(grid, pixels, idx):
    """Pixel rows and grid rows of the items ``idx`` (consecutive in the batch) of one modality."""
    if not idx:
        return None, None
    sizes = grid.prod(-1)
    start = int(sizes[:idx[0]].sum())
    return pixels[start:start + int(sizes[idx].sum())], grid[idx]


def reference(model, batch):
    """One process, Hugging Face's own path: each document alone (the model builds its positions and encodes its
    images), so no packing convention is assumed. Returns (logits (B, L, V), NLL sum)."""
    from easy_context.vlm.positions import token_types
    ids, tgt = batch["input_ids"], batch["targets"]
    logits = torch.zeros(*ids.shape, VOCAB)
    total = 0.0
    for r, row_docs in enumerate(batch["docs"]):
        for s, e, img, vid in row_docs:
            d = ids[r:r + 1, s:e]
            pv, gi = _rows_of(batch["image_grid_thw"], batch["pixel_values"], img)
            pvv, gv = _rows_of(batch["video_grid_thw"], batch["pixel_values_videos"], vid)
            secs = batch["second_per_grid_ts"]
            extra = {} if secs is None or not vid else {"second_per_grid_ts": secs[vid]}
            out = model(input_ids=d, pixel_values=pv, image_grid_thw=gi, pixel_values_videos=pvv, video_grid_thw=gv,
                        mm_token_type_ids=token_types(model.config, d), use_cache=False, **extra)
            logits[r, s:e] = out.logits[0]
            total = total + torch.nn.functional.cross_entropy(out.logits[0].float(), tgt[r, s:e], ignore_index=-100,
                                                              reduction="sum")
    return logits, total


def vision_cost(worlds=(2, 4, 8), frames: int = 32, side: int = 16, repeat: int = 3) -> list[dict]:
    """The two vision strategies on one process, per sp size: patch rows a rank encodes and the slowest rank's
    encode forward + backward time (min of ``repeat``), for a row of text + a video of ``frames`` frames of
    ``side`` x ``side`` patches + 4 images, cut by zigzag. Run: python -m tests.vlm_models (docs/vlm.md)."""
    import time
    from easy_context import prepare_seq_parallel_inputs
    import transformers as tf
    cfg = make_config("qwen2_5_vl")
    cfg.vision_config.depth, cfg.vision_config.hidden_size, cfg.vision_config.intermediate_size = 4, 128, 256
    torch.manual_seed(0)
    model = tf.Qwen2_5_VLForConditionalGeneration(cfg).float()
    doc = [("t", 16), ("vid", (frames, side, side))] + [x for _ in range(4) for x in (("t", 8), ("img", (side, side)))]
    batch = make_rows("qwen2_5_vl", [[doc]])
    n = batch["input_ids"].shape[1]
    length = n + (-n % 64)
    batch = make_rows("qwen2_5_vl", [[doc]], pad_to=length)
    out = []
    for world in worlds:
        for strategy in ("local", "all"):
            rows, secs = [], []
            for rank in range(world):
                p = prepare_seq_parallel_inputs("zigzag_ring_attn", batch["input_ids"], batch["position_ids"], None,
                                                rank, world, "cpu", model=model, vision=strategy,
                                                **{k: batch[k] for k in ("pixel_values", "image_grid_thw",
                                                                         "pixel_values_videos", "video_grid_thw")})
                shard = p.model_kwargs["sp_vision"]
                rows.append(sum(m.pixels.shape[0] for m in (shard.image, shard.video) if m is not None))
                best = float("inf")
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    enc = shard.encoder_outputs(model.model)
                    sum(v.pooler_output[0].sum() for v in enc.values()).backward()
                    best = min(best, time.perf_counter() - t0)
                secs.append(best)
            out.append(dict(world=world, strategy=strategy, tokens=length, rows_max=max(rows),
                            rows_total=int(batch["pixel_values_videos"].shape[0] + batch["pixel_values"].shape[0]),
                            slowest_s=max(secs)))
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    for r in vision_cost():
        print(r)
