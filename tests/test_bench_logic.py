"""The GPU benchmarks' schedule replays are exact (run on CPU in float32)."""
import pytest

from bench.bench_ring_sim import simulate


@pytest.mark.parametrize("mode", ["zigzag", "dist_flash"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_replayed_schedule_equals_full_attention(mode, world):
    r = simulate(mode, world, 32 * world, 2, 16, 1, device="cpu")
    assert float(r["err"]) < 1e-5, r


def test_train_step_bench_paths_agree_on_cpu():
    """bench_train_step's two configurations (plain HF vs ours) give the same loss and grads."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "bench/bench_train_step.py", "--tiny"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "cpu smoke" in r.stdout


@pytest.mark.parametrize("flags", [["--auto"], pytest.param(["--head-chunks", "2", "--layers", "1"],
                                                              marks=pytest.mark.slow)])  # --auto picks head groups too
def test_memory_bench_code_paths_run_on_cpu(flags):
    """bench_memory.py --tiny: every implementation and length of the GPU bench runs (--auto: the budgets' choice;
    --head-chunks: attention blocks in head groups, recorded in the rows; --layers: a shallower model), so a device
    session does not find a broken path."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "bench/bench_memory.py", "--tiny", *flags], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "longest length reached: {'hf': 512, 'ours': 1024, 'probe': 2048}" in r.stdout, r.stdout[-2000:]
    if "--head-chunks" in flags:  # one layer (--layers 1): k=2 at 1024 tokens
        assert "| ours | 1024 | 2 |  | 2 | ok |" in r.stdout and "layers: 1" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
def test_qwen35_census_sees_the_norms_lean_norms_remove():
    """bench/trace_memory_qwen35.py: with HF's (1 + w) norms their fp32 copies are live at the peak; lean, none."""
    import subprocess
    import sys
    out = {}
    for flag in ("--lean-norm", "--no-lean-norm"):
        r = subprocess.run([sys.executable, "bench/trace_memory_qwen35.py", "--length", "256", "--top", "40", flag],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        out[flag] = r.stdout
    assert "q_norm:_to_copy" in out["--no-lean-norm"], out["--no-lean-norm"]
    assert "norm:_to_copy" not in out["--lean-norm"], out["--lean-norm"]
    kb = {f: float(o.split(" MiB = ")[1].split(" KB/token")[0]) for f, o in out.items()}
    assert kb["--lean-norm"] < kb["--no-lean-norm"], kb


def test_storage_census_counts_live_bytes_at_the_peak():
    """bench/trace_memory.py's census: views are free, freed storages leave, the peak's live set is kept."""
    import torch
    from bench.trace_memory import StorageCensus
    w = torch.zeros(1000)  # exists before: a view of it costs nothing
    with StorageCensus(known=[w.untyped_storage().data_ptr()]) as c:
        a = torch.ones(256)             # 1024 B
        b = a.view(16, 16).t()          # view: no new storage
        tmp = torch.ones(512) * 2       # ones (2048 B, freed at once) + mul (2048 B)
        del tmp
        v = w[:10] + 0                  # 40 B
        big = torch.empty(0)            # zero bytes are not tracked
        del a, b
        after = sum(x[1] for x in c.live.values() if not x[0].expired())
    assert c.peak == 1024 + 2048 + 2048, c.peak
    assert sorted(n for _, n, _ in c.at_peak) == [1024, 2048, 2048]
    assert after == 40, after  # only v is still alive
    del v, big


def test_packed_bench_replay_is_exact_and_counts_less_work():
    """bench_packed's simulated packed ring (zigzag, k pairs and the dispatch) equals per-document attention; its
    work count shrinks, and is the same total work in every layout; the dispatch receives less kv than the ring."""
    from bench.bench_packed import count_only, simulate as packed_sim
    rows = packed_sim(4096, 4, 4, 32, 300, 1.0, 1, device="cpu", pairs=(1, 2), per_rank=(4,))
    assert [r["layout"] for r in rows] == ["8 chunks, k=1", "16 chunks, k=2", "dispatch 16 chunks, m=4"], rows
    assert all(float(r["err"]) < 1e-5 for r in rows), rows
    zz, fine, disp = count_only([8192], 4, 300, 1.0, (1, 4), per_rank=(4,))
    assert (zz["layout"], fine["layout"]) == ("8 chunks, k=1", "32 chunks, k=4"), (zz, fine)
    assert float(zz["work_vs_stream"]) < 0.5 and zz["work_vs_stream"] == fine["work_vs_stream"], (zz, fine)
    assert disp["work_vs_stream"] == zz["work_vs_stream"], disp
    assert float(disp["max_over_mean"]) <= float(fine["max_over_mean"]), (disp, fine)
    assert int(disp["kv_MB"].split("..")[1]) < int(zz["kv_MB"]), (disp, zz)


def test_windowed_dispatch_estimate_equals_the_kernel_pieces_and_beats_a_window_blind_plan(monkeypatch):
    """Every layer windowed (bench_packed --window): the dispatch's estimate (dispatch.segments.Estimate) counts the
    launches the kernels make (a document part longer than the window joins the windowed varlen run, or without
    VARLEN_WINDOW is a launch of its own that ends the run), so the solver's predicted rank times equal those of
    bench_packed's exact counts, both ways; a table planned with the window is faster than one planned blind to it;
    Window pieces count the elements their mask keeps."""
    from bench import bench_packed as B
    from easy_context.dispatch import plan as D
    from easy_context.kernels import documents as kd
    from easy_context.packing import Window, piece_mask
    for win, n, m in ((Window(5, 0, True), 12, 12), (Window(5, 7, False), 6, 9), (Window(30, 3, False), 4, 8)):
        assert B.window_elements(win, n, m) == int(piece_mask(win, n, m).sum()), win
    L, W, window = 16384, 8, 256
    fixed = (D.STEP_TIME_PER_TOKEN + D.TOKEN_TIME) * (L // W)

    def check(seed, m):
        lens = B.doc_lengths(L, 800, 1.5, seed)
        pos = B.positions(lens)
        d, plan = B.dispatch_layout(lens, L, W, m, window)
        exact = B.layout_counts(L, W, plan=plan)
        est = D.estimate(pos, d.cuts, d.owners, window=window)
        assert [c["dense"] for c in exact] == est.dense and [c["varlen"] for c in exact] == est.varlen, (seed, m)
        slow = max(B.predicted_ms(exact))
        assert slow == pytest.approx((max(est.time(D.STEP_TIME)) + fixed) * D.MS_PER_ELEM, rel=1e-3), (seed, m)
        return slow, d, pos, est
    new, blind = ([check(seed, m)[0] for seed in range(3)] for m in ("new", "blind"))
    assert all(a <= b * (1 + D.BALANCE_SLACK) for a, b in zip(new, blind)) and sum(blind) > 1.05 * sum(new), \
        (new, blind)
    _, d, pos, joined = check(0, "new")
    monkeypatch.setattr(kd, "VARLEN_WINDOW", {})  # no windowed varlen kernel: long parts are launches of their own
    split = D.estimate(pos, d.cuts, d.owners, window=window)
    assert sum(split.dense) > sum(joined.dense), (split.dense, joined.dense)
    check(0, "new")  # and the estimate still equals the kernels' counts


def test_balance_study_mirrored_pairs_balance_one_stream():
    """One causal stream: zigzag's mirrored pairs are exactly balanced; packed rows are not, greedy helps."""
    from bench import bench_packed
    from bench.bench_packed import balance_study
    orig = bench_packed.doc_lengths
    try:
        bench_packed.doc_lengths = lambda total, *a, **k: [total]
        for r in balance_study([4096], 4, 1500, 1.5):
            assert r["mirrored_max_over_mean"] == "1.000", r
    finally:
        bench_packed.doc_lengths = orig
    rows = balance_study([65536], 4, 1500, 1.5, per_rank=(4,))
    assert float(rows[0]["greedy_max_over_mean"]) <= float(rows[0]["mirrored_max_over_mean"]), rows


def test_m512_runs_groups_runs_and_takes_the_median(tmp_path, capsys):
    """bench/m512_runs.py: --repeat rows give every run, other lengths / failed rows are ignored, runs of different
    options are not pooled, and the verdict uses the median."""
    import json
    from bench.m512_runs import main
    env = "NVIDIA H200, torch 2.11.0+cu130, transformers 5.17.0, 2026-12-0{}"
    rows = [dict(impl="ours", L=524288, k=2, sel=15, heads=8, status="ok", secs=530.0, runs_s=[530.0, 560.0])]
    (tmp_path / "a.json").write_text(json.dumps(dict(env=env.format(6), args={}, rows=rows)))
    rows = [dict(impl="ours", L=524288, k=2, sel=15, heads=8, status="ok", secs=520.0),
            dict(impl="ours", L=131072, k=1, status="ok", secs=40.0),
            dict(impl="ours", L=524288, k=2, status="failed (OOM)")]
    (tmp_path / "b.json").write_text(json.dumps(dict(env=env.format(7), args={}, rows=rows)))
    rows = [dict(impl="ours", L=524288, k=2, sel=7, status="ok", secs=593.5)]
    (tmp_path / "c.json").write_text(json.dumps(dict(env=env.format(3), args={}, rows=rows)))
    main([str(tmp_path / n) for n in ("a.json", "b.json", "c.json")])
    out = capsys.readouterr().out
    assert "k=2 sel=15 heads=8 [NVIDIA H200, torch 2.11.0+cu130, transformers 5.17.0]: 3 run(s), min 520.0 s, " \
           "median 530.0 s, max 560.0 s; target 540 s: met" in out, out
    assert "k=2 sel=7 heads=1" in out and "1 run(s)" in out and "needs 2 more" in out, out
    with pytest.raises(SystemExit, match="no 512K run"):
        main([str(tmp_path / "c.json"), "--since", "2026-12-05"])


def test_memory_bench_retries_an_auto_oom_with_a_wider_margin(monkeypatch):
    """bench_memory.py --auto: a step that runs out of memory is chosen again with a wider margin and re-run (so a
    512K device session is not lost to one OOM); without --auto, or with no time left, it is not."""
    import argparse
    from bench import bench_memory
    margins = []

    def measure(model, impl, L, args, device, opt=False):
        margins.append(args.auto_margin)
        return dict(impl=impl, L=L, status="OOM" if len(margins) < 3 else "ok", secs=5.0)
    monkeypatch.setattr(bench_memory, "measure", measure)
    args = argparse.Namespace(auto=True, auto_retries=3, auto_margin=0.06, tiny=False)
    row = bench_memory.measure_or_retry(None, "ours", 524288, args, None, left=lambda: 100.0)
    assert margins == [0.06, 0.1, 0.14] and row["status"] == "ok" and row["auto_margin"] == 0.14, (margins, row)
    margins.clear()
    args = argparse.Namespace(auto=True, auto_retries=3, auto_margin=0.06, tiny=False)
    row = bench_memory.measure_or_retry(None, "ours", 524288, args, None, left=lambda: 1.0)  # no time for another
    assert margins == [0.06] and row["status"] == "OOM"
    margins.clear()
    args = argparse.Namespace(auto=False, auto_retries=3, auto_margin=0.06, tiny=False)
    assert bench_memory.measure_or_retry(None, "ours", 524288, args, None, left=lambda: 100.0)["status"] == "OOM"
    assert margins == [0.06]


def test_h200_script_parses_and_documents_every_command():
    """bench/h200_fa4.sh (what a device session runs): valid bash, and every command it accepts is in its header
    and in its usage line, so a session does not spend device time on a typo or an undocumented command."""
    import re
    import subprocess
    path = "bench/h200_fa4.sh"
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    text = open(path).read()
    labels = re.findall(r"^  ([a-z0-9-]+)\)", text, flags=re.M)
    usage = next(line for line in text.splitlines() if "usage:" in line)
    assert "m512-wait" in labels and "calibrate" in labels
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert len(labels) > 10
    for name in labels:
        assert re.search(rf"\b{re.escape(name)}\b", usage), f"{name} missing from the usage line"
        assert f"h200_fa4.sh {name}" in header, f"{name} missing from the header"
