"""ulysses_attn's cut: contiguous, rank r holds chunk r of W (the all-to-all regathers the sequence per head group)."""
from ..contiguous import seq_multiple, shard, signature, unshard  # noqa: F401
