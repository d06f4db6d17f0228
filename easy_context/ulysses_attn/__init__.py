"""ulysses_attn: head-parallel attention over contiguous sequence shards (DeepSpeed-Ulysses)."""
from .._lazy import lazy_attrs

__getattr__ = lazy_attrs(__name__, dict.fromkeys(
    ("UlyssesAttnFunc", "largest_valid_degree", "ulysses_attn", "ulysses_backward", "ulysses_forward"), ".attention"))


def ulysses_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, group=None, docs=None, sinks=None):
    """Ulysses attention on local contiguous shards ``(batch, seq_local, heads, head_dim)``.

    Rank r of ``group`` (None = world) holds tokens [r*S/W, (r+1)*S/W). k/v may have fewer heads (GQA);
    when the group is larger than the kv-head count the kv heads are replicated just enough. q heads must
    be divisible by the group size (ValueError names the largest valid size). ``causal=False`` is
    supported (full attention on the gathered sequence). Differentiable; dropout is not supported.
    ``docs``: packed documents of the whole sequence (``easy_context.packing``), causal within each one.
    ``sinks``: (heads,) attention-sink logits (gpt-oss), sharded with the heads.
    """
    from .attention import ulysses_attn
    return ulysses_attn(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, group=group,
                        docs=docs, sinks=sinks)


__all__ = ["ulysses_attn_func", "ulysses_forward", "ulysses_backward", "UlyssesAttnFunc", "largest_valid_degree"]


ulysses_attn_func.supports_attention_cache = True  # lean selective checkpointing (memory/selective.py)
