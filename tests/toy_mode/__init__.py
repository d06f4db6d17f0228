"""toy_ring: a mode added from outside easy_context (tests/test_modes.py), as a user would add one.

One package (this folder: a cut in layout.py, a Mode in mode.py, an attention here) plus one line,
``easy_context.registry.register_mode("tests.toy_mode.mode:ToyRingMode")``. Its cut is a second copy of the
contiguous cut (rank r holds chunk r of W) and its attention is a ring over that cut (LightSeq's, borrowed from
``easy_context.dist_flash_attn``), so every result must equal the single-process model's.
"""


def toy_ring_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, group=None, docs=None):
    """(B, S_local, H, D) contiguous shards in, local output out."""
    from easy_context.dist_flash_attn import dist_flash_attn_func
    return dist_flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                group=group, docs=docs)
