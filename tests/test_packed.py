"""Packed documents (position_ids restarting at 0) under every mode: per-document causal attention.

Model level (W=2 and W=4, every mode, USP as 2x2, fp32 CPU): logits, loss and every parameter gradient equal a
single-process reference that runs each document separately — one document, many short ones incl. a
1-token document, boundaries on and off shard/zigzag-chunk edges, different packings per batch row; GQA
(4 q / 2 kv heads). Kernel level: the facade's document mask vs float64 per-document attention, and the
block skip counted for a row of many short documents. The same spawns also run tests/test_packed_balance.py's
``balanced_body``: rows long enough for the balanced k-pair layout (4096 tokens, k > 1).
"""
import math

import pytest
import torch

from easy_context import kernels, packing
from tests.harness import run_ranks
from tests.tols import assert_close


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


# ----------------------------------------------------------------------------------------------
# pure logic
# ----------------------------------------------------------------------------------------------
def test_documents_from_positions():
    assert packing.documents(torch.arange(10).unsqueeze(0)) is None          # one document: dense path
    assert packing.documents(torch.arange(5, 15).unsqueeze(0)) is None       # a continued document too
    d = packing.documents(_positions([3, 1, 4]))
    assert d.doc_ids.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]] and d.count() == 3
    with pytest.raises(packing.PackedPositionsError, match=r"row 1 jumps from 2 to 5 at index 3"):
        packing.documents(torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 5, 6]]))
    with pytest.raises(packing.PackedPositionsError, match="must restart at 0"):
        packing.documents(torch.tensor([[0, 1, 2, 1, 2]]))


def test_block_pieces():
    docs = packing.documents(_positions([3, 6, 2, 5]))  # documents [0,3) [3,9) [9,11) [11,16)
    diag = docs.block(torch.arange(4, 12), torch.arange(4, 12)).pieces()
    assert [(q.start, q.stop, k.start, k.stop, c) for q, k, c in diag] == \
        [(0, 5, 0, 5, True), (5, 7, 5, 7, True), (7, 8, 7, 8, True)]
    # kv [0, 4) before q [4, 8): only document [3, 9) spans both -> q rows 4..8 x kv row 3
    rect = docs.block(torch.arange(4, 8), torch.arange(0, 4)).pieces()
    assert [(q.start, q.stop, k.start, k.stop, c) for q, k, c in rect] == [(0, 4, 3, 4, False)]
    assert docs.block(torch.arange(12, 16), torch.arange(0, 8)).pieces() == []  # ended before: skipped
    # a zigzag local pair (chunks 0 and 3 of 4): q chunk 0 vs kv chunk 1 is masked by causality
    pair = torch.cat([torch.arange(0, 4), torch.arange(12, 16)])
    got = docs.block(pair, pair).pieces()
    assert [(q.start, q.stop, k.start, k.stop, c) for q, k, c in got] == \
        [(0, 3, 0, 3, True), (3, 4, 3, 4, True), (4, 8, 4, 8, True)]


def _mask_of(pieces, nq, nk):
    """The dense (nq, nk) keep-mask the pieces describe (each key at most once per query: asserted)."""
    m = torch.zeros(nq, nk, dtype=torch.long)
    for qs, ks, c in pieces:
        nq_, nk_ = qs.stop - qs.start, ks.stop - ks.start
        keep = packing.piece_mask(c, nq_, nk_)
        if isinstance(c, packing.Window):
            assert bool(keep.any(1).all()), f"{c}: a row without keys"
            assert torch.equal(_mask_of(c.tiles(nq_, nk_), nq_, nk_), keep), c  # the no-window kernels' cut
        m[qs, ks] += keep.long()
    assert int(m.max()) <= 1, "two pieces cover the same (query, key)"
    return m.bool()


