"""Packed documents under the zigzag ring: attention time with document masking + block skipping vs the same
row as one causal stream, and the load balance across ranks (simulated ring on one GPU, like bench_ring_sim).

    python bench/bench_packed.py [--lengths 131072 524288] [--world 8] [--median 1500] [--sigma 1.5]
    python bench/bench_packed.py --count        # CPU: score elements per rank only (no kernels, no GPU)
    python bench/bench_packed.py --check        # CPU: the simulation's code path at a tiny size (smoke test)
    python bench/bench_packed.py --per-rank 4 8 # also time the old solver's deals of 4 and 8 chunks per rank
                                                # (always: the old solver's pick and the new default pick)
    python bench/bench_packed.py --seeds 0 2 3 5  # more rows (seeds of the document lengths; default 0)
    python bench/bench_packed.py --window 4096  # every layer windowed: picks planned with / without the window

Rows are filled with documents whose lengths are drawn from a log-normal distribution (median 1500 tokens,
sigma 1.5: mean ~4.6K, a long tail of 30K+ documents; clipped to [16, L]; the last document is cut at the row
end), seed 0 unless ``--seeds``. Each rank's work is exactly what ``zigzag_ring_forward``/``backward`` run: per
ring step the facade call on (its q rows, the visiting kv rows) with the packed documents — pieces the mask removes
cost nothing, diagonal runs of documents go to one varlen launch (FA4) — plus the fp32 LSE merges. Reported:
Σ rank time (packed) / Σ rank time (the same row as one causal stream), max/mean rank time, and the packed
output's error against per-document attention on the full row.

Two layouts of the packed row: plain zigzag (2W chunks) and what the ring runs for packed rows, zigzag with k
mirrored pairs per rank (2Wk chunks, k = ``sharding.zigzag_pairs(L, W)``, the default before issue #28); pieces =
dense kernel calls a rank's ring makes (diagonal runs of >= 4 documents are one varlen launch with FA4, counted here
per document). And the cost-balanced dispatch (easy_context/dispatch/plan.py, the default for packed rows now): W*m chunks
dealt by the solver, each rank's q rows against only the kv chunks they need, received point to point
(dispatch/ring.py). ``kv_MB`` = kv bytes a rank receives in one fwd+bwd (k, v in bf16 twice, dk/dv once: fp32 on
the ring, bf16 under the dispatch), min..max over ranks; ``vs_default`` = the default k-pair layout's slowest-rank time / this layout's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench import packed_fit  # noqa: E402
from bench.common import cuda_time_ms, env_line, table  # noqa: E402
from easy_context import kernels, packing  # noqa: E402
from bench.dispatch_solvers import plan_dispatch, rank_ms  # noqa: E402
from easy_context.dispatch.ring import DispatchPlan  # noqa: E402
from easy_context.sharding import pairs_shard, pairs_unshard, zigzag_pairs  # noqa: E402
from easy_context.zigzag_ring_attn.attention import ring_steps  # noqa: E402


def doc_lengths(total: int, median: float, sigma: float, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out, used = [], 0
    while used < total:
        n = int(math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item()))
        n = max(16, min(n, total - used))
        out.append(n)
        used += n
    return out


def positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def rank_blocks(rank, world, L, docs, pairs=1):
    """(q local slice, src, kv local slice, causal, BlockDocs or None) of every ring step of ``rank``: exactly
    ``zigzag_ring_forward``'s steps (``ring_steps``) in the layout with ``pairs`` mirrored pairs per rank."""
    return [(st.qs, st.src, st.ks, st.causal, st.docs)
            for st in ring_steps(rank, world, L // world, docs, pairs=pairs if docs is not None else None)]


def _len(sl, n):
    return len(range(*sl.indices(n)))


def rank_counts(blocks, L, world) -> dict:
    """One rank's forward counts: score elements of causal pieces (halved) and of rectangles, kernel pieces, launches
    with FA4's varlen grouping (the time model's regressors, bench/packed_fit.py)."""
    n_loc = L // world
    out = dict(causal=0, rect=0, pieces=0, launches=0, dense=0, varlen=0)
    for qs, _, ks, causal, bd in blocks:
        if bd is None:
            n = _len(qs, n_loc) * _len(ks, n_loc)
            out["causal" if causal else "rect"] += n // 2 if causal else n
            out["pieces"] += 1
            out["launches"] += 1
            out["dense"] += 1
        else:
            for pq, pk, pc in bd.pieces():
                if isinstance(pc, packing.Window):  # a sliding-window piece: the keys its rows keep
                    n = window_elements(pc, pq.stop - pq.start, pk.stop - pk.start)
                    out["causal" if pc.causal else "rect"] += n
                else:
                    n = (pq.stop - pq.start) * (pk.stop - pk.start)
                    out["causal" if pc else "rect"] += n // 2 if pc else n
                out["pieces"] += 1
            for kind, _ in kernels._group("fa4", bd.pieces()):
                out["launches"] += 1
                out["dense" if kind == "dense" else "varlen"] += 1  # diagonal runs and rectangles: varlen calls
    return out


def window_elements(win, n: int, m: int) -> int:
    """Kept (q, k) pairs of a ``packing.Window`` piece of n q rows and m keys (``packing.piece_mask``'s count)."""
    a = torch.arange(n)
    lo = (a + win.d - win.w + 1).clamp(min=0)
    hi = (a + win.d).clamp(max=m - 1) if win.causal else torch.full_like(a, m - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def score_elements(blocks, L, world) -> tuple[int, int, int]:
    """(attention score elements, kernel pieces, launches with FA4's varlen grouping) of a rank's forward
    (causal pieces count half)."""
    c = rank_counts(blocks, L, world)
    return c["causal"] + c["rect"], c["pieces"], c["launches"]


def layout_counts(L, world, docs=None, k=1, plan=None) -> list[dict]:
    """Per rank: ``rank_counts`` + ring steps, local tokens and whether the fixed ring runs it (full-size passes per
    step), for the k-pair ring layout of ``docs`` or the dispatch ``plan``."""
    out = []
    for r in range(world):
        if plan is None:
            blocks = rank_blocks(r, world, L, docs, k)
            c = rank_counts(blocks, L, world)
            c.update(steps=sum(1 for b in blocks if b[4].pieces()), ring=True)
        else:
            blocks = dispatch_blocks(r, plan)
            c = rank_counts([(slice(None), s, None, True, bd) for s, _, bd in blocks], L, world)
            c.update(steps=len(blocks), ring=False)
        c["tokens"] = L // world
        out.append(c)
    return out


def dispatch_blocks(rank, plan):
    """(src, rows of src's local kv it receives or None for all, BlockDocs) of every step ``rank`` computes under the
    dispatch: exactly ``dispatch_forward``'s steps (steps with nothing needed are skipped)."""
    w = plan.dispatch.world
    out = []
    for s in range(w):
        src = (rank - s) % w
        if s == 0 or plan.need[rank, src]:
            out.append((src, None if s == 0 else plan.local_rows(rank, src), plan.block(rank, src)))
    return out


def dispatch_layout(lens, L, world, per_rank=None, window=None):
    """(Dispatch, DispatchPlan) of the row of documents ``lens``. ``per_rank``: m equal chunks a rank (the old
    solver), "old" = the old solver's pick (equal chunks), "prev" = the first segment solver's pick (boundaries moved
    by work alone), "new" or None = plan_dispatch's default pick (by predicted rank time), "first" / "fastest" = its
    solvers of those names (without the deeper search / the balance rule either). ``window``: every layer's sliding
    window (the attention's documents are windowed; the picks are planned with it, "blind" = the default pick planned
    without it, as train.py did before ParallelLayout.dispatch_window)."""
    pos = positions(lens)
    if per_rank == "blind":
        d = plan_dispatch(pos, world)
    elif per_rank in ("new", None):
        d = plan_dispatch(pos, world, window)
    elif per_rank in ("fastest", "first"):
        d = plan_dispatch(pos, world, window, solver=per_rank)
    elif per_rank in ("old", "prev"):
        d = plan_dispatch(pos, world, window, solver="chunks" if per_rank == "old" else "work")
    else:
        d = plan_dispatch(pos, world, window, per_rank=per_rank, solver="chunks")
    docs = packing.documents(pos, window=window)
    docs.dispatch = d
    return d, DispatchPlan(docs, d)


def _dispatch_name(d, world, m):
    if m in ("new", None, "prev", "fastest", "first", "blind"):
        kind = {"prev": "work-balanced", "fastest": "fastest-predicted", "first": "first-search",
                "blind": "window-blind"}.get(m, "time-balanced")
        return f"dispatch {d.chunks} chunks, {kind} pick (<= {d.per_rank} a rank)"
    return f"dispatch {d.chunks} chunks, m={d.per_rank}" + (" (old pick)" if m == "old" else "")


def predicted_ms(ranks, before=False) -> list[float]:
    """Per-rank fwd+bwd ms of dispatch/plan.py's fitted time model from exact per-rank counts (``layout_counts``).
    ``before``: the dispatch as first measured, whose every step made full-size passes like the ring's."""
    return rank_ms([c["causal"] + c["rect"] for c in ranks], [c["pieces"] for c in ranks],
                   [c["steps"] for c in ranks], ranks[0]["tokens"], [c["dense"] for c in ranks],
                   [c["varlen"] for c in ranks], ring=before or ranks[0]["ring"])


def kv_mb(tokens_recv, heads, dim, dkv_tokens=None, dkv_bytes=2):
    """MB a rank receives in fwd+bwd: k and v (bf16) in the forward and again in the backward, dk/dv once (bf16 under
    the dispatch: each partial is added once at its owner; fp32 on the ring, which sums from hop to hop)."""
    dkv_tokens = tokens_recv if dkv_tokens is None else dkv_tokens
    return (2 * tokens_recv * 2 * heads * dim * 2 + dkv_tokens * 2 * heads * dim * dkv_bytes) / 1e6


def ring_kv_mb(L, world, heads, dim):
    """The ring's (zigzag / k pairs): W-1 visiting kv blocks of L/W rows, twice; dk/dv fp32 on W hops."""
    n = L // world
    return kv_mb((world - 1) * n, heads, dim, world * n, dkv_bytes=4)


def count_only(lengths_L, world, median, sigma, pairs=None, per_rank=("new",), heads=32, dim=128, seeds=(0,),
               window=None):
    """One row per (length, layout): plain zigzag and the k-pair layout the ring uses for packed rows (or the k
    values of ``pairs``), then the dispatch deals of ``per_rank`` (see ``dispatch_layout``), with the fitted time
    model's slowest-rank ms and max/mean of the predicted rank times (``pred_ms``, ``pred_mm``; ``pred_ms_before``:
    the dispatch as it was first measured), the ratio to the default k-pair layout (``pred_vs_default``) and the
    per-rank counts (``ranks``). ``seeds``: of the rows' document lengths, one set of rows each. ``window``: every
    layer's sliding window (see ``dispatch_layout``)."""
    rows = []
    for L, seed in ((L, seed) for L in lengths_L for seed in seeds):
        lens = doc_lengths(L, median, sigma, seed)
        docs = packing.documents(positions(lens), window=window)
        dense = sum(score_elements(rank_blocks(r, world, L, None), L, world)[0] for r in range(world))
        ks = sorted(set(pairs or (1, zigzag_pairs(L, world))))
        here = []

        def row(layout, ranks, kv):
            work = [c["causal"] + c["rect"] for c in ranks]
            ms = predicted_ms(ranks)
            rng = lambda key: f"{min(c[key] for c in ranks)}..{max(c[key] for c in ranks)}"  # noqa: E731
            return dict(L=L, W=world, seed=seed, window=window, layout=layout, docs=len(lens),
                        mean_doc=f"{L / len(lens):.0f}",
                        max_doc=max(lens), work_vs_stream=f"{sum(work) / dense:.3f}",
                        max_over_mean=f"{max(work) / (sum(work) / world):.3f}",
                        rank_Melems=f"{min(work) / 1e6:.0f}..{max(work) / 1e6:.0f}",
                        pieces_per_rank=rng("pieces"), steps=rng("steps"), fa4_launches=rng("launches"), kv_MB=kv,
                        pred_ms=f"{max(ms):.1f}", pred_mm=f"{max(ms) / (sum(ms) / world):.3f}",
                        pred_ms_before=f"{max(predicted_ms(ranks, before=True)):.1f}", _ms=max(ms), ranks=ranks)
        for k in ks:
            here.append(row(f"{2 * world * k} chunks, k={k}", layout_counts(L, world, docs, k),
                            f"{ring_kv_mb(L, world, heads, dim):.0f}"))
        default = here[ks.index(zigzag_pairs(L, world))]["_ms"] if zigzag_pairs(L, world) in ks else None
        seen = set()
        for m in per_rank:
            d, plan = dispatch_layout(lens, L, world, m, window)
            if d in seen:
                continue
            seen.add(d)
            mb = [kv_mb(plan.received_tokens(r), heads, dim) for r in range(world)]
            here.append(row(_dispatch_name(d, world, m), layout_counts(L, world, plan=plan),
                            f"{min(mb):.0f}..{max(mb):.0f}"))
        for r in here:
            r["pred_vs_default"] = f"{default / r.pop('_ms'):.2f}x" if default else ""
        rows += here
    return rows


def balance_study(lengths_L, world, median, sigma, per_rank=(1, 2, 4, 8)):
    """What a finer, cost-aware split would give (a design study; not what the ring runs today): the row cut into
    2W·k equal chunks, a rank's work = sum over its q tokens of the keys they attend to (position in document + 1,
    which is what a ring computes for its q rows); chunks dealt as mirrored pairs (zigzag's rule, k pairs a rank)
    vs greedily by cost (largest first to the least-loaded rank)."""
    rows = []
    for L in lengths_L:
        cost = positions(doc_lengths(L, median, sigma))[0].double() + 1
        for k in per_rank:
            n = 2 * world * k
            if L % n:
                continue
            c = cost.view(n, -1).sum(1)
            mirrored = torch.zeros(world, dtype=torch.float64)
            for i in range(n // 2):
                mirrored[i % world] += c[i] + c[n - 1 - i]
            greedy = torch.zeros(world, dtype=torch.float64)
            for v in sorted(c.tolist(), reverse=True):
                greedy[greedy.argmin()] += v
            rows.append(dict(L=L, W=world, chunks=n, mirrored_max_over_mean=f"{float(mirrored.max() / mirrored.mean()):.3f}",
                             greedy_max_over_mean=f"{float(greedy.max() / greedy.mean()):.3f}"))
    return rows


def simulate(L, world, heads, dim, median, sigma, iters, device="cuda", pairs=None, per_rank=(None,), rounds=1,
             seed=0, window=None):
    """Time every rank's ring work (fwd + bwd) for the packed row in each layout of ``pairs`` (k values; default
    plain zigzag and ``zigzag_pairs(L, world)``; () for none), under the dispatch with each ``per_rank`` (None: the
    cost model's pick; () for none), and for the same row as one causal stream: one row per layout. ``rounds``: see
    timed(). ``seed``: of the document lengths (0: the rows of every table in docs/packed_dispatch.md). ``window``:
    every layer's sliding window (documents windowed; the stream stays one plain causal stream)."""
    lens = doc_lengths(L, median, sigma, seed)
    docs = packing.documents(positions(lens), window=window)
    ks = sorted(set(pairs if pairs is not None else (1, zigzag_pairs(L, world))))
    torch.manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q, k_, v, do = (torch.randn(1, L, heads, dim, device=device, dtype=dt) for _ in range(4))
    n = L // world
    idx = torch.arange(L)
    ref, _ = kernels.attn_forward(q, k_, v, True, docs=docs.block(idx, idx))

    def forward(sh, r, blocks):
        out = torch.zeros(1, n, heads, dim, device=device)
        lse = torch.full((1, heads, n), -math.inf, device=device)
        for qs, src, ks_, causal, bd in blocks:
            res = kernels.attn_forward(sh[0][r][:, qs], sh[1][src][:, ks_], sh[2][src][:, ks_], causal, docs=bd)
            if res is not None:
                kernels.merge_attn_out(out[:, qs], lse[:, :, qs], *res)
        return out, lse

    def backward(sh, r, blocks, out, lse):
        for qs, src, ks_, causal, bd in blocks:
            kernels.attn_backward(sh[3][r][:, qs], sh[0][r][:, qs], sh[1][src][:, ks_], sh[2][src][:, ks_],
                                  out[:, qs], lse[:, :, qs], causal, docs=bd)

    def timed(setup):
        """Per-rank ms: the median over ``rounds`` rounds of ``cuda_time_ms(setup(r)(), 1, iters)``; each round
        visits the ranks in another order (rotated, every other one reversed), so that drift in the GPU's state
        (clocks, allocator) cannot land on the same ranks every time. Also each round's max/mean."""
        per = [[] for _ in range(world)]
        for i in range(rounds):
            order = list(range(i % world, world)) + list(range(i % world))
            for r in (order[::-1] if i % 2 else order):
                work = setup(r)
                per[r].append(cuda_time_ms(work, 1, iters) if device == "cuda" else (work(), 1.0)[1])
        t = [statistics.median(x) for x in per]
        rounds_mm = [max(x[i] for x in per) / (sum(x[i] for x in per) / world) for i in range(rounds)]
        return t, rounds_mm

    def run(d, kk):
        sh = [[pairs_shard(t, r, world, kk).contiguous() for r in range(world)] for t in (q, k_, v, do)]
        outs, launches = {}, []
        for r in range(world):
            launches.append(score_elements(rank_blocks(r, world, L, d, kk), L, world)[2])

        def setup(r):
            blocks = rank_blocks(r, world, L, d, kk)
            o, l = forward(sh, r, blocks)
            ob = outs.setdefault(r, o.to(dt))

            def work():
                forward(sh, r, blocks)
                backward(sh, r, blocks, ob, l)
            return work
        times, rounds_mm = timed(setup)
        err = None
        if d is not None:  # correctness of the packed ring: merged rows vs per-document attention over the full row
            got = pairs_unshard([outs[r] for r in range(world)], kk, dim=1)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        return times, err, launches, rounds_mm

    def run_dispatch(m, d, plan):
        sh = [[d.shard(t, r).contiguous() for r in range(world)] for t in (q, k_, v, do)]
        outs, launches, recv = {}, [], []
        for r in range(world):
            blocks = dispatch_blocks(r, plan)
            launches.append(score_elements([(slice(None), s, None, True, bd) for s, _, bd in blocks], L, world)[2])
            recv.append(plan.received_tokens(r))

        def setup(r):
            # what rank r receives at each step (gathered outside the timing: the real ring copies it on the sender)
            kv = [(sh[1][s] if rows is None else sh[1][s][:, rows.to(device)],
                   sh[2][s] if rows is None else sh[2][s][:, rows.to(device)], bd)
                  for s, rows, bd in dispatch_blocks(r, plan)]

            def fwd():  # as dispatch_forward: every step merges its pieces into the fp32 accumulators
                acc = (torch.zeros(1, n, heads, dim, device=device),
                       torch.full((1, heads, n), -math.inf, device=device))
                for kk_, vv, bd in kv:
                    kernels.attn_forward(sh[0][r], kk_, vv, True, docs=bd, into=acc)
                return acc[0].to(dt), acc[1]
            ob, l = fwd()
            ob = outs.setdefault(r, ob)

            def work():  # as dispatch_backward (less the transfers)
                fwd()
                dq = torch.zeros(1, n, heads, dim, device=device)
                for i, (kk_, vv, bd) in enumerate(kv):
                    gk, gv = (torch.zeros(t.shape, device=device) for t in (kk_, vv))
                    kernels.attn_backward(sh[3][r], sh[0][r], kk_, vv, ob, l, True, docs=bd, into=(dq, gk, gv))
                    if i:  # src's grads leave in k's dtype
                        gk.to(dt), gv.to(dt)
                return dq.to(dt)
            return work
        times, rounds_mm = timed(setup)
        got = d.unshard([outs[r] for r in range(world)], dim=1)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        return d, times, err, launches, recv, rounds_mm

    def row(layout, t, err, launches, mb, ranks=None, rounds_mm=()):
        if ranks is not None:  # per-rank counts and measured ms: the points bench/packed_fit.py re-fits the model on
            ranks = [dict(c, ms=round(ms, 3)) for c, ms in zip(ranks, t)]
        return dict(ranks=ranks, rank_ms=" ".join(f"{x:.1f}" for x in t), L=L, W=world, seed=seed, window=window,
                    layout=layout,
                    docs=len(lens), mean_doc=f"{L / len(lens):.0f}", max_doc=max(lens),
                    packed_ms=f"{sum(t):.0f}", slowest_rank_ms=f"{max(t):.1f}", stream_ms=f"{sum(stream):.0f}",
                    speedup=f"{sum(stream) / sum(t):.2f}x", wall_speedup=f"{max(stream) / max(t):.2f}x",
                    max_over_mean=f"{max(t) / (sum(t) / world):.3f}",
                    stream_max_over_mean=f"{max(stream) / (sum(stream) / world):.3f}",
                    fa4_launches=f"{min(launches)}..{max(launches)}", kv_MB=mb, err=f"{err:.1e}", _slow=max(t),
                    rounds_max_over_mean=" ".join(f"{x:.3f}" for x in rounds_mm))

    stream = run(None, 1)[0]
    rows = []
    for kk in ks:
        t, err, launches, rmm = run(docs, kk)
        rows.append(row(f"{2 * world * kk} chunks, k={kk}", t, err, launches, f"{ring_kv_mb(L, world, heads, dim):.0f}",
                        layout_counts(L, world, docs, kk), rmm))
    seen = set()
    for m in per_rank:
        d, plan = dispatch_layout(lens, L, world, m, window)
        if d in seen:  # an explicit m equal to a pick: timed once
            continue
        seen.add(d)
        d, t, err, launches, recv, rmm = run_dispatch(m, d, plan)
        mb = [kv_mb(x, heads, dim) for x in recv]
        rows.append(row(_dispatch_name(d, world, m), t, err, launches, f"{min(mb):.0f}..{max(mb):.0f}",
                        layout_counts(L, world, plan=plan), rmm))
    default = next((r["_slow"] for r, kk in zip(rows, ks) if kk == zigzag_pairs(L, world)), None)
    for r in rows:
        slow = r.pop("_slow")
        r["vs_default"] = f"{default / slow:.2f}x" if default else ""
    return rows


def tiles(nq, nk, causal, bq, bk):
    """Kernel tiles (bq q rows x bk keys) a piece runs; a causal piece (bottom-right aligned) skips tiles above its
    diagonal."""
    tq, tk = -(-nq // bq), -(-nk // bk)
    if not causal:
        return tq * tk
    off = nk - nq  # key j is visible to row i when j <= i + off
    return sum(min(tk, (min(nq, (i + 1) * bq) - 1 + off) // bk + 1) for i in range(tq))


def rank_features(blocks, recv, L, world):
    """Candidate features of one rank from its steps' BlockDocs (``recv``: kv rows it receives)."""
    f = dict(causal=0.0, rect=0.0, tf=0.0, tb=0.0, tf_causal=0.0, tf_rect=0.0, pieces=0, short=0, launches=0,
             varlen=0, dense=0, rows=0.0, steps=0, recv=recv, small=0.0, deep=0.0)
    for bd in blocks:
        ps = bd.pieces()
        if not ps:
            continue
        f["steps"] += 1
        for qs, ks, c in ps:
            nq, nk = qs.stop - qs.start, ks.stop - ks.start
            f["causal" if c else "rect"] += nq * nk / 2 if c else nq * nk
            t = tiles(nq, nk, c, 128, 128)
            f["tf"] += t
            f["tf_causal" if c else "tf_rect"] += t
            f["tb"] += tiles(nq, nk, c, 64, 128)
            f["pieces"] += 1
            f["short"] += min(nq, nk) < 128
            f["rows"] += nq + nk  # rows a piece reads and merges (into= accumulators, dq/dk/dv)
            n = nq * nk / 2 if c else nq * nk
            f["small"] += n if n < 2 ** 26 else 0  # elements of small launches (under-filled GPU, short loops)
            f["deep"] += 0 if c else n * (nk >= 16384)  # long kv loops per q tile
        for kind, _ in kernels._group("fa4", ps):
            f["launches"] += 1
            f["varlen" if kind == "varlen" else "dense"] += 1
    return f


def layout_features(L, world, lens, layout):
    """Per rank: ``rank_features`` of the stored layout named ``layout`` (its row rebuilt: bench_packed is
    deterministic), ``ring`` 1 for the fixed ring."""
    docs = packing.documents(positions(lens))
    if not layout.startswith("dispatch"):
        k = int(layout.split("k=")[1])
        out = []
        for r in range(world):
            blocks = [b[4] for b in rank_blocks(r, world, L, docs, k)]
            f = rank_features(blocks, (world - 1) * L // world, L, world)
            f["ring"] = 1
            out.append(f)
        return out
    m = ("old" if "old pick" in layout else "prev" if "work-balanced" in layout else "fastest" if "fastest" in layout
         else "first" if "first-search" in layout else "new" if "time-balanced" in layout
         else int(layout.split("m=")[1]))
    d, plan = dispatch_layout(lens, L, world, m)
    if m == "new" and d.chunks != int(layout.split()[1]):  # runs before 2026-12-05's balance rule: the fastest pick
        d, plan = dispatch_layout(lens, L, world, "fastest")
    out = []
    for r in range(world):
        f = rank_features([bd for _, _, bd in dispatch_blocks(r, plan)], plan.received_tokens(r), L, world)
        f["ring"] = 0
        out.append(f)
    return out


def with_kinds(rows: list[dict]) -> list[dict]:
    """Rows of runs before the launch kinds were stored: their dense/varlen counts rebuilt (bench_packed is
    deterministic: same rows, same seed)."""
    for r in rows:
        if r.get("ranks") and "dense" not in r["ranks"][0]:
            feats = layout_features(r["L"], r["W"], doc_lengths(r["L"], 1500, 1.5, r.get("seed", 0)), r["layout"])
            for c, f in zip(r["ranks"], feats):
                c.update(dense=f["dense"], varlen=f["varlen"])
    return rows


def fit_report(path: str, use=packed_fit.MODEL) -> dict:
    """``--fit``: packed_fit's constants re-fitted on the per-rank times of a bench_packed JSON, and the errors."""
    with open(path) as f:
        data = json.load(f)
    rows = with_kinds(data.get("rows", []))
    errs = [abs(float(r["rel_err"])) for r in packed_fit.fit(rows, fixed=packed_fit.current())[1]]
    print(f"dispatch.py's model on {path}: |rel err| mean {np.mean(errs):.3f}, max {max(errs):.3f}")
    consts, res = packed_fit.fit(rows, use)
    print(f"fitted on {len(res)} points:")
    for name, v in consts.items():
        print(f"  {name:>14s}: {v:.4g} ms")
    for r in res:
        print(f"  {r['point']:<60s} measured {r['measured_ms']:>8.2f}  fitted {r['fitted_ms']:>8.2f}  {r['rel_err']}")
    errs = [abs(float(r["rel_err"])) for r in res]
    print(f"  |rel err|: mean {np.mean(errs):.3f}, max {max(errs):.3f}")
    return consts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="rows: the document lengths of each seed (0: the row of docs/packed_dispatch.md's tables; 2, "
                         "3, 5: rows the first boundary search leaves unbalanced at 128K)")
    ap.add_argument("--window", type=int, default=None,
                    help="every layer's sliding window (Mistral v0.1: 4096): documents windowed, the picks planned "
                         "with it, plus the window-blind pick (planned without it)")
    ap.add_argument("--median", type=float, default=1500)
    ap.add_argument("--sigma", type=float, default=1.5)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every rank this many times, each round in another rank order; per rank the median "
                    "(noise vs effect: each round's max/mean is printed)")
    ap.add_argument("--pairs", type=int, nargs="+", default=None,
                    help="k values to time (default: 1 = plain zigzag and zigzag_pairs(L, W), what the ring picks)")
    ap.add_argument("--per-rank", type=int, nargs="+", default=None,
                    help="chunks per rank of the dispatch to time (default: the cost model's pick)")
    ap.add_argument("--count", action="store_true", help="CPU: score elements per rank only")
    ap.add_argument("--check", action="store_true", help="CPU float32 run of the simulation's code path (errors only)")
    ap.add_argument("--fit", metavar="FILE", help="CPU: re-fit dispatch/plan.py's time model (least squares) on the "
                    "per-rank counts and times of a bench_packed JSON ($OUT/bench_packed.json of a GPU run)")
    ap.add_argument("--rect-varlen", type=int, default=0, metavar="N",
                    help="a block's rectangles of <= N score elements in one varlen FA4 call "
                         "(kernels/documents.RECT_VARLEN_MAX; default 0: one dense call each, the library default)")
    args = ap.parse_args()
    if args.rect_varlen < 0:
        ap.error(f"--rect-varlen {args.rect_varlen}: a number of score elements >= 0 (0: one dense call a rectangle)")
    if args.rect_varlen:
        from easy_context.kernels import documents
        documents.RECT_VARLEN_MAX = args.rect_varlen
    if args.fit:
        fit_report(args.fit)
        return
    if args.window is not None and args.window < 1:
        ap.error(f"--window {args.window}: a number of tokens >= 1")
    if args.check:  # tiny CPU smoke of the GPU path: every layout (k=4 on 4096 tokens needs 128-token chunks)
        rows = simulate(4096, 4, 4, 32, 300, 1.0, 1, device="cpu", pairs=(1, 2, 4),
                        per_rank=("old", "prev", "fastest", "new", "first", 8), rounds=2)
        rows += simulate(4096, 4, 4, 32, 300, 1.0, 1, device="cpu", pairs=(1, 2), per_rank=("new", "blind"),
                         window=200)  # windowed documents (the picks planned with and without the window)
        for r in rows:
            print({k: v for k, v in r.items() if k != "ranks"})
            assert float(r["err"]) < 1e-5, r
        return
    per_rank = ["old", "prev", "fastest", "new", "first"] + (["blind"] if args.window else []) + \
        [m for m in (args.per_rank or []) if m is not None]
    counts = count_only(args.lengths, args.world, args.median, args.sigma, args.pairs, per_rank, args.heads,
                        args.head_dim, args.seeds, args.window)
    print(f"\n## Score elements (zigzag W={args.world}, log-normal documents, median {args.median:g}, "
          f"sigma {args.sigma:g})\n")
    print(table(counts, ["L", "W", "seed", "layout", "docs", "max_doc", "work_vs_stream", "max_over_mean",
                         "rank_Melems", "pieces_per_rank", "steps", "fa4_launches", "kv_MB", "pred_ms", "pred_mm",
                         "pred_ms_before", "pred_vs_default"]))
    print("\npred_ms: dispatch/plan.py's time model fitted to the H200 timings (FA4, fwd+bwd, 32 heads x 128) from exact "
          "per-rank counts; pred_mm: max/mean of the predicted rank times;\npred_ms_before: the same with the "
          "ring steps' full-size passes the measured code made")
    print("\n## Balance study: finer chunks, mirrored pairs vs greedy by cost (q-side work per rank)\n")
    print(table(balance_study(args.lengths, args.world, args.median, args.sigma),
                ["L", "W", "chunks", "mirrored_max_over_mean", "greedy_max_over_mean"]))
    if args.count:
        return
    if not torch.cuda.is_available():
        raise SystemExit("timings need a CUDA GPU (--count works on CPU)")
    print(env_line(), "| backend:", kernels.choose_backend(torch.empty(1, 1, 1, 128, device="cuda",
                                                                       dtype=torch.bfloat16)), flush=True)
    rows = []
    for L, seed in ((L, seed) for L in args.lengths for seed in args.seeds):
        new = simulate(L, args.world, args.heads, args.head_dim, args.median, args.sigma, args.iters, pairs=args.pairs,
                       per_rank=per_rank, rounds=args.rounds, seed=seed, window=args.window)
        rows += new
        print(*({k: v for k, v in r.items() if k != "ranks"} for r in new), sep="\n", flush=True)
        torch.cuda.empty_cache()
    print("\n## Simulated ring, packed documents (zigzag, k pairs, dispatch) vs one causal stream (fwd+bwd, bf16)\n")
    print(table(rows, ["L", "W", "seed", "layout", "docs", "mean_doc", "max_doc", "packed_ms", "slowest_rank_ms",
                       "stream_ms", "speedup", "wall_speedup", "max_over_mean", "stream_max_over_mean", "vs_default",
                       "fa4_launches", "kv_MB", "err"]))
    print("\n## Measured ms per rank (fwd+bwd; the points `--fit` re-fits the time model on)\n")
    print(table(rows, ["L", "seed", "layout", "rank_ms", "rounds_max_over_mean"]))
    if os.environ.get("OUT"):
        name = f"bench_packed_rects{args.rect_varlen}.json" if args.rect_varlen else \
            f"bench_packed_window{args.window}.json" if args.window else "bench_packed.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(dict(env=env_line(), counts=counts, rows=rows, rect_varlen=args.rect_varlen), f, indent=1)


if __name__ == "__main__":
    main()
