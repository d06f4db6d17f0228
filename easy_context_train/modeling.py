"""Model, tokenizer and RoPE theta: hub names and local paths, transformers 5 config layout."""
from __future__ import annotations

import os

from easy_context.hf.config import (LLAMA3_FREQ_FACTORS, ROPE_SCALINGS, check_rope_for_sp, get_rope_theta,  # noqa: F401
                         set_rope_scaling, set_rope_theta)  # training's and eval's one definition (re-exported)
from .errors import UsageError


def load_config(name: str, rope_theta: float | None, args=None):
    """The model's config; ``rope_theta`` None keeps the model's own theta (Llama-3 5e5, Qwen 1e6, ...);
    ``args`` (train.py's): --rope-scaling applied and RoPE types refused under sp modes where not exact."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        hint = (" (if a local directory was meant: no such directory)" if "/" in name and not os.path.isdir(name)
                else "")
        raise UsageError(f"cannot load model {name!r}{hint}: {str(e).splitlines()[0]}") from None
    from easy_context.tools.check.config import missing_fields
    problem = missing_fields(config, name)  # a missing width / heads / vocab: one line, not transformers' default
    if problem:
        raise UsageError(problem)
    if rope_theta is not None:
        set_rope_theta(config, rope_theta)
    if args is not None and args.rope_scaling:
        set_rope_scaling(config, args.rope_scaling, args.rope_factor, args.rope_original_max_positions)
    if args is not None:
        check_rope_for_sp(config, args.parallel_mode)
    if args is not None and args.no_sliding_window and getattr(config, "sliding_window", None) is not None:
        # asked for: full attention over the whole sequence (saved so). Models with per-layer types (Gemma 3)
        # keep them (their local layers' RoPE differs) with a window longer than any sequence.
        config.sliding_window = None if getattr(config, "layer_types", None) is None else 2 ** 31 - 1
    return config


def load_model(name: str, config, dtype):
    """Every rank loads the weights on CPU; DeepSpeed/Accelerate move and partition them at prepare."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def load_tokenizer(name: str):
    """The model's tokenizer if it has one (saved next to the final model), else None."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception:  # noqa: BLE001 - a model without a tokenizer still trains
        return None


def count_params(model) -> int:
    """Parameter count, also for ZeRO-3 partitioned parameters (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def no_decay_names(model) -> set:
    """Names of parameters that get no weight decay: biases, norm weights, embeddings (and a tied head)."""
    import torch

    skip = set()
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for mname, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower() or isinstance(module, torch.nn.LayerNorm)
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if pname == "bias" or is_norm or id(p) in emb_ids or p.dim() < 2:
                skip.add(full)
    return skip


def apply_memory_options(model, args, layout=None, accelerator=None):
    """--checkpointing / --tiled-mlp / --fused-ops (--chunked-loss acts in the loss). ``--checkpointing auto`` needs
    the ``layout`` (local tokens per rank) and the ``accelerator`` (budgets agreed over all ranks: collective on
    every rank; easy_context_train/auto_checkpointing.py) and returns its CheckpointChoice; otherwise None."""
    from easy_context.memory import configure_memory
    from easy_context.ops import apply_fused_ops

    from .auto_checkpointing import apply_auto_checkpointing
    choice = None
    heads = getattr(args, "head_chunks", None)
    try:
        if args.checkpointing == "auto":
            choice = apply_auto_checkpointing(model, args, layout, accelerator,
                                              heads if heads is not None else "auto")
        else:
            configure_memory(model, checkpointing=args.checkpointing, tiled_mlp=args.tiled_mlp,
                             offload_every_k=1 if args.offload_every_k is None else args.offload_every_k,
                             head_chunks=heads or 1, recurrent_tiles=getattr(args, "recurrent_tiles", None) or 1)
        if args.fused_ops:  # after configure_memory, which resets the norms it manages
            apply_fused_ops(model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return choice


def final_config(config, rope_theta: float, seq_length: int):
    """The config saved with the final model: ``rope_theta``, ``max_position_embeddings`` at least the trained
    length, no training attention hook (the SP attention name is not part of the model)."""
    import copy

    config = copy.deepcopy(config)
    set_rope_theta(config, rope_theta)
    dynamic = (getattr(config, "rope_parameters", None) or {}).get("rope_type") == "dynamic"
    if seq_length > getattr(config, "max_position_embeddings", 0) and not dynamic:  # dynamic: it is the base
        config.max_position_embeddings = seq_length  # the length it was trained at (evals read it)
    config.use_cache = True
    config._attn_implementation_internal = None
    return config


def save_final_model(accelerator, model, tokenizer, out_dir: str, rope_theta: float, seq_length: int = 0) -> None:
    """HF safetensors + tokenizer + config with ``rope_theta`` and ``max_position_embeddings`` at least the
    trained length; files appear atomically, config.json last."""
    from .checkpoint import write_final

    state_dict = accelerator.get_state_dict(model)  # ZeRO-3: gathers the full weights on rank 0 (every rank calls it)

    def write(tmp):
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        final_config(unwrapped.config, rope_theta, seq_length).save_pretrained(tmp)  # overwrites the one above
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    need = sum(t.numel() * t.element_size() for t in (state_dict or {}).values())
    write_final(accelerator, out_dir, write, last="config.json", need=need)  # disk full: every rank raises (74)
