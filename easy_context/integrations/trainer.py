"""Sequence parallelism inside ``transformers.Trainer`` and ``trl.SFTTrainer``: the model patched with a
``ParallelLayout``, the data sharded as train.py shards it, the loss token-weighted as train.py weights it; the
Trainer's own loop (gradient accumulation, clipping, logging, evaluation, checkpoints, resume, DeepSpeed / FSDP,
PEFT) is left as it is.

    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, ...)   # or Trainer(...)
    enable_sequence_parallel(trainer, mode="zigzag_ring_attn", chunked_loss=True)
    trainer.train()

How each piece maps onto the Trainer (the method overridden, on an SP subclass of the trainer's own class):

* data (``get_train_dataloader`` / ``get_eval_dataloader``): the Trainer's loader, prepared by Accelerate for all W
  ranks, is re-pointed at the dp coordinates (its ``BatchSamplerShard`` takes num_processes=dp, process_index=
  dp_rank, as the Trainer itself does for its rank-aware samplers): the ranks of one sp group read the same rows
  in the same seeded order, dp groups read different rows (``easy_context.data.prepare_dataloader``'s rule).
* micro-batches (``get_batch_samples``, one optimizer step's window): each full row becomes (input_ids,
  position_ids, shifted targets) (``batches.full_rows``), is cut with ``layout.prepare_inputs``, and the window's
  valid targets are summed over all ranks (one all-reduce, which also carries every rank's verdict on its
  batches, so a bad batch stops every rank with the reason instead of leaving the others in a collective).
* loss (``compute_loss``): ``sum(local NLL) * W / N_window`` — train.py's ``nll * scale``: DDP / DeepSpeed average
  gradients over W ranks and, with ``loss_is_scaled_for_ga``, the Trainer neither divides by GA nor lets
  DeepSpeed do it, so the update is the one of the token mean over the whole window. The value the Trainer logs
  (mean over ranks of the per-rank sums) is that token mean. Evaluation: each batch's token mean over all ranks.
"""
from __future__ import annotations

import os
from collections import deque

import torch

from .batches import TARGETS, BatchError, cut_rows, full_rows, shard_batch
from .options import SeqParallelOptions, check_trainer
from .rl import base_model as _base_model
from .rl import check_rl_trainer, rl_kind, setup_rl
from ..vlm.batches import split_vision
from ..registry import DEFAULT_MODE, get_mode

_CLASSES: dict = {}  # trainer class -> its sequence-parallel subclass (classes only, no process state)


def _reduce_verdicts(count, err: str | None, device) -> torch.Tensor:
    """All-reduce of [valid targets, one flag per rank]: the global count, or the same ValueError on every rank."""
    import torch.distributed as dist
    live = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if live else (1, 0)
    t = torch.zeros(1 + world, dtype=torch.float64, device=device)
    t[0] = float(count)
    t[1 + rank] = 1.0 if err else 0.0
    if live:
        dist.all_reduce(t)
    bad = torch.nonzero(t[1:]).flatten().tolist()
    if bad:
        raise BatchError(err or f"sequence parallelism: rank(s) {bad} rejected their batch (their error says why)")
    return t[0].clamp(min=1).float()


