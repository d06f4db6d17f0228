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
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import queue
import socket
import sys
import time
from dataclasses import dataclass

PROG = "python -m easy_context check"
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


# ---------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    from easy_context.registry import SEQ_ALGOS
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="exit status: 0 pass, 1 mismatch beyond tolerance, 2 usage error")
    p.add_argument("--model", required=True, help="model directory or config.json (only the config is read)")
    p.add_argument("--parallel_mode", "--parallel-mode", dest="mode", default="zigzag_ring_attn",
                   help=f"one of {', '.join(SEQ_ALGOS)} (default zigzag_ring_attn)")
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
    d.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    d.add_argument("-v", "--verbose", action="store_true", help="every gradient's diff, full rank tracebacks")
    p.add_argument("--inject", choices=INJECT, default=None,
                   help="self-test only: break the set-up on purpose so the check must FAIL. "
                        "ring_degree_mismatch: inputs sharded for one usp ring degree, attention run with "
                        f"another; theta_mismatch: the sp model's RoPE theta is x{THETA_INJECT_FACTOR:g}")
    return p


# ---------------------------------------------------------------------------------------------- config
def load_user_config(path: str):
    """AutoConfig from a model directory or a config.json path; no weights, no download for local paths."""
    if not os.path.exists(path):
        raise CheckUsageError(f"--model {path!r}: no such file or directory (give a model directory or its "
                              "config.json)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckUsageError(f"--model {path!r}: directory has no config.json")
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any loader failure is the user's file
        raise CheckUsageError(f"--model {path!r}: cannot read the config: {str(e).splitlines()[0]}") from None


def _heads(config) -> tuple[int, int, int]:
    q = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or q
    hd = getattr(config, "head_dim", None) or config.hidden_size // q
    return q, kv, hd


def _thetas(config) -> list[tuple[str | None, dict]]:
    """The rope_parameters dict(s): one, or one per layer type (Gemma 3: sliding/full)."""
    rp = getattr(config, "rope_parameters", None)
    if not isinstance(rp, dict):
        return []
    if all(isinstance(v, dict) for v in rp.values()) and rp:
        return list(rp.items())
    return [(None, rp)]


def set_theta(config, fn) -> None:
    """theta <- fn(theta) everywhere the config keeps it (rope_parameters, per layer type, legacy rope_theta)."""
    entries = _thetas(config)
    for _, params in entries:
        if "rope_theta" in params:
            params["rope_theta"] = float(fn(params["rope_theta"]))
    if getattr(config, "rope_theta", None) is not None:
        config.rope_theta = float(fn(config.rope_theta))
    elif not entries:
        raise CheckUsageError(f"{config.model_type}: the config has no RoPE theta to set")


def _pick_layer_types(types: list, n: int) -> list:
    """The first n layer types, but with every type of the full model present when n allows (so a
    2-layer Gemma 3 still has a global-attention layer)."""
    chosen = list(types[:n])
    missing = [t for t in dict.fromkeys(types) if t not in chosen]
    for i, t in enumerate(missing[:n - 1] if n > 1 else []):
        chosen[n - 1 - i] = t
    return chosen


def shrink_config(config, layers: int | None, hidden: int | None = None, intermediate: int | None = None,
                  vocab: int | None = None) -> tuple[object, list[str]]:
    """A copy of ``config`` with fewer layers / a narrower model; head_dim, the q/kv ratio, RoPE and window
    settings stay. Returns (config, notes about what changed)."""
    config = copy.deepcopy(config)
    notes = []
    n0 = config.num_hidden_layers
    if layers is not None:
        if layers < 1:
            raise CheckUsageError(f"--layers must be >= 1; got {layers}")
        config.num_hidden_layers = layers
        types = getattr(config, "layer_types", None)
        if isinstance(types, (list, tuple)) and types:
            config.layer_types = _pick_layer_types(list(types), layers)
        mlp_only = getattr(config, "mlp_only_layers", None)
        if isinstance(mlp_only, (list, tuple)):
            config.mlp_only_layers = [i for i in mlp_only if i < layers]
        if layers != n0:
            notes.append(f"layers {n0} -> {layers}")
    q, kv, hd = _heads(config)
    h0 = config.hidden_size
    if hidden is not None and hidden != h0:
        ratio = q // kv if q % kv == 0 else None
        if hidden < 1 or (q * hidden) % h0 != 0 or ratio is None or ((q * hidden) // h0) % ratio != 0:
            valid = [h0 * k // q for k in range(ratio or q, q, ratio or q) if (h0 * k) % q == 0]
            raise CheckUsageError(
                f"--hidden {hidden}: heads must shrink in proportion keeping head_dim {hd} and the q/kv ratio "
                f"{q}:{kv}; with hidden {h0} and {q} heads, valid values: {', '.join(map(str, valid)) or 'none'}")
        q_new = q * hidden // h0
        kv_new = q_new * kv // q
        config.hidden_size, config.num_attention_heads = hidden, q_new
        if hasattr(config, "num_key_value_heads"):
            config.num_key_value_heads = kv_new
        config.head_dim = hd  # explicit, or the model would derive hidden / heads
        notes.append(f"hidden {h0} -> {hidden}, heads {q}/{kv} -> {q_new}/{kv_new} (head_dim {hd})")
        if intermediate is None:
            for attr in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
                v = getattr(config, attr, None)
                if isinstance(v, int) and v > 0:
                    setattr(config, attr, max(1, round(v * hidden / h0)))
                    notes.append(f"{attr} {v} -> {getattr(config, attr)}")
    if intermediate is not None:
        if intermediate < 1:
            raise CheckUsageError(f"--intermediate must be >= 1; got {intermediate}")
        notes.append(f"intermediate_size {config.intermediate_size} -> {intermediate}")
        config.intermediate_size = intermediate
    if vocab is not None and vocab != config.vocab_size:
        if vocab < 2:
            raise CheckUsageError(f"--vocab must be >= 2; got {vocab}")
        notes.append(f"vocab {config.vocab_size} -> {vocab}")
        config.vocab_size = vocab
        for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(config, attr, None)
            if isinstance(v, int) and v >= vocab:
                setattr(config, attr, vocab - 1 if attr != "pad_token_id" else None)
    # dropout / router noise draw different random numbers on each rank: off, or nothing could match
    for k, v in config.to_dict().items():
        if isinstance(v, float) and v > 0 and ("dropout" in k or "pdrop" in k or "jitter" in k):
            setattr(config, k, 0.0)
            notes.append(f"{k} {v} -> 0")
    config.use_cache = False
    return config, notes


def sliding_window(config) -> int | None:
    """The window the built model will use, None for full attention everywhere."""
    w = getattr(config, "sliding_window", None)
    if w is None or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and types and "sliding_attention" not in types:
        return None
    return int(w)


# ---------------------------------------------------------------------------------------------- planning
def plan_case(args) -> tuple[Case, dict]:
    """Validate everything and build the Case; raises CheckUsageError (nothing has been spawned)."""
    from easy_context.registry import SEQ_ALGOS
    if args.mode not in SEQ_ALGOS:
        raise CheckUsageError(f"unknown --parallel_mode {args.mode!r}; valid modes: {', '.join(SEQ_ALGOS)}")
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
    ring = layout.ring if args.mode == "usp_attn" else None
    if args.inject == "ring_degree_mismatch" and (args.mode != "usp_attn" or layout.sp < 2):
        raise CheckUsageError("--inject ring_degree_mismatch needs --parallel_mode usp_attn on >= 2 sp ranks "
                              "(it shards for one ring degree and runs another)")

    config = load_user_config(args.model)
    if not hasattr(config, "num_attention_heads") or not hasattr(config, "hidden_size"):
        raise CheckUsageError(f"--model {args.model!r}: {type(config).__name__} is not a decoder-only text "
                              "config (no num_attention_heads / hidden_size)")
    if args.rope_theta is not None:
        set_theta(config, lambda _: args.rope_theta)
    config, notes = shrink_config(config, args.layers, args.hidden, args.intermediate, args.vocab)
    q, kv, hd = _heads(config)
    try:
        layout.check_heads(q, kv)
    except ValueError as e:
        raise CheckUsageError(str(e).splitlines()[0]) from None

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
                seq_len=seq_len, batch=args.batch, packed=args.packed, seed=args.seed)
    info = {"source": args.model, "notes": notes, "layout": layout, "seq_multiple": mult, "window": w, "seq_len": seq_len,
            "heads": (q, kv, hd), "rtol": args.rtol, "inject": args.inject, "world": args.world}
    return case, info


# ---------------------------------------------------------------------------------------------- ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(cases: list[Case], world: int, timeout: float = 600.0, collective_timeout: float = 120.0) -> list[dict]:
    """Run every case on ``world`` spawned gloo ranks (one spawn: the imports are paid once).

    Returns, per case, ``{"info": rank 0's model/RoPE summary | None, "results": [sp-rank-0 payload per dp
    group], "error": (rank, traceback) | None}``.
    A rank that dies, or ranks still running at ``timeout``, fail every case they had not finished.
    """
    import torch.multiprocessing as mp

    from .check_rank import rank_entry
    ctx = mp.get_context("spawn")  # fork would copy the parent's torch threads and state
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_entry, args=(r, world, port, cases, results, collective_timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out = [{"info": None, "results": [], "error": None} for _ in cases]
    done: set[int] = set()
    fatal = None
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world and fatal is None:
            try:
                rank, i, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if dead:
                    time.sleep(1.0)  # its last message may still be in flight
                    if results.empty():
                        fatal = (dead[0], f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                elif time.monotonic() > deadline:
                    fatal = (-1, f"ranks did not finish within {timeout:.0f}s (deadlock?)")
                continue
            if i is None:
                if status == "done":
                    done.add(rank)
                else:
                    fatal = (rank, payload)
            elif status == "info":
                out[i]["info"] = payload
            elif status == "error":
                if out[i]["error"] is None or rank < out[i]["error"][0]:
                    out[i]["error"] = (rank, payload)
            elif payload is not None:
                out[i]["results"].append(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    if fatal is not None:
        for o in out:
            if o["error"] is None and not o["results"]:
                o["error"] = fatal
    return out


# ---------------------------------------------------------------------------------------------- report
def _rope_lines(rope: list[dict]) -> list[str]:
    lines = []
    for r in rope:
        s = f"{r['rope_type']}, theta {r['theta']:g}" if r["theta"] is not None else f"{r['rope_type']}"
        if r["theta_from_inv_freq"] is not None:
            s += f" (inv_freq gives {r['theta_from_inv_freq']:.6g})"
        if r["scaling"]:
            s += " " + ", ".join(f"{k}={v}" for k, v in r["scaling"].items())
        lines.append(f"{s}  [{r['module']}]")
    return lines or ["none found (no *RotaryEmbedding module)"]


def _verdict(d: dict, rtol: float) -> str:
    return "ok" if d["rel"] <= rtol else "FAIL"


def judge(case: Case, info: dict, outcome: dict, verbose: bool = False) -> tuple[str, int]:
    """The report text and the exit status (0 pass, 1 mismatch or error) of one case's outcome."""
    rtol, layout = info["rtol"], info["layout"]
    q, kv, hd = info["heads"]
    cfg = case.config
    lines = [f"easy_context check: {cfg.model_type} from {info['source']}"]
    res = outcome["results"]
    first = outcome["info"]
    params = f", {first['n_params'] / 1e6:.2f}M params" if first else ""
    cls = f" ({first['model_class']})" if first else ""
    lines.append(f"  model      {cfg.model_type}{cls}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                 f"{q} q / {kv} kv heads, head_dim {hd}, vocab {cfg.vocab_size}{params}; random float32 weights "
                 f"(seed {case.seed})")
    if info["notes"]:
        lines.append(f"  shrunk     {'; '.join(info['notes'])}")
    if first:
        rope = _rope_lines(first["rope_ref"])
        lines.append(f"  rope       {rope[0]}")
        lines += [f"             {r}" for r in rope[1:]]
        if first["rope_sp"] != first["rope_ref"]:
            sp_rope = _rope_lines(first["rope_sp"])
            lines += [f"  {'rope (sp)' if i == 0 else '':<11}{r}   <- differs from the reference"
                      for i, r in enumerate(sp_rope)]
    w = info["window"]
    lines.append(f"  window     {'none (full causal)' if w is None else w}"
                 f"{' (>= the length: full causal)' if w is not None and w >= info.get('seq_len', 0) else ''}")
    degrees = f"ring {layout.ring} x ulysses {layout.ulysses}"
    lines.append(f"  layout     {case.mode}, world {info['world']} = dp {layout.dp} x sp {layout.sp} "
                 f"({layout}; {degrees})")
    if case.ring_run != case.ring:
        lines.append(f"  injected   inputs sharded for ring {case.ring}, attention run with ring {case.ring_run}")
    if case.sp_config is not None:
        lines.append(f"  injected   sp model RoPE theta x{THETA_INJECT_FACTOR:g}")
    docs = ""
    if case.packed and res:
        docs = ", packed: " + " / ".join(f"{d} docs" for d in res[0]["docs"]) + " per row"
    lines.append(f"  input      {case.batch} x {case.seq_len} tokens per dp group (multiple of "
                 f"{info['seq_multiple']}){docs}; reference: one process, "
                 f"{'each document alone' if case.packed else 'full rows'}")
    lines.append(f"  tolerance  relative ||sp - ref|| / ||ref|| <= {rtol:g}")
    if outcome["error"] is not None:
        rank, tb = outcome["error"]
        last = [ln for ln in tb.strip().splitlines() if ln.strip()][-1]
        lines.append(f"  error      rank {rank}: {last}")
        if verbose:
            lines += ["    " + ln for ln in tb.rstrip().splitlines()]
        lines.append("FAIL: the sequence-parallel run raised (the set-up is inconsistent or unsupported)")
        return "\n".join(lines), 1
    ok = True
    for r in sorted(res, key=lambda r: r["dp_rank"]):
        tag = f" dp {r['dp_rank']}" if layout.dp > 1 else ""
        lg, ls = r["logits"], r["loss"]
        worst_name = max(r["grads"], key=lambda n: r["grads"][n]["rel"])
        worst = r["grads"][worst_name]
        bad = [n for n, d in r["grads"].items() if d["rel"] > rtol]
        ok &= lg["rel"] <= rtol and ls["rel"] <= rtol and not bad
        lines.append(f"  {'logits' + tag:<11}max abs {lg['max_abs']:.2e}  rel {lg['rel']:.2e}  {_verdict(lg, rtol)}")
        lines.append(f"  {'loss' + tag:<11}max abs {ls['max_abs']:.2e}  rel {ls['rel']:.2e}  {_verdict(ls, rtol)}  "
                     f"(ref {ls['ref']:.6f}, sp {ls['sp']:.6f})")
        lines.append(f"  {'grads' + tag:<11}{len(r['grads'])} tensors (summed over sp), {len(bad)} beyond tolerance; "
                     f"worst {worst_name}: max abs {worst['max_abs']:.2e}  rel {worst['rel']:.2e}  "
                     f"{_verdict(worst, rtol)}")
        if verbose:
            lines += [f"             {n}: max abs {d['max_abs']:.2e} rel {d['rel']:.2e}" for n, d in r["grads"].items()]
    if ok:
        lines.append(f"PASS: {case.mode} {layout} reproduces the single-process model (logits, loss, every "
                     "gradient)")
        return "\n".join(lines), 0
    lines.append(f"FAIL: {case.mode} {layout} differs from the single-process model beyond rtol {rtol:g}")
    return "\n".join(lines), 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        case, info = plan_case(args)
    except CheckUsageError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    outcome = run_cases([case], args.world, timeout=args.timeout)[0]
    report, code = judge(case, info, outcome, verbose=args.verbose)
    print(report, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
