"""``python -m easy_context check``: does sequence parallelism reproduce the single-process model for MY config?

The command line: flags, then plan the case, run it on the ranks, print the report (``--help``'s description is
the first paragraph)."""
from __future__ import annotations

import argparse
import sys

from .case import INJECT, MIN_DEFAULT_LEN, RTOL_FP32, THETA_INJECT_FACTOR, CheckUsageError
from .prepare import plan_case
from .report import judge
from .spawn import run_cases

PROG = "python -m easy_context check"


def build_parser() -> argparse.ArgumentParser:
    from easy_context.registry import DEFAULT_MODE, mode_names
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="exit status: 0 pass, 1 mismatch beyond tolerance, 2 usage error")
    p.add_argument("--model", help="model directory or config.json (only the config is read); not with --matrix")
    p.add_argument("--parallel_mode", "--parallel-mode", dest="mode", default=DEFAULT_MODE,
                   help=f"one of {', '.join(mode_names())} (default {DEFAULT_MODE})")
    p.add_argument("--world", type=int, default=2, help="number of CPU ranks (gloo) = dp x sp (default 2)")
    p.add_argument("--sp_size", "--sp-size", dest="sp_size", type=int, default=None,
                   help="ranks sharing one sequence (default: the whole world; dp = world / sp)")
    p.add_argument("--ring_degree", "--ring-degree", dest="ring_degree", type=int, default=None,
                   help="usp_attn: ring degree (ring x ulysses = sp; default sp)")
    g = p.add_argument_group("model size (attention geometry and RoPE are kept)")
    g.add_argument("--layers", type=int, default=2, help="decoder layers to build (default 2)")
    g.add_argument("--hidden", type=int, default=None,
                   help="shrink hidden size: heads shrink in proportion, head_dim and the q/kv ratio stay")
    g.add_argument("--intermediate", type=int, default=None,
                   help="MLP width (default: the config's, scaled like --hidden)")
    g.add_argument("--vocab", type=int, default=None, help="shrink the vocabulary (default: the config's)")
    g.add_argument("--rope-theta", "--rope_theta", dest="rope_theta", type=float, default=None,
                   help="override RoPE theta, as train.py --rope-theta does (every layer type's)")
    d = p.add_argument_group("batch and tolerance")
    d.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, default=None,
                   help=f"tokens per row (default: the smallest multiple of the layout's seq_multiple >= "
                        f"{MIN_DEFAULT_LEN})")
    d.add_argument("--batch", type=int, default=2, help="rows per dp group (default 2)")
    d.add_argument("--packed", action="store_true",
                   help="packed documents: position_ids restart at random starts; reference runs each alone")
    d.add_argument("--rtol", type=float, default=RTOL_FP32,
                   help=f"relative tolerance ||sp - ref|| / ||ref|| (default {RTOL_FP32:g}, float32)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--head-chunks", "--head_chunks", dest="head_chunks", type=int, default=1,
                   help="the sp model's attention blocks in this many head groups over offloaded checkpoints "
                        "(train.py --head-chunks; easy_context/memory/head_chunks.py); default 1 = off")
    d.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    d.add_argument("-v", "--verbose", action="store_true", help="every gradient's diff, full rank tracebacks")
    p.add_argument("--inject", choices=INJECT, default=None,
                   help="self-test only: break the set-up on purpose so the check must FAIL. "
                        "ring_degree_mismatch: inputs sharded for one usp ring degree, attention run with "
                        f"another; theta_mismatch: the sp model's RoPE theta is x{THETA_INJECT_FACTOR:g}")
    m = p.add_argument_group("parity matrix (--matrix: every family x mode x feature; matrix.py)")
    m.add_argument("--matrix", action="store_true", help="run the exactness check over families x sp modes x "
                   "features on --world ranks (default 4) and write OUT.md + OUT.csv (the README's parity matrix)")
    m.add_argument("--families", default=None, help="comma-separated subset (default: every supported family)")
    m.add_argument("--modes", default=None, help="comma-separated subset of the sp modes (default: all four)")
    m.add_argument("--features", default=None,
                   help="comma-separated subset of base, packed, window, lora, moe_aux, rope_yarn, rope_dynamic")
    m.add_argument("--out", default="docs/parity-matrix", help="output path without extension")
    c = p.add_argument_group("model census (--census: every causal-LM family transformers lists; tools/check/census/)")
    c.add_argument("--census", action="store_true", help="tiny models of every family in MODEL_FOR_CAUSAL_LM_MAPPING_"
                   "NAMES (or --families) under --modes (default zigzag_ring_attn, ulysses_attn), plain and packed "
                   "rows, on --world ranks: exact / refused / not buildable / WRONG / CRASH -> docs/model-census.md")
    c.add_argument("--no-packed", dest="no_packed", action="store_true", help="--census: plain rows only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.census:
            from .census import main_census
            args.timeout = 7200.0 if args.timeout == 600.0 else args.timeout
            return main_census(args)
        if args.matrix:
            from .matrix import main_matrix
            if args.world == 2 and "--world" not in (argv if argv is not None else sys.argv):
                args.world = 4  # usp_attn as a real hybrid (ring 2 x ulysses 2)
            if args.timeout == 600.0:
                args.timeout = 3600.0
            return main_matrix(args)
        if args.model is None:
            raise CheckUsageError("--model is required (or --matrix)")
        case, info = plan_case(args)
    except CheckUsageError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    outcome = run_cases([case], args.world, timeout=args.timeout)[0]
    report, code = judge(case, info, outcome, verbose=args.verbose)
    print(report, flush=True)
    return code
