"""``python -m easy_context check --matrix``: the exactness check over families x modes x features, as a table.

    python -m easy_context check --matrix                        # docs/parity-matrix.md + .csv, 4 CPU ranks
    python -m easy_context check --matrix --families llama,mixtral --features base,moe_aux --world 2 --out /tmp/m

Every supported family (``easy_context.families``) as a tiny random float32 model built from its transformers
config class (2 layers, 8 q / 4 kv heads of head_dim 8, so Ulysses and USP split the heads over 4 ranks), every
sequence-parallel mode on ``--world`` ranks (sp = world; usp_attn as ring 2 x ulysses world/2), and one feature at
a time. Each cell is the largest relative error ||sp - ref|| / ||ref|| over the logits, the loss and every
gradient against one process on the full rows (``rank.py``'s check); PASS when <= the tolerance (1e-5, float32).
Combinations known to be wrong or meaningless are refused while the cases are planned, with the reason, and never
run. All cases run in ONE spawn of the ranks (the imports are paid once).
"""
from __future__ import annotations

import csv
import io
import os
import platform
import time

from .case import RTOL_FP32, Case

from ...registry import SEQ_ALGOS, get_mode

SP_MODES = tuple(n for n in SEQ_ALGOS if get_mode(n).is_parallel)  # the built-in sp modes
FEATURES = {  # name -> what the row checks
    "base": "plain rows (causal attention over the whole row)",
    "packed": "packed documents (position_ids restart at 0; the reference runs each document alone)",
    "window": "sliding window of 8 tokens on 32-token rows (the family's own window setting)",
    "lora": "LoRA rank 4 on every linear layer (PEFT, applied after the sp patch as train.py does; B non-zero)",
    "moe_aux": "MoE router load-balancing loss (coefficient 1) added to the loss (train.py's all-reduced form vs "
               "Hugging Face's aux_loss)",
    "rope_yarn": "RoPE scaling yarn, factor 4, original length 16 (train.py --rope-scaling yarn)",
    "rope_dynamic": "RoPE scaling dynamic NTK, factor 4",
    "heads": "attention blocks in 2 head groups over offloaded checkpoints (train.py --checkpointing offload "
             "--head-chunks 2; memory/head_chunks.py)",
}
SEQ_LEN, WINDOW = 32, 8
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
               head_dim=8, vocab_size=96, max_position_embeddings=256, rope_theta=50000.0, attention_dropout=0.0,
               tie_word_embeddings=False)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_NO_WINDOW = dict(use_sliding_window=False, sliding_window=None)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
