"""The report of one case and its verdict: model, RoPE, window, layout, input, then logits / loss / gradient
differences against the single-process reference."""
from __future__ import annotations

from .case import THETA_INJECT_FACTOR, Case


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


def _recurrent_line(layers: list, config) -> str:
    from easy_context.families import FAMILIES, family_of_model_type
    classes = sorted({c for _, c in layers})
    fam = family_of_model_type(getattr(config, "model_type", None))
    rec = f"family record {fam}" if fam in FAMILIES and FAMILIES[fam].recurrent else "no family record"
    return (f"{', '.join(classes)} in {len(layers)} of {config.num_hidden_layers} layers ({rec}): state and conv "
            "window passed rank to rank in sequence order, reset at document starts (easy_context.recurrent); "
            "random decay A in [0.05, 0.5] where the layer has one (easy_context/recurrent/init.py)")


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
    if info.get("recurrent"):  # hybrids (issue #30): which layers the chain carries the state across ranks for
        lines.append(f"  recurrent  {_recurrent_line(info['recurrent'], case.config)}")
    degrees = f"ring {layout.ring} x ulysses {layout.ulysses}"
    lines.append(f"  layout     {case.mode}, world {info['world']} = dp {layout.dp} x sp {layout.sp} "
                 f"({layout}; {degrees})")
    if getattr(case, "head_chunks", 1) > 1:
        lines.append(f"  memory     attention blocks in {case.head_chunks} head groups, offloaded checkpoints")
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
