"""Re-fit dispatch/plan.py's rank-time model from bench_packed.py's JSON (``python bench/bench_packed.py --fit FILE``).

Each layout row of the JSON carries ``ranks``: per rank its counts (``causal`` / ``rect`` score elements, causal
halved; ``pieces``; ``launches``; ``steps``; ``tokens`` local; ``ring``: the fixed ring, whose every step makes
full-size passes) and, from a GPU run, ``ms`` (that rank's measured fwd+bwd). Rows with per-rank ``ms`` are fitted
point by point; rows with only ``slowest_rank_ms`` / ``max_over_mean`` (older runs) contribute their slowest and
mean rank (the slowest taken as the one the current fit predicts slowest, iterated). Least squares on relative
errors, so 20 ms and 300 ms layouts weigh alike.
"""
from __future__ import annotations


import numpy as np

# features, in units that keep the constants readable: ms per million elements, per piece, per 16K tokens
FEATURES = ("Melem", "Melem_causal", "Melem_rect", "pieces", "dense", "varlen", "extra_steps", "ring_step_16K",
            "tokens_16K")
# dispatch/plan.py's model: one rate for all score elements (Melem_causal / Melem_rect split it, for a --fit-features try),
# FA4 launches by kind (dense, varlen) and per piece
MODEL = ("Melem", "pieces", "dense", "varlen", "extra_steps", "ring_step_16K", "tokens_16K")


def features(c: dict) -> list[float]:
    """The model's regressors of one rank's counts (see the module doc)."""
    k = c["tokens"] / 16384
    extra = 0 if c["ring"] else c["steps"] - 1
    # the ring pays a full-size pass per step; the dispatch one (accumulator init + cast), then its pieces only
    passes = c["steps"] if c["ring"] else 1
    return [(c["causal"] + c["rect"]) / 1e6, c["causal"] / 1e6, c["rect"] / 1e6, c["pieces"], c["dense"],
            c["varlen"], extra, passes * k, k]


def _solve(x, y, use):
    """Relative-error least squares; a constant fitted negative (unphysical: features correlate, e.g. steps with
    pieces) is fixed at 0 and the rest re-fitted."""
    w, use = 1.0 / y, list(use)
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, use] * w[:, None], np.ones_like(y), rcond=None)
        coef[use] = sol
        if sol.min() >= 0:
            return coef
        use.remove(use[int(np.argmin(sol))])


def current() -> dict:
    """dispatch.py's constants in FEATURES units (ms per unit)."""
    from easy_context.dispatch import plan as D
    k = 16384 * D.MS_PER_ELEM
    return dict(Melem=D.MS_PER_ELEM * 1e6, pieces=D.PIECE_TIME * D.MS_PER_ELEM, dense=D.DENSE_TIME * D.MS_PER_ELEM,
                varlen=D.VARLEN_TIME * D.MS_PER_ELEM, extra_steps=D.STEP_TIME * D.MS_PER_ELEM,
                ring_step_16K=D.STEP_TIME_PER_TOKEN * k, tokens_16K=D.TOKEN_TIME * k)


def fit(rows: list[dict], use=MODEL, iters: int = 5, fixed: dict | None = None) -> tuple[dict, list[dict]]:
    """(constants by feature name, residual per fitted point) from bench_packed rows (see the module doc)."""
    cols = [FEATURES.index(f) for f in use]
    per_rank = [r for r in rows if r.get("ranks") and all("ms" in c for c in r["ranks"])]
    summary = [r for r in rows if r.get("ranks") and r not in per_rank and "slowest_rank_ms" in r]
    if not per_rank and not summary:
        raise SystemExit("--fit: no row with per-rank counts ('ranks') and times; run bench_packed.py on a GPU "
                         "with $OUT set to get them")
    pts = [(np.array(features(c)), float(c["ms"]), f"{r['L']} {r['layout']} rank {i}")
           for r in per_rank for i, c in enumerate(r["ranks"])]
    coef = np.full(len(FEATURES), 0.0)
    for _ in range(iters if summary else 1):
        extra = []
        for r in summary:
            f = np.array([features(c) for c in r["ranks"]])
            slow, mm = float(r["slowest_rank_ms"]), float(r["max_over_mean"])
            top = int(np.argmax(f @ coef)) if coef.any() else int(np.argmax(f[:, 0]))
            extra += [(f[top], slow, f"{r['L']} {r['layout']} slowest"),
                      (f.mean(0), slow / mm, f"{r['L']} {r['layout']} mean")]
        allp = pts + extra
        x = np.array([p[0] for p in allp])
        y = np.array([p[1] for p in allp])
        coef = _solve(x, y, cols) if fixed is None else np.array([fixed.get(n, 0.0) for n in FEATURES])
    res = [dict(point=name, measured_ms=round(ms, 2), fitted_ms=round(float(f @ coef), 2),
                rel_err=f"{float(f @ coef) / ms - 1:+.3f}") for f, ms, name in allp]
    return {n: float(c) for n, c in zip(FEATURES, coef)}, res