@pytest.mark.parametrize("window", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("lengths", [[24], [5, 1, 11, 7]])
def test_window_pieces_are_exactly_the_mask(window, lengths):
    """Every block a ring can ask for (diagonal runs, kv runs before q runs, zigzag pairs): the pieces cover
    exactly {same document, j <= i, j > i - window}, and blocks wholly outside the window give no piece."""
    n = sum(lengths)
    docs = packing.documents(_positions(lengths), window=window)
    assert docs is not None and docs.window == (window if window < n else None)
    d = docs.doc_ids[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    want = (d[:, None] == d[None, :]) & (j <= i) & (j > i - window)
    blocks = [(torch.arange(n), torch.arange(n))]
    for c in (4, 6):  # contiguous chunks of c rows, every (q chunk, kv chunk) pair, and zigzag pairs
        chunks = [torch.arange(s, min(s + c, n)) for s in range(0, n, c)]
        blocks += [(a, b) for a in chunks for b in chunks if b[0] <= a[0]]
        pairs = [torch.cat([chunks[r], chunks[-1 - r]]) for r in range(len(chunks) // 2)]
        blocks += [(p, t) for p in pairs for t in pairs]  # a zigzag ring's (q pair, visiting kv pair)
    for q_idx, k_idx in blocks:
        pieces = docs.block(q_idx, k_idx).pieces()
        got = _mask_of(pieces, len(q_idx), len(k_idx))
        expect = want[q_idx][:, k_idx]
        assert torch.equal(got, expect), (window, q_idx.tolist(), k_idx.tolist(), pieces)
        if not bool(expect.any()):
            assert pieces == [], pieces  # skipped: no kernel call
    # a whole row without packing: one document under the window
    assert packing.documents(torch.arange(n)[None], window=window).doc_ids.sum() == 0 if window < n else True


@pytest.mark.parametrize("lengths", [[40], [7, 1, 13, 19], [1] * 5 + [35], [16, 16, 8]])
def test_facade_document_mask_matches_per_document_attention(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    n = sum(lengths)
    q, do = (torch.randn(2, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    docs = packing.documents(_positions(lengths).expand(2, -1))
    if docs is None:
        docs = packing.Documents(torch.zeros(2, n, dtype=torch.long))
    idx = torch.arange(n)
    out, lse = kernels.attn_forward(q, k, v, True, 0.3, "math", docs=docs.block(idx, idx))
    dq, dk, dv = kernels.attn_backward(do, q, k, v, out, lse, True, 0.3, "math", docs=docs.block(idx, idx))
    s = 0
    for m in lengths:
        sl = slice(s, s + m)
        qr, kr, vr = (t[:, sl].clone().requires_grad_() for t in (q, k, v))
        ro, rl = kernels.attention_reference(qr, kr, vr, True, 0.3)
        ro.backward(do[:, sl])
        for a, b, name in ((out[:, sl], ro, "out"), (lse[:, :, sl], rl, "lse"), (dq[:, sl], qr.grad, "dq"),
                           (dk[:, sl], kr.grad, "dk"), (dv[:, sl], vr.grad, "dv")):
            if name in ("dq", "dk") and m == 1:
                assert a.abs().max() < 1e-12, f"{name} of a 1-token document must be 0"
                continue
            assert_close(a, b, 1e-10, f"{name} doc of {m} at {s}")
        s += m


def _math_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, fallback):
    """A reference varlen kernel ((total, H, D) + cu_seqlens -> out, lse (H, total)) to exercise the
    facade's varlen grouping on CPU the way FA4's is used on a GPU (causal diagonal runs, non-causal rectangles)."""
    outs, lses = [], []
    for (s, e), (a, b) in zip(_spans_of(cu_q), _spans_of(cu_k)):
        assert e - s <= max_q and b - a <= max_k and (not causal or e - s == b - a)
        o, l = kernels.attn_forward(q[s:e][None], k[a:b][None], v[a:b][None], causal, scale, "math")
        outs.append(o[0])
        lses.append(l[0])
    _math_varlen_forward.calls = getattr(_math_varlen_forward, "calls", 0) + 1
    return torch.cat(outs), torch.cat(lses, dim=1)


def _spans_of(cu):
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def _math_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, fallback):
    gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (s, e), (a, b) in zip(_spans_of(cu_q), _spans_of(cu_k)):
        t = [x[s:e][None] for x in (dout, q)] + [x[a:b][None] for x in (k, v)] + [out[s:e][None]]
        g = kernels.attn_backward(*t, lse[:, s:e][None], causal, scale, "math")
        gq[s:e], gk[a:b], gv[a:b] = g[0][0], g[1][0], g[2][0]
    return gq, gk, gv


def _math_varlen_window_forward(q, k, v, cu, max_len, left, scale, fallback):
    """A reference windowed varlen kernel (causal within each sequence, keys a - left <= b <= a)."""
    from easy_context.kernels.documents import _piece_forward
    outs, lses = [], []
    for s, e in _spans_of(cu):
        assert e - s <= max_len
        o, l = _piece_forward("math", q[s:e][None], k[s:e][None], v[s:e][None], packing.Window(left + 1, 0, True),
                              scale)
        outs.append(o[0])
        lses.append(l[0])
    _math_varlen_window_forward.calls = getattr(_math_varlen_window_forward, "calls", 0) + 1
    return torch.cat(outs), torch.cat(lses, dim=1)


def _math_varlen_window_backward(dout, q, k, v, out, lse, cu, max_len, left, scale, fallback):
    from easy_context.kernels.documents import _piece_backward
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for s, e in _spans_of(cu):
        g = _piece_backward("math", *(t[s:e][None] for t in (dout, q, k, v, out)), lse[:, s:e][None],
                            packing.Window(left + 1, 0, True), scale)
        for acc, x in zip(grads, g):
            acc[s:e] = x[0]
    return tuple(grads)


def test_varlen_grouping_matches_per_document_calls(monkeypatch):
    """Diagonal runs of >= VARLEN_MIN_DOCS documents go to one varlen call (FA4 on a GPU); same result."""
    _math_varlen_forward.calls = 0
    monkeypatch.setitem(kernels.VARLEN, "math", (_math_varlen_forward, _math_varlen_backward))
    g = torch.Generator().manual_seed(5)
    lengths = [3, 1, 6, 2, 5, 4, 9, 2]
    n = sum(lengths)
    q, do = (torch.randn(2, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    docs = packing.documents(_positions(lengths).expand(2, -1))
    pair = torch.cat([torch.arange(0, 8), torch.arange(24, 32)])  # a zigzag-like pair of runs
    for idx in (torch.arange(n), pair):
        blk = docs.block(idx, idx)
        qi, ki, vi, di = (t[:, idx] for t in (q, k, v, do))
        got = kernels.attn_forward(qi, ki, vi, True, 0.3, "math", docs=blk)
        gg = kernels.attn_backward(di, qi, ki, vi, *got, True, 0.3, "math", docs=blk)
        monkeypatch.setattr(kernels.documents, "VARLEN_MIN_DOCS", 10 ** 9)  # per-document dense calls
        ref = kernels.attn_forward(qi, ki, vi, True, 0.3, "math", docs=blk)
        rg = kernels.attn_backward(di, qi, ki, vi, *ref, True, 0.3, "math", docs=blk)
        monkeypatch.setattr(kernels.documents, "VARLEN_MIN_DOCS", 4)
        for a, b, name in zip((*got, *gg), (*ref, *rg), ("out", "lse", "dq", "dk", "dv")):
            assert_close(a, b, 1e-12, f"varlen {name}")
    assert _math_varlen_forward.calls >= 2


def test_rectangles_go_in_one_varlen_call_and_equal_the_masked_reference(monkeypatch):
    """A block's rectangles (kv rows before q rows of the same document: all of a dispatched ring's received blocks)
    in one non-causal varlen call, results merged by row index: equal to float64 attention with the explicit mask
    and to one dense call per rectangle. Batch of 2 with different documents (row by row), and kv runs out of order
    (two rectangles with the same q rows: merged in two rounds)."""
    from easy_context.kernels import documents as kd
    monkeypatch.setitem(kernels.VARLEN, "math", (_math_varlen_forward, _math_varlen_backward))
    monkeypatch.setattr(kd, "RECT_VARLEN_MAX", 10 ** 9)  # off by default (measured slower on the H200)
    g = torch.Generator().manual_seed(11)
    n = 48
    rows = [[7, 12, 3, 9, 9, 8], [30, 2, 16]]
    q, do = (torch.randn(2, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    docs = packing.documents(torch.cat([_positions(r) for r in rows]))
    ch = [torch.arange(6 * c, 6 * c + 6) for c in range(8)]
    blocks = [(torch.cat([ch[2], ch[5], ch[7]]), torch.cat([ch[0], ch[1], ch[3], ch[4]])),   # a dispatched step
              (torch.cat([ch[4], ch[6]]), torch.cat([ch[3], ch[7], ch[0]])),                # kv runs out of order
              (torch.cat([ch[1], ch[4]]), torch.cat([ch[1], ch[4]]))]                       # diagonal + rectangle
    seen = {"rects": 0, "rounds": 0}
    real = kd._rects_forward

    def counted(*a):
        seen["rects"] += 1
        seen["rounds"] = max(seen["rounds"], len(kd._disjoint_rounds(kd._spans(p[0] for p in a[5]))))
        return real(*a)
    monkeypatch.setattr(kd, "_rects_forward", counted)
    for q_idx, k_idx in blocks:
        blk = docs.block(q_idx, k_idx)
        qi, ki, vi, di = q[:, q_idx], k[:, k_idx], v[:, k_idx], do[:, q_idx]
        got = kernels.attn_forward(qi, ki, vi, True, 0.3, "math", docs=blk)
        gg = kernels.attn_backward(di, qi, ki, vi, *got, True, 0.3, "math", docs=blk)
        acc = (torch.zeros_like(qi), torch.full_like(got[1], -math.inf))  # into=: what a dispatched ring step passes
        kernels.attn_forward(qi, ki, vi, True, 0.3, "math", docs=blk, into=acc)
        grads = kernels.attn_backward(di, qi, ki, vi, *got, True, 0.3, "math", docs=blk,
                                      into=tuple(torch.zeros_like(t) for t in (qi, ki, vi)))
        for a, b in zip((*acc, *grads), (*got, *gg)):
            assert torch.equal(a, b)
        with monkeypatch.context() as m:
            m.setattr(kd, "RECT_VARLEN_MAX", 0)  # the default: one dense call per rectangle
            dense = kernels.attn_forward(qi, ki, vi, True, 0.3, "math", docs=blk)
            dense = (*dense, *kernels.attn_backward(di, qi, ki, vi, *dense, True, 0.3, "math", docs=blk))
        for b in range(2):
            d = docs.doc_ids[b]
            keep = (d[q_idx][:, None] == d[k_idx][None, :]) & (k_idx[None, :] <= q_idx[:, None])
            ref = _masked_reference(qi[b:b + 1], ki[b:b + 1], vi[b:b + 1], di[b:b + 1], keep, 0.3)
            for a, c, r, name in zip((*got, *gg), dense, ref, ("out", "lse", "dq", "dk", "dv")):
                a, c = a[b:b + 1], c[b:b + 1]
                fin = torch.isfinite(r)
                assert torch.equal(fin, torch.isfinite(a)), name
                assert_close(a[fin], r[fin], 1e-10, f"rects {name} row {b}")
                assert_close(a[fin], c[fin], 1e-10, f"rects vs dense {name} row {b}")
    assert seen["rects"] >= 2 and seen["rounds"] == 2, seen
    rects = [p for p in docs.block(*blocks[0]).pieces(0) if p[2] is False]  # 6 x 5 and 1 x 8 score elements
    assert sorted((p[0].stop - p[0].start) * (p[1].stop - p[1].start) for p in rects) == [8, 30]
    for cap, kinds in ((30, ["rects"]), (29, ["dense", "dense"]), (0, ["dense", "dense"])):
        monkeypatch.setattr(kd, "RECT_VARLEN_MAX", cap)  # only rectangles of <= cap score elements join
        assert [k for k, _ in kd._group("math", rects)] == kinds, cap


def _fa_window_math(q, k, v, left, right, scale, fallback):
    """A windowed kernel in flash-attention's convention (key b kept for query a iff a + Lk - Lq - left <= b and,
    unless right is None, b <= a + Lk - Lq + right), by an explicit float64 mask: checks ``kernel_window``."""
    n, m = q.shape[1], k.shape[1]
    a, b = torch.arange(n)[:, None], torch.arange(m)[None, :]
    keep = (b >= a + m - n - left) & ((b <= a + m - n + right) if right is not None else True)
    assert bool(keep.any(1).all()), "a windowed piece handed the kernel a row without keys"
    g = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(g, dim=2).transpose(1, 2) for t in (k, v))
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vv).transpose(1, 2), lse


def _fa_window_math_bwd(dout, q, k, v, out, lse, left, right, scale, fallback):
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = _fa_window_math(qr, kr, vr, left, right, scale, None)
    return torch.autograd.grad(o, (qr, kr, vr), dout)


def _masked_reference(q, k, v, do, keep, scale):
    """float64 attention with an explicit (Lq, Lk) keep-mask, and its gradients (autograd)."""
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(g, dim=2).transpose(1, 2) for t in (kr, vr))
    sc = (qr.transpose(1, 2) @ kk.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(sc, -1)
    p = torch.where(keep.any(-1, keepdim=True), torch.softmax(sc.masked_fill(~keep.any(-1, keepdim=True), 0), -1),
                    torch.zeros_like(sc))
    out = (p @ vv).transpose(1, 2)
    out.backward(do)
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


@pytest.mark.parametrize("window", [3, 5, 16])
def test_windowed_blocks_equal_the_masked_reference_on_every_path(monkeypatch, window):
    """Every block a ring asks for (diagonal, kv before q, zigzag pairs; packed and not) equals float64 attention
    with the explicit mask, through each window path: tiles with reversed band squares (alone, and beside a varlen
    kernel for the documents' runs), band edges on the math kernel, a window kernel in fa4's convention, and
    diagonal runs whose documents longer than the window join one windowed varlen call (VARLEN_WINDOW), also when
    that kernel refuses (the run then goes as without it: long documents alone, the rest in plain varlen runs)."""
    from easy_context.kernels import documents as kd
    g = torch.Generator().manual_seed(3)
    paths = {"tiles": {}, "tiles+varlen": {"varlen": True}, "local": {"local": True},
             "math band edges": {"no_reverse": True}, "windowed varlen runs": {"varlen": True, "varlen_window": True},
             "windowed varlen refused": {"varlen": True, "varlen_refused": True}}
    _math_varlen_window_forward.calls = 0
    plain_in_refused = 0  # plain varlen launches of the stretches between long documents, when the windowed one fails

    def refused_forward(*a):  # a windowed varlen kernel that refuses (FA4 on a GPU where it lacks the combination)
        return a[-1]()
    seen_reversed = 0
    real_reversed = kd._reversed_causal

    def counted(*a):  # how many band squares took the reversed causal kernel
        nonlocal seen_reversed
        hit = real_reversed(*a)
        seen_reversed += hit
        return hit
    for lengths in ([40], [3, 1, 17, 2, 9, 8], [2, 3, 1, 2, 20, 4, 3, 5]):
        n = sum(lengths)
        q, do = (torch.randn(1, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        docs = packing.documents(_positions(lengths), window=window)
        d = docs.doc_ids[0]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        want = (d[:, None] == d[None, :]) & (j <= i) & (j > i - window)
        quarters = [torch.arange(0, 10), torch.arange(10, 20), torch.arange(20, 30), torch.arange(30, 40)]
        blocks = [(torch.arange(n), torch.arange(n)), (quarters[2], quarters[0]), (quarters[3], quarters[1]),
                  (torch.cat([quarters[0], quarters[3]]), torch.cat([quarters[1], quarters[2]]))]
        for q_idx, k_idx in blocks:
            blk = docs.block(q_idx, k_idx)
            keep = want[q_idx][:, k_idx]
            if not blk.pieces():
                assert not bool(keep.any())
                continue
            qi, ki, vi, di = q[:, q_idx], k[:, k_idx], v[:, k_idx], do[:, q_idx]
            ref = _masked_reference(qi, ki, vi, di, keep, 0.3)
            for path, opt in paths.items():
                with monkeypatch.context() as m:
                    if not opt:
                        m.setattr(kd, "_reversed_causal", counted)
                    if opt.get("varlen"):
                        m.setitem(kernels.VARLEN, "math", (_math_varlen_forward, _math_varlen_backward))
                    if opt.get("local"):
                        m.setitem(kd.WINDOWED, "math", (_fa_window_math, _fa_window_math_bwd))
                    if opt.get("varlen_window"):  # documents longer than the window join the varlen runs
                        m.setitem(kd.VARLEN_WINDOW, "math", (_math_varlen_window_forward,
                                                              _math_varlen_window_backward))
                    if opt.get("varlen_refused"):
                        m.setitem(kd.VARLEN_WINDOW, "math", (refused_forward, refused_forward))
                    before = getattr(_math_varlen_forward, "calls", 0)
                    if opt.get("no_reverse"):
                        m.setattr(kd, "_reversed_causal", lambda *a: False)
                    got = kernels.attn_forward(qi, ki, vi, True, 0.3, "math", docs=blk)
                    gg = kernels.attn_backward(di, qi, ki, vi, *got, True, 0.3, "math", docs=blk)
                    if opt.get("varlen_refused"):
                        plain_in_refused += getattr(_math_varlen_forward, "calls", 0) - before
                for a, b, name in zip((*got, *gg), ref, ("out", "lse", "dq", "dk", "dv")):
                    fin = torch.isfinite(b)  # rows the block masks entirely: lse -inf in both
                    assert torch.equal(fin, torch.isfinite(a)), (path, name)
                    assert_close(a[fin], b[fin], 1e-10, f"{path} window {window} {lengths} {name}")
    assert seen_reversed > 0 or window >= 16  # the band squares took the reversed path
    assert _math_varlen_window_forward.calls > 0 or window >= 16  # a windowed varlen run was taken
    assert plain_in_refused > 0 or window >= 16  # ... and, refused, its short documents still shared a launch


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kernel", ["tiles", "local"])
def test_windowed_attention_on_gpu_matches_reference(packed, kernel, monkeypatch):
    """bf16 through the auto backend (fa4's window_size, or tiles with reversed band squares on the causal kernel)
    vs float64 math, diagonal and band blocks."""
    if kernel == "tiles":  # as on a backend without a window kernel
        monkeypatch.delitem(kernels.documents.WINDOWED, "fa4", raising=False)
    g = torch.Generator().manual_seed(11)
    lengths = [700, 3, 1300, 45] if packed else [2048]
    n, w = sum(lengths), 256
    q, do = (torch.randn(1, n, 8, 128, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, n, 2, 128, generator=g, dtype=torch.float64) for _ in range(2))
    docs = packing.documents(_positions(lengths), window=w)
    for q_idx, k_idx in ((torch.arange(n), torch.arange(n)), (torch.arange(1024, 2048), torch.arange(0, 1024))):
        blk = docs.block(q_idx, k_idx)
        qi, ki, vi, di = q[:, q_idx], k[:, k_idx], v[:, k_idx], do[:, q_idx]
        ref = kernels.attn_forward(qi, ki, vi, True, None, "math", docs=blk)
        rg = kernels.attn_backward(di, qi, ki, vi, *ref, True, None, "math", docs=blk)
        qb, kb, vb, db = (t.cuda().bfloat16() for t in (qi, ki, vi, di))
        got = kernels.attn_forward(qb, kb, vb, True, None, docs=blk)
        gg = kernels.attn_backward(db, qb, kb, vb, *got, True, None, docs=blk)
        for a, b, name in zip((*got, *gg), (*ref, *rg), ("out", "lse", "dq", "dk", "dv")):
            keep = torch.isfinite(b) if name == "lse" else slice(None)
            assert_close(a.double().cpu()[keep], b[keep], 2e-2, f"gpu window {name} packed={packed}")


@pytest.mark.gpu
def test_facade_documents_on_gpu_match_reference():
    """bf16 on the GPU through the auto backend (FA4's varlen when installed) vs float64 per-document math."""
    g = torch.Generator().manual_seed(7)
    lengths = [1, 300, 77, 5, 1000, 64, 64, 64, 129]
    n = sum(lengths)
    q, do = (torch.randn(1, n, 8, 128, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, n, 2, 128, generator=g, dtype=torch.float64) for _ in range(2))
    docs = packing.documents(_positions(lengths))
    idx = torch.arange(n)
    ref = kernels.attn_forward(q, k, v, True, None, "math", docs=docs.block(idx, idx))
    rg = kernels.attn_backward(do, q, k, v, *ref, True, None, "math", docs=docs.block(idx, idx))
    qb, kb, vb, db = (t.cuda().bfloat16() for t in (q, k, v, do))
    got = kernels.attn_forward(qb, kb, vb, True, None, docs=docs.block(idx, idx))
    gg = kernels.attn_backward(db, qb, kb, vb, *got, True, None, docs=docs.block(idx, idx))
    for a, b, name in zip((*got, *gg), (*ref, *rg), ("out", "lse", "dq", "dk", "dv")):
        assert_close(a, b, 2e-2, f"gpu {name}")


# ----------------------------------------------------------------------------------------------
# multi-rank: models and block counting
# ----------------------------------------------------------------------------------------------
def _packings(seq_len, world):
    c = seq_len // (2 * world)  # zigzag chunk; contiguous shards are 2c
    return {
        "many short + 1-token doc": _positions([5, 1, 7, 3, 2, seq_len - 18]),
        "edges on chunks": _positions([c, c, 2 * c, seq_len - 4 * c]),
        "edges off chunks": _positions([c - 3, 2 * c + 5, seq_len - 3 * c - 2]),
        "per-row packings": torch.cat([_positions([seq_len - 1, 1]), _positions([1, 9, seq_len - 10])]),
    }


def _model_body(rank, world_size):
    from easy_context import ParallelLayout
    from tests.model_equiv import check_model_equivalence
    seq_len = 48
    modes = [("zigzag_ring_attn", {}, {}), ("dist_flash_attn", {}, {}), ("ulysses_attn", {}, {})]
    usp = None
    if world_size == 4:
        usp = ParallelLayout.build("usp_attn", ring_degree=2)
        modes.append(("usp_attn", usp.layout_kw, usp.attn_groups()))
    for mode, layout_kw, groups in modes:
        for i, (name, pos) in enumerate(_packings(seq_len, world_size).items()):
            # both routes of packed rows in every mode: the table in the model call, and the plain fixed cut
            check_model_equivalence(rank, world_size, mode, "llama", seq_len=seq_len, layout_kw=layout_kw,
                                    groups=groups, position_ids=pos, labels_mask="random",
                                    dispatch="auto" if i % 2 == 0 else None)
    # a family patch and qwen2 (bias) once per world size
    check_model_equivalence(rank, world_size, "zigzag_ring_attn", "qwen2", seq_len=seq_len, patch="family",
                            position_ids=_packings(seq_len, world_size)["edges off chunks"])
    if world_size == 4:
        _count_skipped_blocks(rank, world_size)
        _bad_positions_error(rank, world_size)
    # packed rows long enough for the balanced k-pair layout (tests/test_packed_balance.py), in the same spawn
    from tests.test_packed_balance import balanced_body
    balanced_body(rank, world_size, usp)


def _count_skipped_blocks(rank, world_size):
    """Many short documents: most ring steps' kv blocks end before the q rows start -> no kernel, no merge."""
    from easy_context import zigzag_ring_attn_func
    from easy_context.zigzag_ring_attn.attention import zigzag_ring_forward
    seq_len, calls = 64, {"fwd": 0, "merge": 0}
    orig_fwd, orig_merge = kernels._FORWARD["cpu"], kernels.merge_attn_out

    def fwd(*a):
        calls["fwd"] += 1
        return orig_fwd(*a)

    def merge(*a):
        calls["merge"] += 1
        return orig_merge(*a)
    kernels._FORWARD["cpu"], kernels.merge_attn_out = fwd, merge
    try:
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, seq_len, 2, 8, generator=g) for _ in range(3))
        from easy_context import shard_sequence
        loc = [shard_sequence("zigzag_ring_attn", t, rank, world_size) for t in (q, k, v)]
        dense = zigzag_ring_forward(*loc, 0.35)
        dense_calls = dict(calls)
        calls.update(fwd=0, merge=0)
        docs = packing.documents(_positions([4] * 16))  # 16 documents of 4 = one per zigzag chunk half
        packed = zigzag_ring_forward(*loc, 0.35, docs=docs)
    finally:
        kernels._FORWARD["cpu"], kernels.merge_attn_out = orig_fwd, orig_merge
    # dense: W blocks, W-1 merges. Packed: chunks of 8 hold two whole documents each and no document crosses a
    # chunk, so every off-diagonal ring step is skipped; the diagonal pair runs one causal piece per document.
    assert dense_calls == {"fwd": world_size, "merge": world_size - 1}, dense_calls
    assert calls == {"fwd": 4, "merge": 4}, calls  # 4 documents in the local pair, merged into the block
    ref_o = torch.cat([kernels.attention_reference(q[:, s:s + 4], k[:, s:s + 4], v[:, s:s + 4], True, 0.35)[0]
                       for s in range(0, seq_len, 4)], dim=1)
    assert_close(packed[0], shard_sequence("zigzag_ring_attn", ref_o, rank, world_size), 1e-5, "skipped-ring out")
    assert not torch.allclose(dense[0], packed[0])
    out = zigzag_ring_attn_func(*(t.clone().requires_grad_() for t in loc), softmax_scale=0.35, docs=docs)
    assert_close(out, shard_sequence("zigzag_ring_attn", ref_o, rank, world_size), 1e-5, "func out")


def _bad_positions_error(rank, world_size):
    """Positions that jump inside a document: the same clear error on every rank (no hang)."""
    import copy

    from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
    from tests.model_equiv import build_model, make_batch
    model = apply_seq_parallel_monkey_patch("zigzag_ring_attn", copy.deepcopy(build_model("llama")))
    ids, _, _ = make_batch(1, 32, model.config.vocab_size)
    pos = torch.cat([torch.arange(10), torch.arange(12, 34)]).unsqueeze(0)
    prep = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, pos, None, rank, world_size, "cpu")
    with pytest.raises(ValueError, match=r"position_ids row 0 jumps from 9 to 12 at index 10"):
        model(prep["local_input_ids"], position_ids=prep["local_position_ids"], use_cache=False)


@pytest.mark.slow  # the 4-rank spawn below runs the same modes and packings (plus USP) in the default run
def test_packed_models_2_ranks():
    run_ranks(_model_body, world_size=2, timeout=300)


def test_packed_models_4_ranks():
    run_ranks(_model_body, world_size=4, timeout=400)
