"""What ``enable_sequence_parallel`` takes, and the Trainer settings that would silently break exactness under sequence
parallelism (checked on every rank from local facts only, before the first collective)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..memory import CHECKPOINTING
from ..registry import DEFAULT_MODE, get_mode, mode_names


@dataclass
class SeqParallelOptions:
    """mode: one of ``easy_context.SEQ_ALGOS``. sp_size: ranks sharing one sequence (default: all; the rest is data
    parallel). ring_degree: usp_attn's ring size (ring x ulysses = sp).
    Memory (the same switches as train.py's flags): chunked_loss (LM head + loss in token chunks, no full logits),
    checkpointing (None: leave it to ``TrainingArguments.gradient_checkpointing``; else one of
    ``easy_context.memory.CHECKPOINTING``, e.g. "offload"), offload_every_k, tiled_mlp, fused_ops (lean RMSNorm +
    fused RoPE), head_chunks (attention blocks in head groups, backward one group at a time: memory/head_chunks.py;
    under ZeRO-3 each block gathers its own parameters), attn_backend (e.g. "fa4", "cudnn"; sets
    ``EASY_CONTEXT_ATTN_BACKEND`` for this process).
    pad_to_multiple: append a filler document to rows the layout cannot cut (else such a batch is an error)."""
    mode: str = DEFAULT_MODE
    sp_size: int | None = None
    ring_degree: int | None = None
    chunked_loss: bool = False
    checkpointing: str | None = None
    offload_every_k: int = 1
    tiled_mlp: bool | int | str = False
    fused_ops: bool = False
    head_chunks: int = 1
    attn_backend: str | None = None
    pad_to_multiple: bool = True

    @classmethod
    def from_kwargs(cls, **kw) -> "SeqParallelOptions":
        names = {f.name for f in fields(cls)}
        bad = sorted(set(kw) - names)
        if bad:
            raise TypeError(f"enable_sequence_parallel got unknown options {bad}; known: {sorted(names)}")
        return cls(**kw)

    def validate(self) -> None:
        from ..kernels import BACKENDS
        if self.mode not in mode_names():
            raise ValueError(f"mode={self.mode!r} is not a sequence-parallel mode; choose one of {mode_names()}")
        if self.checkpointing is not None and self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing={self.checkpointing!r}: choose one of {CHECKPOINTING} (or None to leave "
                             "it to TrainingArguments.gradient_checkpointing)")
        if not isinstance(self.head_chunks, int) or self.head_chunks < 1:
            raise ValueError(f"head_chunks={self.head_chunks!r}: must be an int >= 1")
        if self.head_chunks > 1 and not get_mode(self.mode).supports_attention_cache:
            raise ValueError(f"head_chunks={self.head_chunks} needs a sequence-parallel mode's attention (mode="
                             f"{self.mode!r} runs the model's own): use head_chunks=1 or another mode")
        if self.attn_backend not in (None, "auto") + tuple(BACKENDS):
            raise ValueError(f"attn_backend={self.attn_backend!r}: choose one of {BACKENDS} or None")


def _padding_collator(collator) -> str | None:
    """The name of a collator known to pad rows without marking documents (None if not one of them)."""
    try:
        import transformers
        padding = (transformers.DataCollatorWithPadding, transformers.DataCollatorForLanguageModeling,
                   transformers.DataCollatorForSeq2Seq)
    except ImportError:  # pragma: no cover
        padding = ()
    if isinstance(collator, padding):
        return f"transformers.{type(collator).__name__}"
    if type(collator).__module__.startswith("trl.") and hasattr(collator, "padding_free") \
            and not collator.padding_free:
        return f"trl {type(collator).__name__}(padding_free=False)"
    return None


def check_trainer(trainer, opts: SeqParallelOptions) -> None:
    """Trainer settings that sequence parallelism cannot honour exactly: ValueError naming the setting and the fix."""
    import torch
    args = trainer.args
    where = "sequence parallelism (easy_context.integrations)"
    strategy = getattr(args, "train_sampling_strategy", None)
    if getattr(args, "group_by_length", False) or strategy in ("group_by_length", "batch_rebalance"):
        raise ValueError(f"{where}: TrainingArguments train_sampling_strategy/group_by_length="
                         f"{strategy or 'group_by_length'} reorders or regroups rows per rank; the ranks of a sequence-"
                         "parallel group must read the same rows. Use the default random sampling (pack rows instead)")
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"{where}: {args.n_gpu} GPUs in one process (torch DataParallel) is not supported; launch "
                         "one process per GPU (accelerate launch / torchrun)")
    acc_cfg = getattr(args, "accelerator_config", None)
    if acc_cfg is not None and (getattr(acc_cfg, "split_batches", False) or getattr(acc_cfg, "dispatch_batches", None)):
        raise ValueError(f"{where}: accelerator_config split_batches/dispatch_batches cut batches across all ranks; "
                         "leave them off (each data-parallel group reads its own batches)")
    pc = getattr(args, "parallelism_config", None)
    if pc is not None and (getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)):
        raise ValueError(f"{where}: TrainingArguments parallelism_config already enables context/sequence "
                         "parallelism (DeepSpeed ALST / torch CP); use one or the other")
    for name in ("train_dataset", "eval_dataset"):
        ds = getattr(trainer, name, None)
        dss = ds.values() if isinstance(ds, dict) else [ds]
        if any(isinstance(d, torch.utils.data.IterableDataset) for d in dss if d is not None):
            raise ValueError(f"{where}: {name} is an IterableDataset; the data-parallel sharding needs a map-style "
                             "dataset (datasets.Dataset, not streaming)")
    bad = _padding_collator(trainer.data_collator)
    if bad and (args.per_device_train_batch_size > 1 or getattr(trainer.data_collator, "pad_to_multiple_of", None)):
        raise ValueError(f"{where}: data_collator {bad} pads rows (per_device_train_batch_size="
                         f"{args.per_device_train_batch_size}) without position_ids; {_fix()}")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError(f"{where}: compute_loss_func is set; the loss is computed here (token-weighted across ranks). "
                         "Drop compute_loss_func")
    if getattr(args, "label_smoothing_factor", 0):
        raise ValueError(f"{where}: label_smoothing_factor={args.label_smoothing_factor} is not supported (the loss "
                         "is the token NLL); set it to 0")
    if getattr(trainer, "compute_metrics", None) is not None and not args.prediction_loss_only:
        raise ValueError(f"{where}: compute_metrics needs full logits, but each rank holds a slice of the sequence; "
                         "drop compute_metrics or set prediction_loss_only=True (eval_loss is exact)")
    if opts.checkpointing not in (None, "none") and args.gradient_checkpointing:
        raise ValueError(f"{where}: checkpointing={opts.checkpointing!r} and TrainingArguments.gradient_checkpointing="
                         "True both set activation checkpointing; keep one")
    if getattr(args, "loss_type", "nll") not in ("nll", None):  # trl SFTConfig
        raise ValueError(f"{where}: {type(args).__name__} loss_type={args.loss_type!r} is not supported with "
                         f"{type(trainer).__name__}; use 'nll'")


def _fix() -> str:
    from .batches import PADDING_FIX
    return PADDING_FIX
