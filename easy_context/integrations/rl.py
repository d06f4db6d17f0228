"""``trl.DPOTrainer`` and ``trl.GRPOTrainer`` under sequence parallelism (docs/trainer.md).

The trainers keep everything they own: the data (each rank reads its own rows, as plain data parallelism over all
ranks does), GRPO's generation (HF ``generate`` runs the model's own attention on whole sequences; vLLM is untouched)
and rewards, the reference model, the loss, its gradient-accumulation scaling and the metrics. What changes is the
one call both make to score tokens, ``model(..., fused_lm_head=True)``, on the policy and on the reference model
(a separate model, or the policy with its PEFT adapter disabled: the same wrapped call): it runs sequence-parallel
(``seq_logprobs.py``). Settings that call the model any other way are refused here, before training.
"""
from __future__ import annotations

KINDS = {"DPOTrainer": "dpo", "GRPOTrainer": "grpo"}
WHERE = "sequence parallelism (easy_context.integrations)"


def base_model(model):
    """The transformers PreTrainedModel under PEFT / Accelerate wrappers."""
    for _ in range(4):
        if hasattr(model, "get_base_model"):  # PeftModel
            model = model.get_base_model()
        elif hasattr(model, "module"):  # DDP / DeepSpeed engine
            model = model.module
        else:
            break
    return model


def rl_kind(trainer) -> str | None:
    """"dpo" / "grpo" for TRL's DPOTrainer / GRPOTrainer (and subclasses), None for transformers.Trainer and
    trl.SFTTrainer; a ValueError naming the class for any other TRL trainer."""
    for cls in type(trainer).__mro__:
        if not cls.__module__.startswith("trl."):
            continue
        if cls.__name__ in KINDS:
            return KINDS[cls.__name__]
        if cls.__name__ == "SFTTrainer":
            return None
        raise ValueError(f"{WHERE}: trl {cls.__name__} is not supported; supported trainers are transformers.Trainer "
                         "and trl SFTTrainer, DPOTrainer and GRPOTrainer")
    return None


def check_rl_trainer(trainer, opts, kind: str) -> None:
    """DPO / GRPO settings sequence parallelism cannot run exactly: a one-line ValueError naming the setting."""
    args, name = trainer.args, type(trainer).__name__
    if opts.chunked_loss:
        raise ValueError(f"{WHERE}: chunked_loss=True does not apply to {name}: TRL's fused LM head already scores "
                         "tokens in chunks without (tokens x vocab) logits; drop chunked_loss")
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"{WHERE}: {args.n_gpu} GPUs in one process (torch DataParallel) is not supported; launch "
                         "one process per GPU (accelerate launch / torchrun)")
    pc = getattr(args, "parallelism_config", None)
    if pc is not None and (getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)):
        raise ValueError(f"{WHERE}: TrainingArguments parallelism_config already enables context/sequence "
                         "parallelism; use one or the other")
    if getattr(trainer, "compute_metrics", None) is not None:
        raise ValueError(f"{WHERE}: compute_metrics needs the full logits of every sequence, which no rank holds; "
                         f"drop compute_metrics ({name}'s own metrics are logged)")
    if opts.checkpointing not in (None, "none") and args.gradient_checkpointing:
        raise ValueError(f"{WHERE}: checkpointing={opts.checkpointing!r} and gradient_checkpointing=True both set "
                         "activation checkpointing; keep one")
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(f"{WHERE}: the MoE router auxiliary loss (router_aux_loss_coef="
                         f"{trainer.router_aux_loss_coef}) is not supported with {name}; set router_aux_loss_coef=0")
    if kind == "grpo" and not getattr(trainer, "use_vllm", False) and getattr(trainer, "rollout_func", None) is None:
        from ..recurrent.detect import recurrent_layers
        if recurrent_layers(base_model(trainer.model)):
            raise ValueError(f"{WHERE}: GRPOTrainer's HF generation on a hybrid model would decode through the "
                             "sequence-parallel recurrent layers (no cache there); generate with use_vllm=True or a "
                             "rollout_func")
    if getattr(trainer, "_is_vision_dataset", False) or getattr(trainer, "_is_vlm", False):
        raise ValueError(f"{WHERE}: {name} on image data is not supported (text models only)")


def setup_rl(trainer, kind: str, layout, pad_id: int) -> None:
    """Wrap the fused LM head calls of the policy and of a separate reference model (after the common setup patched
    the policy's attention); the trainer's class and its loss scaling stay as they are."""
    from .. import apply_seq_parallel_monkey_patch
    from .seq_logprobs import wrap_fused_forward
    wrap_fused_forward(base_model(trainer.model), layout, pad_id)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        ref = base_model(ref)
        if layout.mode.is_parallel:
            from ..hf.route import check_routable
            check_routable(ref, layout.mode)
            apply_seq_parallel_monkey_patch(ref, layout)
        wrap_fused_forward(ref, layout, pad_id)
    trainer._ec_rl = kind
