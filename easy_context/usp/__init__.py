"""usp_attn: Ulysses (all-to-all) x zigzag ring hybrid sequence parallelism."""
from .._lazy import lazy_attrs

__getattr__ = lazy_attrs(__name__, dict.fromkeys(("UspAttnFunc", "usp_attn", "usp_backward", "usp_forward"),
                                                 ".attention"))


def usp_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, ring_group=None, ulysses_group=None,
                  docs=None, sinks=None):
    """USP attention on local shards ``(batch, seq_local, heads, head_dim)`` in usp/cut.py's order.

    ``ulysses_group`` (U ranks, consecutive sp ranks) does the head all-to-all; ``ring_group`` (R ranks,
    stride U) runs the zigzag ring; both None = a ring over the world (U = 1). Build both once with
    ``ParallelLayout.build("usp_attn", ring_degree=R)``. Only ``causal=True``, ``dropout_p=0``.
    ``docs``: packed documents of the whole sequence (``easy_context.packing``), causal within each one.
    ``sinks``: (heads,) attention-sink logits (gpt-oss), sharded with the heads over the Ulysses group.
    """
    from .attention import usp_attn
    return usp_attn(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                    ring_group=ring_group, ulysses_group=ulysses_group, docs=docs, sinks=sinks)


__all__ = ["usp_attn_func", "usp_forward", "usp_backward", "UspAttnFunc"]


usp_attn_func.supports_attention_cache = True  # lean selective checkpointing (memory/selective.py)
