"""``python -m easy_context check``: does sequence parallelism reproduce the single-process model for MY config?

    python -m easy_context check --model path/to/model_dir --parallel_mode usp_attn --world 4 --ring_degree 2
    python -m easy_context check --model config.json --parallel_mode zigzag_ring_attn --world 2 --packed

Loads the config only (no weights), keeps what the attention sees — heads, kv heads, head_dim, RoPE (theta, type,
scaling), sliding window — and shrinks layers (``--layers``, default 2) and, when asked, width (``--hidden``: fewer
heads of the same head_dim, same q/kv ratio) and vocabulary. Random float32 weights, a short random batch.
``--world`` gloo ranks on CPU run the patched model (``apply_seq_parallel_monkey_patch`` +
``prepare_seq_parallel_inputs``); sp rank 0 compares logits, the token-mean loss and every parameter gradient
(summed over the sp group) with one process running the full rows (each packed document alone with ``--packed``).

Exit status: 0 all within tolerance, 1 a difference beyond it (or the sequence-parallel run raised), 2 a usage
error (reported on one line before any rank starts). ``--inject`` breaks the set-up on purpose so the check
can be seen to fail (self-test).

Files: ``case.py`` (one check, usage error, fixed choices), ``config.py`` (read and shrink the config, set
RoPE theta), ``prepare.py`` (validate the arguments, build the case), ``spawn.py`` (run cases on gloo ranks),
``rank.py`` (what each rank runs), ``report.py`` (report and verdict), ``cli.py`` (flags, ``main``), ``matrix.py``
(``--matrix``: every family x mode x feature in one spawn -> docs/parity-matrix.md + .csv), ``census/``
(``--census``: every causal-LM family transformers lists -> docs/model-census.md + .csv).
"""
from __future__ import annotations

from .case import INJECT, MIN_DEFAULT_LEN, RTOL_FP32, THETA_INJECT_FACTOR, Case, CheckUsageError
from .cli import PROG, build_parser, main
from .config import _pick_layer_types, load_user_config, set_theta, shrink_config
from .prepare import plan_case
from .report import judge
from .spawn import run_cases

__all__ = ["main", "build_parser", "PROG", "plan_case", "run_cases", "judge", "Case", "CheckUsageError", "INJECT",
           "RTOL_FP32", "THETA_INJECT_FACTOR", "MIN_DEFAULT_LEN", "load_user_config", "set_theta", "shrink_config",
           "_pick_layer_types"]
