"""``configure_memory``: one call that sets a causal LM's memory options (checkpointing, offload, tiled MLP, selective
layers, lean norms, head groups); ``memory/__init__`` re-exports it."""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.lean_norm import apply_lean_norms, remove_lean_norms  # memory -> ops, never back
from .head_chunks import apply_head_chunks, remove_head_chunks
from .offload import CheckpointOffload, enable_checkpoint_offload
from .tiled_mlp import apply_tiled_mlp, untile_mlp
from ..recurrent.patch import set_tiles

CHECKPOINTING = ("none", "layer", "selective", "offload", "nested")


@dataclass
class MemoryConfig:
    checkpointing: str
    offload_every_k: int
    tiled_mlp: int | str | bool
    selective: bool = False
    lean_norm: bool = False
    offload: CheckpointOffload | None = None
    selective_layers: tuple[int, ...] | None = None
    keep_nested_attention: bool = False
    head_chunks: int = 1
    recurrent_tiles: int = 1


def _undo(model):
    from transformers.modeling_layers import GradientCheckpointingLayer
    from .selective import disable_selective_checkpointing, is_selective
    if is_selective(model):
        disable_selective_checkpointing(model)
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer) and hasattr(m, "mlp"):
            untile_mlp(m.mlp)
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        # transformers >= 5.24 renamed gradient_* to activation_checkpointing_*; 5.17 has only the old name
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    remove_lean_norms(model)
    remove_head_chunks(model)
    model.__dict__.pop("_easy_context_offload", None)


def configure_memory(model, checkpointing: str = "layer", offload_every_k: int = 1,
                     tiled_mlp: bool | int | str = False, selective: bool = False,
                     lean_norm: bool = False, selective_layers=None,
                     keep_nested_attention: bool = True, head_chunks: int = 1,
                     recurrent_tiles: int = 1) -> MemoryConfig:
    """Set the memory options of a transformers causal LM (call again to change them; idempotent).

    checkpointing: ``"none"``; ``"layer"`` (HF per-layer, non-reentrant); ``"selective"`` (keep attention
      output + LSE, recompute the rest); ``"offload"`` (per-layer, kept inputs in pinned host memory, one
      kept per ``offload_every_k`` layers); ``"nested"`` (like offload but kept on the GPU, one per k layers).
    tiled_mlp: False, True/"auto" (tiles of ~hidden_size tokens, ALST's default) or a number of tiles.
    selective: also keep attention outputs over the chosen checkpointing (no attention recompute: faster,
      but +out/LSE per layer on the GPU); ``checkpointing="selective"`` is ``"layer"`` with this on.
    selective_layers: with selective, only these decoder layer indices keep their attention output (None = all).
    keep_nested_attention: with ``offload_every_k > 1``, an inner layer of a nested group keeps the attention
      output + LSE its group's rebuild computes until its own backward (transient: (k - 1) outputs per group at a
      time), so its attention is recomputed once, not twice. Lean attentions (the modes' own) only.
    lean_norm: RMSNorms keep their input + fp32 inverse RMS, not fp32 upcasts, and run as one fused kernel
      each way on CUDA (easy_context.ops.rms_norm; Llama/Mistral/Qwen2/Qwen3 norms). Fused RoPE is
      ``easy_context.ops.apply_fused_ops``.
    head_chunks: run each attention block (projections, RoPE, attention, o_proj) in this many head groups, its
      backward one group at a time: one group's q/k/v/out/dq/dk/dv at the peak instead of all heads' (7B on an
      H200 with offload: 96.6 -> 56.6 KB/token with 8 groups, 0.96x the speed at 128K). Exact. Needs a mode's
      attention (apply_seq_parallel_monkey_patch, any mode, sp = 1 too), plain q/k/v/o Linears, a divisor of the
      kv heads; under ZeRO-3 each block gathers its own parameters (memory/head_chunks.py).
    recurrent_tiles: a hybrid's recurrent layers (gated DeltaNet, short conv, Mamba-2) run their sequence in this
      many tiles one after another, the forward keeping only the layer input and each tile's incoming state, the
      backward recomputing one tile at a time: one tile's working set at the peak instead of the whole sequence's
      (one more forward of those layers). Exact. One process (sp = 1) with the patch applied (any mode).
    The chunked loss is not a model setting: compute the loss with ``causal_lm_loss``.
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    if int(offload_every_k) < 1:
        raise ValueError(f"offload_every_k must be >= 1, got {offload_every_k}")
    for name, n in (("head_chunks", head_chunks), ("recurrent_tiles", recurrent_tiles)):
        if int(n) < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    if selective_layers is not None and not (checkpointing == "selective" or selective):
        raise ValueError("selective_layers needs selective=True (or checkpointing='selective')")
    _undo(model)
    mgr = None
    if checkpointing == "none" and selective:
        raise ValueError("selective=True needs checkpointing (layer, offload or nested)")
    if checkpointing == "layer":
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if checkpointing in ("offload", "nested"):
        mgr = enable_checkpoint_offload(model, offload=checkpointing == "offload", every_k=offload_every_k)
    nested = keep_nested_attention and checkpointing in ("offload", "nested") and int(offload_every_k) > 1
    if checkpointing == "selective" or selective or nested:
        # wraps whichever checkpoint function the layers now have (HF's, or our offload/nested one)
        from .selective import enable_selective_checkpointing
        chosen = selective_layers if (checkpointing == "selective" or selective) else []
        enable_selective_checkpointing(model, layers=chosen, nested_others=nested)
    if tiled_mlp:
        apply_tiled_mlp(model, "auto" if tiled_mlp is True else tiled_mlp)
    if lean_norm:
        apply_lean_norms(model)
    if int(head_chunks) > 1:
        apply_head_chunks(model, int(head_chunks))
    set_tiles(model, int(recurrent_tiles))
    return MemoryConfig(checkpointing, int(offload_every_k), tiled_mlp, bool(selective), bool(lean_norm), mgr,
                        None if selective_layers is None else tuple(int(i) for i in selective_layers), nested,
                        int(head_chunks), int(recurrent_tiles))


__all__ = ["configure_memory", "MemoryConfig", "CHECKPOINTING"]
