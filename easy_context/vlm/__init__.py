"""Vision-language models under sequence parallelism (docs/vlm.md): Qwen2(.5)-VL, Qwen3-VL (+ MoE), Qwen3.5.

    apply_seq_parallel_monkey_patch("zigzag_ring_attn", vlm)        # the language model's attention; the tower as is
    prepared = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, pos, labels, rank, world, device, model=vlm,
                                           pixel_values=pv, image_grid_thw=ig, pixel_values_videos=pvv,
                                           video_grid_thw=vg)
    vlm(prepared["local_input_ids"], position_ids=prepared["local_position_ids"], **prepared.model_kwargs)

families.py (which VLMs, refused by name otherwise), positions.py (3-D mRoPE of whole rows, per document),
vision.py (what each rank encodes), inputs.py (the cut), patch.py (the model side), batches.py (Trainer batches).
Names are imported on first use (nothing heavy at import)."""
from .._lazy import lazy_attrs

__getattr__ = lazy_attrs(__name__, {
    "is_vlm": ".families", "vlm_family": ".families", "VLM_FAMILIES": ".families",
    "mrope_positions": ".positions", "VisionShard": ".vision", "VISION_KWARG": ".vision",
    "VLMInputs": ".inputs", "VLM_KEYS": ".inputs",
})

__all__ = ["is_vlm", "vlm_family", "VLM_FAMILIES", "mrope_positions", "VisionShard", "VISION_KWARG", "VLMInputs",
           "VLM_KEYS"]
