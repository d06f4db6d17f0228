"""``python -m easy_context plan``: which parallel layout and memory options train this model at this length?

The command line: flags, the ranked table of candidates, the recommended launch line (``--help``'s description
is the first paragraph)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from ...cost_model.constants import PlanUsageError, gpu_constants, load_constants
from ...cost_model.options import Env
from ...cost_model.shape import load_shape, model_flops_per_token
from .launch import accelerate_command
from .search import candidates

PROG = "python -m easy_context plan"
MULTI_GPU_NOTE = ("multi-GPU times use assumed NVLink / InfiniBand / PCIe bandwidths (plan_constants.json), not "
                  "measurements: no multi-GPU run has been made with this project")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (no usage block)
        raise PlanUsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="exit status: 0 something fits, 1 nothing fits, 2 usage error. Constants and their sources: "
                       "easy_context/tools/plan_constants.json")
    a = p.add_argument
    a("--model", required=True, help="model directory, config.json path, or a built-in shape: "
      + ", ".join(load_constants()["shapes"]))
    a("--seq-length", type=int, required=True, help="tokens per row (train.py --seq-length)")
    a("--gpus", type=int, required=True, help="GPUs per node")
    a("--nodes", type=int, default=1)
    a("--gpu", default="h200", help="h200 (measured), h100 or a100 (assumed constants)")
    a("--gpu-mem", type=float, default=None, help="GiB of memory per GPU (default: the GPU's)")
    a("--host-mem", type=float, default=None, help="GiB of host RAM per node (default: 128 GiB per GPU)")
    a("--batch-size", type=int, default=1, help="rows per micro-batch per data-parallel rank")
    a("--gradient-accumulate-every", type=int, default=4, help="micro-batches per optimizer step")
    a("--kernel", default=None, help="attention backend for the sp modes: fa4 (default on Hopper), cudnn, flash")
    a("--linear-kernel", default="fla", choices=("fla", "torch"), help="hybrids: gated DeltaNet's chunk rule priced "
      "at flash-linear-attention's kernel (fla, assumed throughput) or the model file's torch path (measured)")
    a("--top", type=int, default=10, help="rows to print")
    a("--json", action="store_true", help="machine-readable: every candidate, fitting first, fastest first")
    a("--doc-median", type=float, default=None, help="packed rows: median document length (log-normal); prints the "
      "predicted per-rank balance and attention time of zigzag, k pairs and the dispatch (tools/plan/packed.py)")
    a("--doc-sigma", type=float, default=1.5, help="packed rows: log-normal sigma of the document lengths")
    return p


# what a plan can be about: far beyond any machine, small enough that every number stays finite and the search short
BOUNDS = {"seq_length": 1 << 34, "gpus": 1 << 12, "nodes": 1 << 20, "batch_size": 1 << 20,
          "gradient_accumulate_every": 1 << 20, "top": 1 << 20, "world": 1 << 20}
MEM_BOUND_GIB = {"gpu_mem": 1 << 20, "host_mem": 1 << 30}


def parse(argv) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("seq_length", "gpus", "nodes", "batch_size", "gradient_accumulate_every", "top"):
        if not 1 <= getattr(args, name) <= BOUNDS[name]:
            raise PlanUsageError(f"--{name.replace('_', '-')} must be >= 1 and <= {BOUNDS[name]}, got "
                                 f"{getattr(args, name)}")
    if args.gpus * args.nodes > BOUNDS["world"]:
        raise PlanUsageError(f"--gpus x --nodes must be at most {BOUNDS['world']} GPUs, got {args.gpus} x "
                             f"{args.nodes} = {args.gpus * args.nodes}")
    for name in ("gpu_mem", "host_mem"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and 0 < v <= MEM_BOUND_GIB[name]):
            raise PlanUsageError(f"--{name.replace('_', '-')} must be a positive number of GiB up to "
                                 f"{MEM_BOUND_GIB[name]}, got {v:g}")
    for name, ok, want in (("doc_median", lambda v: v > 0, "a positive number of tokens"),
                           ("doc_sigma", lambda v: v >= 0, "a number >= 0 (the log-normal's sigma)")):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and ok(v)):
            raise PlanUsageError(f"--{name.replace('_', '-')} must be {want}, got {v:g}")
    args.gpu = args.gpu.lower()
    g = gpu_constants(args.gpu)  # raises for an unknown GPU
    if args.kernel is not None and args.kernel not in g["attn_fwd_bwd_tflops"]:
        raise PlanUsageError(f"--kernel {args.kernel!r} has no measured throughput for {args.gpu}; "
                             f"known: {', '.join(g['attn_fwd_bwd_tflops'])}")
    return args


def _fmt_row(i, r) -> list[str]:
    lay = f"{r['dp']}x{r['sp']}" + (f" (R{r['ring']}xU{r['sp'] // r['ring']})" if r["ring"] else "")
    ck = r["checkpointing"] + (f" k={r['offload_every_k']}" if r["checkpointing"] == "offload" else "") \
        + (f" heads/{r['head_chunks']}" if r.get("head_chunks", 1) > 1 else "") \
        + (f" rec-tiles/{r['recurrent_tiles']}" if r.get("recurrent_tiles", 1) > 1 else "") \
        + (f" sel {r['selective_layers']}" if r.get("selective_layers") else "")
    return [str(i), r["mode"], lay, ck, "yes" if r["chunked_loss"] else "no", "yes" if r["tiled_mlp"] else "no",
            r["zero"], f"{r['gpu_peak_gib']:.1f}", f"{r['host_peak_gib_per_node']:.0f}", f"{r['step_s']:.2f}",
            f"{r['tokens_per_s']:.0f}", f"{100 * r['mfu']:.1f}%", "yes" if r["fits"] else "no: " + r["why_not"]]


def render_table(rows: list[dict]) -> str:
    head = ["#", "mode", "dp x sp", "checkpointing", "chunked", "tiled", "zero", "GPU GiB", "host GiB/node",
            "step s", "tok/s", "MFU", "fits"]
    body = [_fmt_row(i + 1, r) for i, r in enumerate(rows)]
    w = [max(len(x[j]) for x in [head] + body) for j in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w[j]) for j, c in enumerate(cells)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * x for x in w])] + [line(b) for b in body])


def rank_rows(rows: list[dict]) -> list[dict]:
    """Fitting first, fastest first; the misses by how far they overshoot (closest first)."""
    shipped = lambda r: r["zero"] != "zero3"  # noqa: E731 - on a tie, a config the repo ships first
    return sorted(rows, key=lambda r: (not r["fits"], -r["tokens_per_s"] if r["fits"] else r["gpu_peak_gib"],
                                       not shipped(r), r["gpu_peak_gib"]))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv)
        shape = load_shape(args.model)
    except PlanUsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    env = Env(gpu=args.gpu, gpus_per_node=args.gpus, nodes=args.nodes, seq_len=args.seq_length, batch=args.batch_size,
              grad_accum=args.gradient_accumulate_every, gpu_mem_gib=args.gpu_mem, host_mem_gib=args.host_mem)
    rows = rank_rows(candidates(shape, env, args.kernel, args.linear_kernel))
    for r in rows:
        r["command"] = accelerate_command(r, env)
    fits = [r for r in rows if r["fits"]]
    g = gpu_constants(args.gpu)
    host = args.host_mem if args.host_mem is not None else g["host_gib_per_gpu_default"] * args.gpus
    if args.json:
        print(json.dumps(dict(model=asdict(shape), params=shape.params(),
                              flops_per_token=model_flops_per_token(shape, args.seq_length),
                              env=asdict(env), host_mem_gib_per_node=host,
                              gpu_mem_gib=args.gpu_mem or g["memory_gib"], fits=len(fits), candidates=rows,
                              notes=[MULTI_GPU_NOTE]), indent=1))
        return 0 if fits else 1
    print(f"{shape.name}: {shape.params() / 1e9:.2f}B params, {shape.layers} layers, d={shape.hidden}, "
          f"heads {shape.heads}/{shape.kv_heads} kv, vocab {shape.vocab}; L={args.seq_length}, "
          f"{args.nodes} x {args.gpus} {args.gpu.upper()} ({args.gpu_mem or g['memory_gib']:g} GiB each, "
          f"host {host:g} GiB/node), batch {args.batch_size}, GA {args.gradient_accumulate_every}")
    terms = "6N + 6 n_attn L d + 3 x recurrent state math" if shape.recurrent else "6N + 6 n_layers L d"
    print(f"model FLOPs/token ({terms}) {model_flops_per_token(shape, args.seq_length):.3e}; "
          f"{len(fits)} of {len(rows)} candidates fit")
    if shape.recurrent:
        from ...cost_model.hybrid import describe
        print(describe(shape.recurrent, shape.n_attn, shape.hidden))
    shown = fits[:args.top] if fits else rows[:args.top]
    if not fits:
        print("nothing fits; the closest candidates and why:")
    print(render_table(shown))
    if fits:
        best = fits[0]
        print(f"\nrecommended (predicted {best['tokens_per_s']:.0f} tok/s, {100 * best['mfu']:.1f}% MFU, "
              f"GPU {best['gpu_peak_gib']:.1f} GiB, host {best['host_peak_gib_per_node']:.0f} GiB/node):")
        print("  " + best["command"])
    if args.doc_median is not None:  # the fastest fitting ring candidate (the one a dispatch applies to)
        from .packed import packed_report
        from ...registry import get_mode
        ring = [r for r in fits if get_mode(r["mode"]).dispatches and (r["ring"] or r["sp"]) > 1]
        w = (ring[0]["ring"] or ring[0]["sp"]) if ring else env.world
        tput = g["attn_fwd_bwd_tflops"][args.kernel or g["default_kernel"]]
        tflops = float(tput[max(tput, key=lambda n: int(n) if int(n) <= args.seq_length else -1)])
        print(f"\n{'the fastest fitting ring layout: ' + ring[0]['mode'] if ring else 'no ring layout fits'}")
        print(packed_report(args.seq_length, w, shape.heads, shape.head_dim, tflops, args.doc_median, args.doc_sigma,
                            shape.window))
    if env.world > 1:
        print("note: " + MULTI_GPU_NOTE)
    print("note: predictions, not measurements; single-H200 points are checked by bench/plan_validation.py")
    return 0 if fits else 1