TINY = {  # family -> (transformers config class, its settings)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", _NO_WINDOW),
    "qwen3": ("Qwen3Config", _NO_WINDOW),
    "mixtral": ("MixtralConfig", {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {**_MOE, **_NO_WINDOW, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", {**_MOE, **_NO_WINDOW}),
    "phi3": ("Phi3Config", _IDS),
    "olmo2": ("Olmo2Config", _IDS),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 4096, "query_pre_attn_scalar": 8, "rope_local_base_freq": 1e4,
                                    "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}),
}
_QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}
WINDOWED = {"mistral": {"sliding_window": WINDOW}, "mixtral": {"sliding_window": WINDOW},
            "phi3": {"sliding_window": WINDOW}, "gemma3": {"sliding_window": WINDOW},
            "qwen2": _QWEN_WINDOW, "qwen3": _QWEN_WINDOW, "qwen3_moe": _QWEN_WINDOW,
            "qwen2_moe": {**_QWEN_WINDOW, "max_window_layers": 1}}  # its layers below max_window_layers slide


class Refused(Exception):
    """A combination known to be wrong or meaningless: reported with the reason, never run."""


def tiny_config(family: str, feature: str):
    import transformers as tf
    cls, kw = TINY[family]
    if feature == "window":
        if family not in WINDOWED:
            raise Refused(f"{family} has no sliding-window attention")
        kw = {**kw, **WINDOWED[family]}
    return getattr(tf, cls)(**{**_COMMON, **kw})


def plan_cell(family: str, mode: str, feature: str, world: int, seed: int = 0) -> Case:
    """The Case of one cell, or Refused with the reason (nothing has been spawned)."""
    from easy_context.errors import UsageError
    from easy_context.hf.config import check_rope_for_sp, set_rope_scaling
    from easy_context.parallel_layout import ParallelLayout

    from ...hf.config import sliding_window
    config = tiny_config(family, feature)
    if feature == "window" and sliding_window(config) != WINDOW:
        raise Refused(f"{family}'s config does not apply the window")
    moe = bool(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None))
    if feature == "moe_aux" and not moe:
        raise Refused("dense model: no router, no load-balancing loss")
    if feature == "heads":
        from easy_context.families import FAMILIES
        from easy_context.memory.head_chunks import CHUNKABLE
        if FAMILIES[family].attention not in CHUNKABLE:
            raise Refused(f"{FAMILIES[family].attention}: its projections or q/k norms are not per head "
                          "(head_chunks refuses it)")
    try:
        if feature.startswith("rope_"):
            set_rope_scaling(config, feature[5:], 4.0, 16)
            check_rope_for_sp(config, mode)
    except UsageError as e:
        raise Refused(str(e).replace(f"--parallel_mode {mode}", "a sequence-parallel mode")) from None
    hybrid = get_mode(mode).hybrid  # ring x ulysses: a real 2 x 2 split from 4 ranks
    ring = (2 if world >= 4 else world) if hybrid else None
    layout = ParallelLayout.build(mode, sp_size=world, ring_degree=ring, world_size=world)
    try:
        layout.check_heads(config.num_attention_heads, config.num_key_value_heads)
        layout.check_seq_len(SEQ_LEN)
    except ValueError as e:
        raise Refused(str(e).splitlines()[0]) from None
    config.use_cache = False
    return Case(mode=mode, sp=world, ring=ring, ring_run=ring, config=config, seq_len=SEQ_LEN, batch=2,
                packed=feature == "packed", seed=seed, lora=4 if feature == "lora" else 0,
                moe_aux=1.0 if feature == "moe_aux" else 0.0, head_chunks=2 if feature == "heads" else 1)


def measure(outcome: dict) -> dict:
    """One cell's numbers from a run_cases outcome: max relative error and its parts, or the error."""
    if outcome["error"] is not None:
        rank, tb = outcome["error"]
        last = [ln for ln in tb.strip().splitlines() if ln.strip()][-1]
        return {"status": "error", "detail": f"rank {rank}: {last}"}
    rel = {"logits": 0.0, "loss": 0.0, "grads": 0.0}
    for r in outcome["results"]:
        rel["logits"] = max(rel["logits"], r["logits"]["rel"])
        rel["loss"] = max(rel["loss"], r["loss"]["rel"])
        rel["grads"] = max([rel["grads"]] + [d["rel"] for d in r["grads"].values()])
    return {"status": "measured", "max_rel": max(rel.values()), **rel}


def run_matrix(families, modes, features, world: int, rtol: float = RTOL_FP32, timeout: float = 3600.0) -> list[dict]:
    """Plan every cell (refusals first), run the rest in one spawn, return one row per cell."""
    from .spawn import run_cases
    rows, cases = [], []
    for feature in features:
        for family in families:
            for mode in modes:
                row = {"feature": feature, "family": family, "mode": mode}
                try:
                    cases.append(plan_cell(family, mode, feature, world))
                    row["case"] = len(cases) - 1
                except Refused as e:
                    row.update(status="refused", detail=" ".join(str(e).split()))
                rows.append(row)
    outcomes = run_cases(cases, world, timeout=timeout) if cases else []
    for row in rows:
        if "case" in row:
            row.update(measure(outcomes[row.pop("case")]))
            if row["status"] == "measured":
                row["status"] = "pass" if row["max_rel"] <= rtol else "FAIL"
    return rows


# ---------------------------------------------------------------------------------------------- the table
def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    cols = ["feature", "family", "mode", "status", "max_rel", "logits", "loss", "grads", "detail"]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{r[k]:.3e}" if isinstance(r.get(k), float) else r.get(k, "")) for k in cols})
    return buf.getvalue()


def to_markdown(rows: list[dict], world: int, rtol: float, seconds: float, command: str) -> str:
    import torch
    import transformers
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    notes: dict[str, str] = {}

    def cell(r):
        if r["status"] in ("pass", "FAIL"):
            return f"{r['max_rel']:.1e}" if r["status"] == "pass" else f"**FAIL {r['max_rel']:.1e}**"
        if r["status"] == "error":
            return f"**error**: {r['detail'][:80]}"
        key = notes.setdefault(r["detail"], f"r{len(notes) + 1}")
        return f"refused [{key}]"
    n = {s: sum(r["status"] == s for r in rows) for s in ("pass", "FAIL", "error", "refused")}
    out = ["# Parity matrix: sequence parallelism vs one process",
           "",
           f"Generated by `{command}` ({time.strftime('%Y-%m-%d')}; torch {torch.__version__}, transformers "
           f"{transformers.__version__}, Python {platform.python_version()}, CPU gloo, {world} ranks, float32, "
           f"{seconds:.0f} s). Do not edit by hand: rerun the command.",
           "",
           f"Each cell: the largest relative error ||sp - ref|| / ||ref|| over the logits, the token-mean loss and "
           f"every parameter gradient (summed over the sp group), against the same tiny random model (2 layers, "
           f"8 q / 4 kv heads, head_dim 8) run by one process on the full rows (each packed document alone); pass "
           f"<= {rtol:g}. sp = {world} ranks; usp_attn = ring 2 x ulysses {max(1, world // 2)}. Rows of 2 x "
           f"{SEQ_LEN} tokens. `refused [rN]`: known wrong or meaningless, refused before any rank starts (reasons "
           "below), never run.",
           "",
           f"**{n['pass']} pass, {n['FAIL']} fail, {n['error']} errors, {n['refused']} refused** "
           f"(machine-readable: `parity-matrix.csv`).", ""]
    for feature in dict.fromkeys(r["feature"] for r in rows):
        out += [f"## {feature}: {FEATURES[feature]}", "", "| family | " + " | ".join(modes) + " |",
                "|---" * (len(modes) + 1) + "|"]
        for family in dict.fromkeys(r["family"] for r in rows if r["feature"] == feature):
            cells = {r["mode"]: cell(r) for r in rows if r["feature"] == feature and r["family"] == family}
            out.append(f"| {family} | " + " | ".join(cells.get(m, "") for m in modes) + " |")
        out.append("")
    if notes:
        out += ["## Refusals", ""] + [f"- **{k}**: {reason}" for reason, k in notes.items()] + [""]
    return "\n".join(out)


def main_matrix(args) -> int:
    """``check --matrix``: plan, run, write ``OUT.md`` and ``OUT.csv``; exit 0 when no cell fails."""
    from easy_context.families import FAMILIES

    from .case import CheckUsageError
    def pick(text, known):
        return list(known) if text is None else [x.strip() for x in text.split(",") if x.strip()]
    # hybrid families (recurrent layers) have their own equivalence tests (tests/test_hybrid*.py, docs/hybrid.md)
    default_families = [f for f in FAMILIES if f in TINY]
    families, modes, features = (pick(args.families, default_families), pick(args.modes, SP_MODES),
                                 pick(args.features, FEATURES))
    for chosen, known, flag in ((families, TINY, "--families"), (modes, SP_MODES, "--modes"),
                                (features, FEATURES, "--features")):
        bad = [x for x in chosen if x not in known]
        if bad or not chosen:
            raise CheckUsageError(f"{flag}: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(known)}")
    if args.world < 2:
        raise CheckUsageError(f"--world must be >= 2 for the matrix; got {args.world}")
    t0 = time.monotonic()
    rows = run_matrix(families, modes, features, args.world, args.rtol, timeout=args.timeout)
    seconds = time.monotonic() - t0
    command = "python -m easy_context check --matrix" + "".join(
        f" --{k} {v}" for k, v in (("world", args.world if args.world != 4 else None), ("families", args.families),
                                    ("modes", args.modes), ("features", args.features)) if v)
    base = args.out
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    for ext, text in ((".md", to_markdown(rows, args.world, args.rtol, seconds, command)), (".csv", to_csv(rows))):
        tmp = f"{base}{ext}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, base + ext)
    bad = [r for r in rows if r["status"] in ("FAIL", "error")]
    n = {s: sum(r["status"] == s for r in rows) for s in ("pass", "refused")}
    print(f"parity matrix: {n['pass']} pass, {len(bad)} fail/error, {n['refused']} refused, {seconds:.0f} s -> "
          f"{base}.md, {base}.csv")
    for r in bad:
        print(f"  {r['status']}: {r['family']} {r['mode']} {r['feature']}: "
              f"{r.get('detail') or format(r['max_rel'], '.2e')}")
    return 1 if bad else 0
