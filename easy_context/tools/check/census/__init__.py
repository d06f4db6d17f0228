"""``python -m easy_context check --census`` (a part of ``check``): does every causal-LM family the installed transformers lists run
exactly under sequence parallelism, or is it refused by name? (issue #59)

    python -m easy_context check --census                          # docs/model-census.md + .csv
    python -m easy_context check --census --families llama,gpt_oss --modes zigzag_ring_attn --out /tmp/c

Files: ``tiny.py`` (a tiny model from a family's default config), ``run.py`` (screen in this process, run the rest
on gloo ranks, one spawn per mode, classify), ``rank.py`` (what a rank runs), ``report.py`` (markdown and csv).
"""
from __future__ import annotations

import os
import time

def default_modes() -> list[str]:
    """The census' modes: the default ring mode and the plain head all-to-all (asked of the Modes, not named)."""
    from ....registry import DEFAULT_MODE, SEQ_ALGOS, get_mode
    heads = next(n for n in SEQ_ALGOS if get_mode(n).ulysses and not get_mode(n).hybrid)
    return [DEFAULT_MODE, heads]


def all_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main_census(args) -> int:
    """``check --census``: run, write ``OUT.md`` / ``OUT.csv``; exit 1 when a cell is WRONG or CRASH."""
    from ..case import CheckUsageError
    from .report import counts, to_csv, to_markdown
    from .run import census
    known = all_families()
    families = known if args.families is None else [f.strip() for f in args.families.split(",") if f.strip()]
    modes = default_modes() if args.modes is None else [m.strip() for m in args.modes.split(",") if m.strip()]
    from easy_context.registry import mode_names
    for chosen, valid, flag in ((families, known, "--families"), (modes, mode_names(), "--modes")):
        bad = [x for x in chosen if x not in valid]
        if bad or not chosen:
            raise CheckUsageError(f"{flag}: unknown {', '.join(bad) or '(none given)'}; see "
                                  "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES / the registry's modes")
    t0 = time.monotonic()
    rows = census(families, modes, packed=not getattr(args, "no_packed", False), world=args.world,
                  timeout=args.timeout)
    seconds = time.monotonic() - t0
    command = "python -m easy_context check --census" + "".join(
        f" --{k} {v}" for k, v in (("families", args.families), ("modes", args.modes)) if v)
    base = args.out if args.out != "docs/parity-matrix" else "docs/model-census"
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    for ext, text in ((".md", to_markdown(rows, args.world, seconds, command)), (".csv", to_csv(rows))):
        with open(f"{base}{ext}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{base}{ext}.tmp", base + ext)
    n = counts(rows)
    print(f"model census: {n['exact']} exact, {n['refused']} refused, {n['not buildable']} not buildable, "
          f"{n['WRONG']} WRONG, {n['CRASH']} CRASH cells, {seconds:.0f} s -> {base}.md, {base}.csv")
    for r in rows:
        if r["status"] in ("WRONG", "CRASH"):
            print(f"  {r['status']}: {r['family']} {r['mode']} {r['rows']}: "
                  f"{r.get('max_rel', '')} {r.get('detail', '')}"[:300])
    return 1 if n["WRONG"] or n["CRASH"] else 0


__all__ = ["main_census", "all_families", "default_modes"]
