"""What one check is: ``Case`` (sent to the ranks, picklable), the usage error, the fixed choices."""
from __future__ import annotations

from dataclasses import dataclass

RTOL_FP32 = 1e-5  # tests/tols.py: relative error ||a - e|| / ||e|| for float32
INJECT = ("ring_degree_mismatch", "theta_mismatch")
THETA_INJECT_FACTOR = 4.0
MIN_DEFAULT_LEN = 16  # so every rank holds several tokens and packed rows hold several documents


class CheckUsageError(ValueError):
    """A problem with the arguments or the config: one line, exit 2, before any rank starts."""


@dataclass
class Case:
    """One check, as sent to the ranks (picklable)."""
    mode: str
    sp: int
    ring: int | None          # usp_attn ring degree the inputs are sharded with
    ring_run: int | None      # ... and the one attention runs with (differs only with the injected mismatch)
    config: object            # transformers config of the reference (and sp) model
    sp_config: object = None  # a different config for the sp model only (injected theta mismatch)
    seq_len: int = 16
    batch: int = 2
    packed: bool = False
    seed: int = 0
    lora: int = 0             # LoRA rank on every linear layer (0 = off); B initialised non-zero
    moe_aux: float = 0.0      # MoE router load-balancing loss coefficient (0 = off)
    head_chunks: int = 1      # sp model's attention blocks in head groups, over offloaded checkpoints (1 = off)
