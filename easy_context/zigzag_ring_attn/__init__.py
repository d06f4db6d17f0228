"""zigzag_ring_attn: balanced causal ring attention (schedule and algorithm in attention.py)."""
import math

from .._lazy import lazy_attrs

__getattr__ = lazy_attrs(__name__, {
    **dict.fromkeys(("RingBlock", "Step", "ZigzagRingAttnFunc", "block_plan", "check_inputs", "global_chunks",
                     "ring_steps", "zigzag_ring_backward", "zigzag_ring_forward"), ".attention"),
    **dict.fromkeys(("seq_multiple", "shard", "unshard"), ".layout")})


def zigzag_ring_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, group=None, docs=None,
                          sinks=None):
    """Causal attention of this rank's zigzag shard against the whole sequence held by ``group``.

    q ``(batch, seq_local, heads, head_dim)``, k/v the same with possibly fewer heads (GQA, never expanded
    over the wire); seq_local holds zigzag chunks r and 2W-1-r (``shard_sequence("zigzag_ring_attn", ...)``).
    Differentiable. ``group=None``: the world group (W=1 or no process group: plain causal attention).
    Only ``causal=True`` and ``dropout_p=0`` are supported; the kernel follows ``EASY_CONTEXT_ATTN_BACKEND``.
    ``docs``: packed documents of the whole sequence (``easy_context.packing.documents(global_position_ids)``)
    for causal attention within each document; the HF patch builds it from ``position_ids`` itself. Packed rows
    (a restart at 0) long enough for it are laid out in the balanced k-pair form of zigzag (``docs.pairs(W)``):
    shard them with ``shard_sequence("zigzag_ring_attn", x, rank, W, positions=global_position_ids)``.
    ``sinks``: (heads,) attention-sink logits (gpt-oss), one per q head, joining every row's softmax denominator.
    """
    from .attention import ZigzagRingAttnFunc, check_inputs
    check_inputs(q, k, v, dropout_p, causal)  # before any collective
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    return ZigzagRingAttnFunc.apply(q, k, v, softmax_scale, group, None, docs, sinks)


zigzag_ring_attn_func.supports_attention_cache = True  # lean selective checkpointing (memory/selective.py)


__all__ = ["zigzag_ring_attn_func", "zigzag_ring_forward", "zigzag_ring_backward", "ZigzagRingAttnFunc",
           "block_plan", "RingBlock", "ring_steps", "Step", "global_chunks", "check_inputs", "shard", "unshard",
           "seq_multiple"]
