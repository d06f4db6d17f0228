"""Model, tokenizer and RoPE theta: hub names and local paths, transformers 5 config layout."""
from __future__ import annotations

import os

from .errors import UsageError


def set_rope_theta(config, theta: float) -> None:
    """transformers 5 keeps theta in ``config.rope_parameters["rope_theta"]``; older configs in ``rope_theta``."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = float(theta)
    if hasattr(config, "rope_theta") or not isinstance(rp, dict):
        config.rope_theta = float(theta)


def get_rope_theta(config) -> float:
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(config.rope_theta)


def load_config(name: str, rope_theta: float | None):
    """The model's config; ``rope_theta`` None keeps the model's own theta (Llama-3 5e5, Qwen 1e6, ...)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        hint = (" (if a local directory was meant: no such directory)" if "/" in name and not os.path.isdir(name)
                else "")
        raise UsageError(f"cannot load model {name!r}{hint}: {str(e).splitlines()[0]}") from None
    if rope_theta is not None:
        set_rope_theta(config, rope_theta)
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None  # full attention over the whole sequence (Mistral-style configs)
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


def apply_memory_options(model, args) -> None:
    """--checkpointing / --tiled-mlp / --fused-ops (--chunked-loss acts in the loss)."""
    from easy_context.memory import configure_memory
    from easy_context.ops import apply_fused_ops

    try:
        configure_memory(model, checkpointing=args.checkpointing, offload_every_k=args.offload_every_k,
                         tiled_mlp=args.tiled_mlp)
        if args.fused_ops:  # after configure_memory, which resets the norms it manages
            apply_fused_ops(model)
    except ValueError as e:
        raise UsageError(str(e)) from None


def save_final_model(accelerator, model, tokenizer, out_dir: str, rope_theta: float, seq_length: int = 0) -> None:
    """HF safetensors + tokenizer + config with ``rope_theta`` and ``max_position_embeddings`` at least the
    trained length; files appear atomically, config.json last."""
    import copy
    import shutil

    from .checkpoint import replace_dir_contents

    state_dict = accelerator.get_state_dict(model)  # ZeRO-3: gathers the full weights on rank 0
    if accelerator.is_main_process:
        tmp = os.path.join(out_dir, ".final.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        config = copy.deepcopy(unwrapped.config)
        set_rope_theta(config, rope_theta)
        if seq_length > getattr(config, "max_position_embeddings", 0):
            config.max_position_embeddings = seq_length  # the length it was trained at (evals read it)
        config.use_cache = True
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        config._attn_implementation_internal = None
        config.save_pretrained(tmp)  # overwrite: the training attention hook is not part of the model
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_dir_contents(tmp, out_dir, last="config.json")
    accelerator.wait_for_everyone()
