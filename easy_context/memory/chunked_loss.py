"""Chunked LM head + cross-entropy (never a tokens x vocab tensor): lives in ``easy_context.loss``; these names
stay importable from here."""
from ..loss import (ChunkedLMLoss, causal_lm_loss, chunked_lm_loss, default_chunk_size, global_token_count,
                    head_as_loss, lm_head_loss)

__all__ = ["ChunkedLMLoss", "chunked_lm_loss", "head_as_loss", "lm_head_loss", "causal_lm_loss", "global_token_count",
           "default_chunk_size"]
