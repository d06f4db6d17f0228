"""dist_flash_attn: LightSeq / DistFlashAttn load-balanced causal attention over the contiguous layout.

    out = dist_flash_attn_func(q, k, v, causal=True, group=sp_group)   # (B, S/W, H, D) local shards

Rank r holds contiguous chunk r (``shard_sequence("dist_flash_attn", x, r, W)``). W must be even (or 1).
See ``schedule.py`` for the helper schedule and ``easy_context/memory/selective.py`` for the
rematerialisation-aware checkpointing this mode was designed with.
"""
from .._lazy import lazy_attrs

__getattr__ = lazy_attrs(__name__, {
    **dict.fromkeys(("DistFlashAttnFunc", "check_inputs", "dist_flash_attn", "dist_flash_attn_backward",
                     "dist_flash_attn_forward"), ".attention"),
    **dict.fromkeys(("Block", "block_plan", "num_steps", "work_counts"), ".schedule")})


def dist_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, group=None, docs=None, sinks=None):
    """flash_attn_func-style entry: local (B, S_local, H, D) shards in, local output out (GQA k/v allowed).

    Differentiable; runs under ``torch.inference_mode()``/``no_grad`` as a plain forward. ``group=None``
    is the world group. Raises ValueError (before any communication) for causal=False, dropout, odd W
    or mismatched shapes. ``docs``: packed documents of the whole sequence (``easy_context.packing``).
    ``sinks``: (heads,) attention-sink logits (gpt-oss), joining every row's softmax denominator.
    """
    from .attention import check_inputs, dist_flash_attn
    check_inputs(q, k, v, dropout_p, causal, group)
    return dist_flash_attn(q, k, v, softmax_scale, group, docs=docs, sinks=sinks)


# Selective checkpointing may keep only (out, lse) of this attention and replay them in recomputation.
dist_flash_attn_func.supports_attention_cache = True

__all__ = ["dist_flash_attn_func", "dist_flash_attn", "dist_flash_attn_forward", "dist_flash_attn_backward",
           "DistFlashAttnFunc", "Block", "block_plan", "num_steps", "work_counts", "check_inputs"]
