"""Shape and dtype checks of q, k, v in the flash-attn layout, shared by the facade, the reference and every
sequence-parallel mode."""
from __future__ import annotations

import torch


def check_qkv(q, k, v, what: str = "attention", local: bool = False, causal: bool = False) -> None:
    """Shape/dtype checks of q, k, v in the flash-attn layout, shared by the facade and every
    sequence-parallel mode. ``local=True``: the shards of one rank (q and k/v also share the local length);
    ``causal=True`` (facade): a causal block needs equal q and kv lengths. Raises ValueError with the fix."""
    seq = "seq_local" if local else "seq"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{what} expects q, k, v shaped (batch, {seq}, heads, head_dim); "
                             f"got {name} with shape {tuple(getattr(t, 'shape', ()))}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if local and (q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]):
        raise ValueError(f"{what}: q and k/v must agree on batch, local length and head_dim; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{what}: q and k must agree on batch and head_dim; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{what}: q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]}) for "
                         "grouped-query attention")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"{what}: causal=True needs equal q and kv lengths (got {q.shape[1]} and {k.shape[1]}); "
                         "pass causal=False for an off-diagonal block")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


__all__ = ["check_qkv"]
