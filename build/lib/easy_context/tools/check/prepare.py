"""Validate the arguments and build the ``Case`` (layout, shrunk config, injected faults) before any rank starts."""
from __future__ import annotations

import copy
import math

from ...hf.config import sliding_window
from .case import MIN_DEFAULT_LEN, THETA_INJECT_FACTOR, Case, CheckUsageError
from .config import _heads, load_user_config, set_theta, shrink_config


def plan_case(args) -> tuple[Case, dict]:
    """Validate everything and build the Case; raises CheckUsageError (nothing has been spawned)."""
    from easy_context.registry import mode_names
    if args.mode not in mode_names():
        raise CheckUsageError(f"unknown --parallel_mode {args.mode!r}; valid modes: {', '.join(mode_names())}")
    for flag, v, lo in (("--world", args.world, 1), ("--batch", args.batch, 1), ("--seq-len", args.seq_len, 2),
                        ("--timeout", args.timeout, 1)):
        if v is not None and v < lo:
            raise CheckUsageError(f"{flag} must be >= {lo}; got {v}")
    if not args.rtol > 0:
        raise CheckUsageError(f"--rtol must be > 0; got {args.rtol}")
    if args.rope_theta is not None and not args.rope_theta > 0:
        raise CheckUsageError(f"--rope-theta must be > 0; got {args.rope_theta}")
    from easy_context.parallel_layout import ParallelLayout
    try:  # no process group here: only the degrees are validated
        layout = ParallelLayout.build(args.mode, sp_size=args.sp_size, ring_degree=args.ring_degree,
                                      world_size=args.world)
    except ValueError as e:
        raise CheckUsageError(f"--world {args.world}: {e}") from None
    ring = layout.layout_kw.get("ring_degree")
    if args.inject == "ring_degree_mismatch" and (not layout.mode.hybrid or layout.sp < 2):
        raise CheckUsageError("--inject ring_degree_mismatch needs --parallel_mode usp_attn on >= 2 sp ranks "
                              "(it shards for one ring degree and runs another)")

    config = load_user_config(args.model)
    if layout.mode.is_parallel:  # a layer the patch cannot route: refused by name before any rank starts
        from easy_context.hf.route import check_config_routable
        try:
            check_config_routable(config, layout.mode)
        except ValueError as e:
            raise CheckUsageError(str(e)) from None
    if not hasattr(config, "num_attention_heads") or not hasattr(config, "hidden_size"):
        raise CheckUsageError(f"--model {args.model!r}: {type(config).__name__} is not a decoder-only text "
                              "config (no num_attention_heads / hidden_size)")
    if args.rope_theta is not None:
        set_theta(config, lambda _: args.rope_theta)
    config, notes = shrink_config(config, args.layers, args.hidden, args.intermediate, args.vocab)
    try:  # a recurrent layer without an exact sequence-parallel path is refused up front (issue #30)
        from easy_context.recurrent.detect import check_config
        recurrent = check_config(args.mode, config)
    except ValueError as e:
        raise CheckUsageError(str(e)) from None
    q, kv, hd = _heads(config)
    try:
        layout.check_heads(q, kv)
    except ValueError as e:
        raise CheckUsageError(str(e).splitlines()[0]) from None

    chunks = getattr(args, "head_chunks", 1)
    if chunks != 1:
        _check_head_chunks(args.mode, config, chunks, kv)
    ring_run = ring
    if args.inject == "ring_degree_mismatch":
        def heads_ok(r):
            try:
                ParallelLayout.build(args.mode, sp_size=layout.sp, ring_degree=r, world_size=args.world
                                     ).check_heads(q, kv)
                return True
            except ValueError:
                return False
        others = [r for r in range(layout.sp, 0, -1) if layout.sp % r == 0 and r != ring and heads_ok(r)]
        if not others:
            raise CheckUsageError(f"--inject ring_degree_mismatch: no other ring degree of sp {layout.sp} fits "
                                  f"{q} q / {kv} kv heads")
        ring_run = others[0]
    sp_config = None
    if args.inject == "theta_mismatch":
        sp_config = copy.deepcopy(config)
        set_theta(sp_config, lambda t: t * THETA_INJECT_FACTOR)

    mult = layout.seq_multiple
    seq_len = args.seq_len if args.seq_len is not None else mult * math.ceil(MIN_DEFAULT_LEN / mult)
    try:
        layout.check_seq_len(seq_len)
    except ValueError as e:
        raise CheckUsageError(f"--seq-len: {e}") from None
    w = sliding_window(config)  # a window shorter than the length is checked too (windowed ring blocks)
    case = Case(mode=args.mode, sp=layout.sp, ring=ring, ring_run=ring_run, config=config, sp_config=sp_config,
                seq_len=seq_len, batch=args.batch, packed=args.packed, seed=args.seed, head_chunks=chunks)
    info = {"source": args.model, "notes": notes, "layout": layout, "seq_multiple": mult, "window": w, "seq_len": seq_len,
            "heads": (q, kv, hd), "recurrent": recurrent, "rtol": args.rtol, "inject": args.inject, "world": args.world}
    return case, info


def _check_head_chunks(mode: str, config, n: int, kv: int) -> None:
    """--head-chunks: what memory/head_chunks.py would refuse at the first step, refused before any rank starts."""
    from easy_context.families import FAMILIES, family_of_model_type
    from easy_context.memory.head_chunks import CHUNKABLE
    from easy_context.registry import get_mode
    if n < 1:
        raise CheckUsageError(f"--head-chunks must be >= 1; got {n}")
    if not get_mode(mode).supports_attention_cache:
        raise CheckUsageError(f"--head-chunks needs a sequence-parallel mode's attention; --parallel_mode {mode} runs "
                              "the model's own")
    family = FAMILIES.get(family_of_model_type(getattr(config, "model_type", None)) or "")
    if family is None or family.attention not in CHUNKABLE:
        raise CheckUsageError(f"--head-chunks: {family.attention if family else config.model_type} is not supported "
                              f"(supported: {', '.join(CHUNKABLE)})")
    if kv % n:
        raise CheckUsageError(f"--head-chunks {n} must divide the {kv} kv heads")
