"""bench/packed_fit.py (bench_packed.py --fit: ``fit_report``): the time model's constants come back from synthetic per-rank times."""
import json

import numpy as np

from bench import packed_fit


def _rows(consts, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for L in (131072, 524288):
        for layout in range(6):
            ring = layout < 2
            ranks = []
            for _ in range(8):
                c = dict(causal=float(rng.uniform(5e6, 2e9) * L / 131072), rect=float(rng.uniform(1e6, 1e9)),
                         pieces=int(rng.integers(4, 50)), launches=3, dense=int(rng.integers(1, 30)),
                         varlen=int(rng.integers(0, 3)), steps=int(rng.integers(1, 9)), ring=ring,
                         tokens=L // 8)
                f = dict(zip(packed_fit.FEATURES, packed_fit.features(c)))
                c["ms"] = sum(consts[k] * f[k] for k in consts) * (1 + noise * rng.standard_normal())
                ranks.append(c)
            rows.append(dict(L=L, layout=f"layout {layout}", ranks=ranks))
    return rows


def test_fit_recovers_constants(tmp_path, capsys):
    want = dict(Melem=0.097, pieces=0.3, extra_steps=0.1, ring_step_16K=0.9, tokens_16K=0.2)
    path = tmp_path / "bench_packed.json"
    path.write_text(json.dumps(dict(rows=_rows(want))))
    from bench.bench_packed import fit_report
    got = fit_report(str(path))
    for k, v in want.items():
        assert abs(got[k] - v) < 1e-6 * max(v, 1), (k, got[k], v)
    assert "|rel err|" in capsys.readouterr().out
    got, res = packed_fit.fit(_rows(want, noise=0.02))  # 96 noisy points: within a few % of the truth
    assert abs(got["Melem"] / want["Melem"] - 1) < 0.05 and abs(got["pieces"] / want["pieces"] - 1) < 0.2
    assert len(res) == 96


def test_fit_from_slowest_and_mean_only():
    want = dict(Melem=0.097, pieces=0.3, extra_steps=0.1, ring_step_16K=0.9, tokens_16K=0.2)
    rows = _rows(want)
    for r in rows:  # an older run: layout-level numbers only
        ms = [c.pop("ms") for c in r["ranks"]]
        r.update(slowest_rank_ms=max(ms), max_over_mean=max(ms) / np.mean(ms))
    got, res = packed_fit.fit(rows)
    assert len(res) == 2 * len(rows) and all(abs(float(x["rel_err"])) < 0.02 for x in res), res


def test_feature_study_tiles():
    """bench/packed_features.py's tile counts: a rectangle runs every tile, a causal square those on/below its
    diagonal (T(T+1)/2), a causal piece with more keys than rows (bottom-right aligned) the extra key tiles too."""
    from bench.bench_packed import tiles
    assert tiles(300, 200, False, 128, 128) == 3 * 2
    assert tiles(1024, 1024, True, 128, 128) == 8 * 9 // 2
    assert tiles(1024, 1024, True, 64, 128) == sum(i // 2 + 1 for i in range(16))
    assert tiles(128, 256, True, 128, 128) == 2
    assert tiles(100, 100, True, 128, 128) == 1


def test_calibration_constants_round_trip_and_restore():
    """bench/packed_calibrate.py: fitted constants (packed_fit units) map back onto dispatch/plan.py's exactly, and
    planning with them is scoped (constants and the table cache restored)."""
    from bench.packed_calibrate import model, to_dispatch
    from easy_context.dispatch import plan as D
    names = ("MS_PER_ELEM", "PIECE_TIME", "DENSE_TIME", "VARLEN_TIME", "STEP_TIME", "STEP_TIME_PER_TOKEN", "TOKEN_TIME")
    before = {n: getattr(D, n) for n in names}
    back = to_dispatch(packed_fit.current())
    for n in names:
        assert abs(back[n] - before[n]) <= 1e-9 * max(abs(before[n]), 1), n
    other = dict(packed_fit.current(), pieces=0.5, Melem=0.2)
    D._CACHE[("marker",)] = None
    with model(other):
        assert D.PIECE_TIME == 0.5 / (0.2 / 1e6) and D.MS_PER_ELEM == 0.2 / 1e6 and not D._CACHE
    assert {n: getattr(D, n) for n in names} == before and not D._CACHE


def test_calibration_bench_runs_on_cpu():
    """The code path of the GPU experiment at a tiny size (the current model's predictions stand in for timings):
    the fit recovers dispatch/plan.py's own constants, so both models pick the same deal."""
    from bench.packed_calibrate import run, to_dispatch
    from easy_context.dispatch import plan as D
    consts, fit, base, rows = run(4096, 4, 4, 32, [1], 1, 1, device="cpu", per_rank=("new", 2), median=300,
                                  sigma=1.0)
    assert fit["max_rel_err"] < 1e-6 and len(rows) == 2 and rows[0]["same_pick"]
    assert abs(to_dispatch(consts)["PIECE_TIME"] / D.PIECE_TIME - 1) < 1e-6


def test_calibration_pays_off_when_the_truth_differs():
    """The calibration experiment's logic without a GPU: per-rank "times" from a synthetic truth (a kernel piece 3x,
    a dense launch 0.3x dispatch/plan.py's), the model fitted on the seed-0 layouts, then new rows (seeds 1-3) dealt by
    dispatch/plan.py's constants and by the fit. Under the truth the fitted picks are never slower and faster on some."""
    from bench import bench_packed as B
    from bench.packed_calibrate import model
    L, W = 131072, 8
    truth = dict(packed_fit.current())
    truth["pieces"] *= 3
    truth["dense"] *= 0.3

    def true_max(plan):
        ranks = B.layout_counts(L, W, plan=plan)
        with model(truth):
            return max(B.predicted_ms(ranks)), ranks

    lens = B.doc_lengths(L, 1500, 1.5, 0)
    rows = []
    for m in ("old", "prev", "new", 2, 4, 8):
        _, ranks = true_max(B.dispatch_layout(lens, L, W, m)[1])
        with model(truth):
            for c, ms in zip(ranks, B.predicted_ms(ranks)):
                c["ms"] = ms
        rows.append(dict(L=L, layout=str(m), ranks=ranks))
    consts, res = packed_fit.fit(rows)
    assert max(abs(float(r["rel_err"])) for r in res) < 1e-6
    for k in ("Melem", "pieces", "dense", "extra_steps"):
        assert abs(consts[k] - truth[k]) < 1e-6 * max(truth[k], 1), k
    gains = []
    for seed in (1, 2, 3):
        lens = B.doc_lengths(L, 1500, 1.5, seed)
        plain = true_max(B.dispatch_layout(lens, L, W, "new")[1])[0]
        with model(consts):
            plan = B.dispatch_layout(lens, L, W, "new")[1]
        fitted = true_max(plan)[0]
        assert fitted <= plain * 1.001, (seed, fitted, plain)
        gains.append(plain / fitted)
    assert max(gains) > 1.01, gains


def test_balance_rule_holds_under_the_gpu_fitted_truths():
    """bench/packed_robust.py: priced under the model re-fitted on each H200 run (bench/results), dispatch.pick's
    balance rule brings the 128K rows of seeds 0-3 closer to balance than the fastest-predicted rule, for at most
    1% of the slowest rank on average."""
    from bench import packed_robust as R
    truth = R.truths(sorted(R.glob.glob(R.os.path.join(R.RESULTS, "h200_packed_*.json"))))
    assert len(truth) >= 5, sorted(truth)
    rows = R.study([131072], 8, [0, 1, 2, 3], 2.0, truth)
    by = {r["rule"]: r for r in R.summary(rows)}
    fast, bal = by["fastest"], by[f"balanced {R.D.BALANCE_SLACK:g}"]
    assert float(bal["max_over_mean_mean"]) < float(fast["max_over_mean_mean"]) - 0.01, (fast, bal)
    assert float(bal["regret_mean"]) < float(fast["regret_mean"]) + 0.01, (fast, bal)


def test_deeper_search_for_unbalanced_rows_is_faster_under_the_gpu_fitted_truths():
    """bench/packed_robust.py --deep: searching deeper for the rows the first search leaves unbalanced (the default,
    dispatch.deal_options) gives faster slowest ranks on the 128K rows of seeds 0-3 priced under each H200 run's
    fit, never more than 2% slower in one (row, fit) case, and as many picks <= 1.05 max/mean."""
    from bench import packed_robust as R
    truth = R.truths(sorted(R.glob.glob(R.os.path.join(R.RESULTS, "h200_packed_*.json"))))
    _, out = R.search_study([131072], 8, [0, 1, 2, 3], truth)
    by = {r["search"]: r for r in out}
    first, auto = by["first"], by["auto"]
    assert float(auto["vs_first_mean"]) < 0.97 and float(auto["vs_first_max"]) < 1.02, auto
    assert int(auto["within_5pct"].split("/")[0]) >= int(first["within_5pct"].split("/")[0]), (first, auto)