class SeqParallelTrainerMixin:
    """Put before the trainer class: ``class MyTrainer(SeqParallelTrainerMixin, SFTTrainer)``; pass
    ``sequence_parallel={"mode": ..., ...}`` (or a ``SeqParallelOptions``) to the constructor. Or call
    ``enable_sequence_parallel(trainer, ...)`` on any existing trainer."""

    _ec_rl = None  # "dpo" / "grpo": TRL's trainers keep their own data and loss (rl.py)

    def __init__(self, *args, sequence_parallel=None, **kwargs):
        super().__init__(*args, **kwargs)
        if sequence_parallel is not None:
            opts = (sequence_parallel if isinstance(sequence_parallel, SeqParallelOptions)
                    else SeqParallelOptions.from_kwargs(**sequence_parallel))
            _setup(self, opts)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        if self._ec_rl:
            return super().get_train_dataloader()
        return self._ec_reshard(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        if self._ec_rl:
            return super().get_eval_dataloader(eval_dataset)
        return self._ec_reshard(super().get_eval_dataloader(eval_dataset))

    def get_total_train_batch_size(self, args):
        if self._ec_rl:
            return super().get_total_train_batch_size(args)
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self._ec_layout.dp

    def _ec_reshard(self, dl):
        layout = self._ec_layout
        if layout.world_size == 1 or layout.dp == layout.world_size:
            return dl  # one process, or data_parallel: Accelerate's world sharding is already the dp sharding
        bs = getattr(dl, "batch_sampler", None)
        if not (hasattr(bs, "num_processes") and hasattr(bs, "process_index")):
            raise ValueError(f"sequence parallelism: the Trainer's dataloader ({type(dl).__name__}) is not one Accelerate "
                             "shards by batches (BatchSamplerShard), so it cannot be re-sharded over data-parallel "
                             "ranks only; use a map-style dataset and the default sampler")
        bs.num_processes, bs.process_index = layout.dp, layout.dp_rank
        return dl

    # ------------------------------------------------------------------ one optimizer step's micro-batches
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """This window's micro-batches, cut, and the window's token count; packed rows' dispatch tables of the next
        window are planned meanwhile in a helper process (easy_context_train/plan_ahead.py, as train.py does), so the window
        after this one is read now (the Trainer's resume skips batches by step count, not by iterator position)."""
        if self._ec_rl:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        ahead = self.__dict__.setdefault("_ec_ahead", {"it": None, "queue": deque(), "planner": None})
        if ahead["it"] is not epoch_iterator:  # a new epoch (the last one's read-ahead was all consumed)
            ahead["it"], ahead["queue"] = epoch_iterator, deque()
        if ahead["planner"] is None:
            from ..dispatch.ahead import HelperPlanner
            ahead["planner"] = HelperPlanner(self._ec_layout)
        queue, planner = ahead["queue"], ahead["planner"]
        items = [queue.popleft() for _ in range(min(num_batches, len(queue)))]
        items += self._ec_read(epoch_iterator, num_batches - len(items), None)  # planned in prepare_inputs
        queue.extend(self._ec_read(epoch_iterator, self.args.gradient_accumulation_steps, planner))
        if not items:
            return [], None
        shards, err = [], None
        try:
            shards = [self._ec_cut(item, planner) for item in items]
        except ValueError as e:  # BatchError, or a layout refusing the length: reported on every rank below
            err = str(e)
        if not queue:  # the epoch's last window: no helper idles until the next epoch starts one
            planner.close()
        count = sum(int((s[TARGETS] != -100).sum()) for s in shards) if err is None else 0
        return shards, _reduce_verdicts(count, err, device).to(device)

    def _ec_read(self, epoch_iterator, n, planner):
        """Up to ``n`` next batches as (rows or the error they raise, dispatch job: ``planner.submit`` or None)."""
        out = []
        for _ in range(n):
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                break
            try:
                # a VLM's images / videos ride along
                batch, vision = split_vision(dict(batch), getattr(self, "_ec_vlm", None))
                rows = full_rows(batch, self._ec_layout.seq_multiple, self._ec_pad_id,
                                 self._ec_opts.pad_to_multiple)
            except ValueError as e:  # raised when its window is cut (every rank hears of it there)
                out.append((e, None))
                continue
            out.append((rows if vision is None else rows + (vision,),
                        None if planner is None else planner.submit(rows[1])))
        return out

    def _ec_cut(self, item, planner):
        rows, job = item
        if isinstance(rows, Exception):
            raise rows
        return cut_rows(rows, self._ec_layout, planner.result(job, rows[1]))

    def _ec_shard(self, batch):
        st = self._ec_opts
        batch, vision = split_vision(dict(batch), getattr(self, "_ec_vlm", None))
        return shard_batch(batch, self._ec_layout, self._ec_pad_id, st.pad_to_multiple, vision)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from ..loss import IGNORE_INDEX, global_sum
        from ..loss import nll_sum

        if self._ec_rl:  # DPO / GRPO: the trainer's own loss on sequence-parallel log-probs (rl.py)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        unwrapped = self.accelerator.unwrap_model(model)
        if TARGETS in inputs:  # a training micro-batch cut by get_batch_samples
            if num_items_in_batch is None:
                raise ValueError("sequence parallelism: compute_loss got a micro-batch without the window's token "
                                 "count (num_items_in_batch); micro-batches come from get_batch_samples")
            nll = nll_sum(model, unwrapped, inputs["input_ids"], inputs["position_ids"], inputs[TARGETS],
                          self._ec_opts.chunked_loss, model_kwargs=_table_kwargs(inputs))
            loss = nll * (self.accelerator.num_processes / num_items_in_batch)
        else:  # evaluation: this batch's token mean over all ranks (the same value on every rank)
            if model.training:
                raise ValueError("sequence parallelism: training batches must come through get_batch_samples "
                                 "(the Trainer's loop); got an uncut batch in training mode")
            err, shard = None, None
            try:
                shard = self._ec_shard(inputs)
            except ValueError as e:
                err = str(e)
            count = int((shard[TARGETS] != IGNORE_INDEX).sum()) if shard is not None else 0
            device = inputs["input_ids"].device
            n = _reduce_verdicts(count, err, device)
            with torch.no_grad():
                nll = nll_sum(model, unwrapped, shard["input_ids"], shard["position_ids"], shard[TARGETS],
                              self._ec_opts.chunked_loss, model_kwargs=_table_kwargs(shard))
            loss = (global_sum(nll.float()) / n.to(nll.device)).detach()
        return (loss, {"loss": loss}) if return_outputs else loss


def _table_kwargs(batch) -> dict:
    """The packed rows' dispatch table a cut batch carries (cut_rows), as the model kwarg it travels in."""
    from ..dispatch.table import DISPATCH_KWARG
    from ..vlm.vision import VISION_KWARG  # a VLM batch's vision work (vlm/vision.py)
    return {k: batch[k] for k in (DISPATCH_KWARG, VISION_KWARG) if batch.get(k) is not None}


def _sp_class(cls):
    if issubclass(cls, SeqParallelTrainerMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"SeqParallel{cls.__name__}", (SeqParallelTrainerMixin, cls), {})
    return _CLASSES[cls]


def _setup(trainer, opts: SeqParallelOptions) -> None:
    """Validate (local facts, no collective), build the layout (collective), patch the model, set the memory options."""
    from .. import apply_seq_parallel_monkey_patch
    from ..hf.config import attention_window
    from ..memory import configure_memory
    from ..parallel_layout import ParallelLayout, plan_degrees
    from ..hf.config import check_rope_for_sp

    if getattr(trainer, "_ec_layout", None) is not None:
        raise ValueError("sequence parallelism is already enabled on this trainer")
    opts.validate()
    kind = rl_kind(trainer)  # "dpo" / "grpo": TRL's fused LM head calls run sequence-parallel (rl.py)
    if kind:
        check_rl_trainer(trainer, opts, kind)
    else:
        check_trainer(trainer, opts)
    world, rank = trainer.args.world_size, trainer.args.process_index
    dp, sp, ring, uly = plan_degrees(opts.mode, world, opts.sp_size, opts.ring_degree)
    base = _base_model(trainer.model)
    config = base.config.get_text_config()  # a VLM's language model (its own config for a text model)
    mode = get_mode(opts.mode)  # the options' name, once
    if mode.is_parallel:  # before anything reads heads: a model we cannot route is named first
        from ..hf.route import check_routable
        check_routable(base, mode)
    ParallelLayout(opts.mode, world, rank, dp, sp, ring, uly).check_heads(
        config.num_attention_heads, getattr(config, "num_key_value_heads", None))
    try:  # dynamic / longrope RoPE would not be exact per shard
        check_rope_for_sp(config, opts.mode)
    except Exception as e:  # train.py's UsageError: a ValueError here
        raise ValueError(str(e)) from None
    if opts.attn_backend not in (None, "auto"):
        from ..kernels import ENV_VAR
        os.environ[ENV_VAR] = opts.attn_backend

    if opts.checkpointing not in (None, "none"):
        # offload / nested / selective re-enter autograd in backward, which DDP's unused-parameter search counts
        # twice ("marked ready twice"); the Trainer turns the search off for its own checkpointing the same way
        if trainer.args.ddp_find_unused_parameters:
            raise ValueError(f"checkpointing={opts.checkpointing!r} needs TrainingArguments."
                             "ddp_find_unused_parameters=False (or unset)")
        handler = getattr(trainer.accelerator, "ddp_handler", None)  # built at Trainer.__init__ from the args
        if handler is not None:
            handler.find_unused_parameters = False
    layout = ParallelLayout.build(opts.mode, sp_size=opts.sp_size, ring_degree=opts.ring_degree)  # collective
    layout.dispatch_window = attention_window(config)  # packed rows: dispatch costs capped by the model's window
    from ..vlm.families import is_vlm
    if layout.mode.is_parallel or is_vlm(base):  # a VLM under data_parallel: the route of its cut batches' vision
        apply_seq_parallel_monkey_patch(base, layout)
    if opts.checkpointing is not None or opts.tiled_mlp or opts.head_chunks > 1:
        configure_memory(base, checkpointing=opts.checkpointing or "none", offload_every_k=opts.offload_every_k,
                         tiled_mlp=opts.tiled_mlp, head_chunks=opts.head_chunks)
    if opts.fused_ops:
        from ..ops import apply_fused_ops
        apply_fused_ops(base)
    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)  # a processor wraps its tokenizer
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if pad is not None else getattr(tok, "eos_token_id", None)
    trainer._ec_opts, trainer._ec_layout, trainer._ec_pad_id = opts, layout, int(pad or 0)
    trainer._ec_vlm = base if is_vlm(base) else None  # VLM batches: vision inputs cut with the rows (vlm/batches.py)
    if kind:  # the trainer's own data, loss and loss scaling stay; its scoring calls are wrapped
        setup_rl(trainer, kind, layout, trainer._ec_pad_id)
        return
    # the loss is normalised over the whole window here: the Trainer must not divide it by GA (and older
    # Trainers read model_accepts_loss_kwargs for the same decision)
    trainer.loss_is_scaled_for_ga = True
    trainer.model_accepts_loss_kwargs = True
    trainer.__class__ = _sp_class(type(trainer))


def enable_sequence_parallel(trainer, mode: str = DEFAULT_MODE, sp_size: int | None = None,
                             ring_degree: int | None = None, **options):
    """Turn on sequence parallelism for a constructed ``transformers.Trainer`` / ``trl.SFTTrainer`` / ``trl.DPOTrainer``
    / ``trl.GRPOTrainer`` (call it on every rank, before ``train()``; DPO / GRPO: rl.py). ``options``: the rest of ``SeqParallelOptions`` (chunked_loss, checkpointing,
    tiled_mlp, offload_every_k, fused_ops, attn_backend, pad_to_multiple). Returns the trainer."""
    opts = SeqParallelOptions.from_kwargs(mode=mode, sp_size=sp_size, ring_degree=ring_degree, **options)
    _setup(trainer, opts)
    return trainer
