"""Sequence parallelism from the tools long-context users already run: ``transformers.Trainer``, ``trl.SFTTrainer``,
and ``trl.DPOTrainer`` / ``trl.GRPOTrainer`` (their completion log-probs scored sequence-parallel: rl.py,
seq_logprobs.py; docs/trainer.md).

    from easy_context.integrations import enable_sequence_parallel
    enable_sequence_parallel(trainer, mode="zigzag_ring_attn", chunked_loss=True)
"""
from .batches import BatchError, full_rows, shard_batch
from .options import SeqParallelOptions
from .trainer import SeqParallelTrainerMixin, enable_sequence_parallel

__all__ = ["enable_sequence_parallel", "SeqParallelTrainerMixin", "SeqParallelOptions", "BatchError", "full_rows",
           "shard_batch"]
