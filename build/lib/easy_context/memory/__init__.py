"""Memory savers for long-sequence training of HF causal LMs (any sequence-parallel mode, ZeRO-3).

    from easy_context.memory import configure_memory, causal_lm_loss
    configure_memory(model, checkpointing="offload", offload_every_k=1, tiled_mlp=True)
    loss = causal_lm_loss(model, local_input_ids, local_position_ids, local_target_ids, group=sp_group)

* ``chunked_loss``  — LM head + cross-entropy chunk by chunk (no tokens x vocab tensor), token-weighted
                    (``easy_context.loss``; re-exported here).
* ``tiled_mlp``     — each decoder MLP runs over the sequence in tiles, forward and backward (ALST idea).
* ``offload``       — checkpointed layer inputs in pinned host memory with overlapped copies; every-k nesting.
* ``selective``     — keep attention output + LSE, recompute the rest (``enable_selective_checkpointing``).
* ``auto``          — offload k and selective layers chosen from the GPU / host memory there is (auto.py).
* ``head_chunks``   — each attention block's heads in groups, its backward one group at a time (UPipe idea).
* ``norm``          — RMSNorm that keeps its bf16 input + fp32 inverse RMS (fused kernel on CUDA).
All are exact: same loss and gradients as without them (tests/test_memory.py).
"""
from __future__ import annotations

from ..loss import causal_lm_loss, chunked_lm_loss, global_token_count, lm_head_loss
from ..ops.lean_norm import apply_lean_norms, remove_lean_norms  # memory -> ops, never back
from .auto import CheckpointChoice, auto_checkpointing, choose_checkpointing
from .configure import CHECKPOINTING, MemoryConfig, configure_memory
from .head_chunks import apply_head_chunks, head_chunks_of, remove_head_chunks
from .offload import CheckpointOffload, enable_checkpoint_offload
from .tiled_mlp import apply_tiled_mlp, tile_mlp, untile_mlp

__all__ = ["configure_memory", "MemoryConfig", "CHECKPOINTING", "causal_lm_loss", "chunked_lm_loss",
           "lm_head_loss", "global_token_count", "apply_tiled_mlp", "tile_mlp", "untile_mlp",
           "CheckpointOffload", "enable_checkpoint_offload", "CheckpointChoice", "auto_checkpointing",
           "choose_checkpointing", "apply_lean_norms", "remove_lean_norms", "apply_head_chunks",
           "remove_head_chunks", "head_chunks_of"]
