"""LoRA through ``peft`` (--lora-rank / --lora-alpha / --lora-targets / --lora-train-embeddings-norms / --merge-lora).

Order matters: the sequence-parallel attention, activation checkpointing and fused ops are attached to the base
model first (they act on attention / layer / norm modules, which PEFT keeps: it only swaps the targeted Linear
layers for ``lora.Linear`` wrappers inside them, and the SP attention is selected by the config's attention
name, which the wrapped model still reads). Then ``get_peft_model`` freezes the base; the optimizer sees only
the trainable parameters. Adapter dropout is 0: a dropout mask would differ between an sp layout and one
process, and the loss would no longer be the same function of the weights.

Final save (ZeRO-3 safe: from the gathered state dict, never from the partitioned modules): the adapter
(adapter_model.safetensors + adapter_config.json) in OUTPUT_DIR; with --merge-lora the merged full model in
OUTPUT_DIR (a plain HF model the evals read) and the adapter in OUTPUT_DIR/adapter (next to a config.json,
transformers would load the base from adapter_config.json and apply the adapter twice).
"""
from __future__ import annotations

import os

from .errors import UsageError

PREFIX = "base_model.model."  # PeftModelForCausalLM -> the base model's parameter names


def norm_and_embedding_names(model) -> list[str]:
    """Leaf names of the input embedding and every norm module (PEFT's modules_to_save matches by suffix)."""
    import torch

    emb = model.get_input_embeddings()
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is emb}
    names |= {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
              if n and ("norm" in type(m).__name__.lower() or isinstance(m, torch.nn.LayerNorm))}
    return sorted(names)


def apply_lora(model, args):
    """Wrap ``model`` in a PeftModel when --lora-rank > 0 (else return it unchanged)."""
    if not args.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    cfg = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank, lora_dropout=0.0,
                     target_modules=targets, bias="none", task_type="CAUSAL_LM",
                     modules_to_save=norm_and_embedding_names(model) if args.lora_train_embeddings_norms else None)
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:  # e.g. a target name the model does not have
        raise UsageError(f"--lora-targets {args.lora_targets!r}: {str(e).splitlines()[0]}") from None


def merged_state_dict(state_dict: dict, lora_cfg, adapter: str = "default") -> dict:
    """The base model's state dict with every adapter folded in: W + (B @ A) * alpha / r (fp32 math, saved in
    W's dtype); modules_to_save copies replace their originals; LoRA tensors dropped."""
    import math

    scale = lora_cfg.lora_alpha / (math.sqrt(lora_cfg.r) if lora_cfg.use_rslora else lora_cfg.r)
    out = {}
    for key, w in state_dict.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".base_layer." in name:
            stem = key.rsplit(".base_layer.", 1)[0]
            a, b = state_dict.get(f"{stem}.lora_A.{adapter}.weight"), state_dict.get(f"{stem}.lora_B.{adapter}.weight")
            if name.endswith(".base_layer.weight") and a is not None:
                w = (w.float() + (b.float() @ a.float()) * scale).to(w.dtype)
            name = name.replace(".base_layer.", ".")
        name = name.replace(f".modules_to_save.{adapter}.", ".")
        out[name] = w
    return out


def save_lora(accelerator, model, tokenizer, args) -> None:
    """Adapter (+ merged model with --merge-lora) + tokenizer; files appear atomically, the config last."""
    from .checkpoint import write_final
    from .modeling import final_config

    state_dict = accelerator.get_state_dict(model)  # ZeRO-3: gathers the full weights on rank 0 (every rank calls it)

    def write(tmp):
        peft_model = accelerator.unwrap_model(model)
        adapter_dir = os.path.join(tmp, "adapter") if args.merge_lora else tmp
        peft_model.save_pretrained(adapter_dir, state_dict=state_dict, safe_serialization=True)
        if args.merge_lora:
            base = peft_model.get_base_model()
            merged = merged_state_dict(state_dict, peft_model.peft_config["default"])
            base.save_pretrained(tmp, state_dict=merged, safe_serialization=True)
            final_config(base.config, args.save_rope_theta, args.seq_length).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    write_final(accelerator, args.output_dir, write, last="config.json" if args.merge_lora else "adapter_config.json")
