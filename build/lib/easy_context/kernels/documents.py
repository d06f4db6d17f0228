"""Document-masked attention of one block (packed rows): dense pieces per document, and diagonal runs of many
documents grouped into one varlen launch where the backend has a varlen kernel (``VARLEN``); optionally
(``RECT_VARLEN_MAX``, off by default: measured slower) a block's small rectangles in one more.

Sliding windows: a ``Window`` piece runs in one call of the backend's window kernel (``WINDOWED``: fa4's
window_size). Backends without one (cuDNN, ...) cut it into q tiles of w rows (``Window.tiles``); a tile's band
edge -- a square whose kept keys are b >= a, i.e. a causal square with q and kv reversed -- runs reversed on the
causal kernel (the flip trick), so no band runs on the math kernel. H200, 128K, window 4096 (docs/memory.md): fa4
window_size 64.8 ms, tiles with math band edges ~2 s. A document longer than the window on the diagonal joins the
varlen run of its neighbours where the varlen kernel takes a window too (``VARLEN_WINDOW``: fa4).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..packing import Band, Window
from .backends import _BACKWARD, _FORWARD
from .fa4 import (varlen_backward, varlen_forward, varlen_window_backward, varlen_window_forward, window_backward,
                  window_forward)
from .merge import merge_attn_out
from .reference import _math_backward, _math_forward


def _doc_rows(q, docs):
    """(batch slice, pieces) pairs: all rows at once when every row is packed alike, else row by row."""
    if docs.docs.uniform:
        return [(slice(None), docs.pieces(0))]
    return [(slice(b, b + 1), docs.pieces(b)) for b in range(q.shape[0])]


# Backends with a sliding-window kernel: a ``Window`` piece is one call (forward(q, k, v, left, right, scale,
# fallback) -> (out, lse); backward(dout, q, k, v, out, lse, left, right, scale, fallback) -> grads). Others cut it
# into tiles (``Window.tiles``).
WINDOWED = {"fa4": (window_forward, window_backward)}

# Backends with a varlen (cu_seqlens) kernel: a diagonal run of many documents is one launch instead of one
# per document. (forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, fallback) on (total, H, D) tensors
# -> (out, lse (H, total)); backward likewise.) Tests register a reference implementation here.
VARLEN = {"fa4": (varlen_forward, varlen_backward)}
VARLEN_MIN_DOCS = 4  # fewer documents in a run: per-document dense calls are as cheap
# Backends whose varlen kernel also takes a sliding window: under a window, a document longer than it (a causal
# ``Window`` piece on the diagonal) joins the diagonal run, which is then one windowed varlen call (documents within
# the window are unaffected by it), instead of a launch of its own that also splits the run. (forward(q, k, v, cu,
# max_len, left, scale, fallback) -> (out, lse (H, total)); backward(dout, q, k, v, out, lse, cu, max_len, left,
# scale, fallback) -> grads; key b kept for query a iff a - left <= b <= a, within each sequence.)
VARLEN_WINDOW = {"fa4": (varlen_window_forward, varlen_window_backward)}
# Rectangles (earlier rows of a document; a dispatched ring's received blocks are only rectangles) of at most
# RECT_VARLEN_MAX score elements go, when a block has >= VARLEN_MIN_RECTS of them, into one non-causal varlen call,
# rows gathered by index and merged back by index: one launch and one merge instead of one each. Off (0) by default:
# timed on the H200, grouping every rectangle was slower on the default deals at 128K and 512K (docs/packed_dispatch.md,
# 2026-12-05): large rectangles pay the gathers, index adds and a varlen kernel slower than the dense one, while small
# ones are launch-bound; a cap such as 2048 * 2048 is the untimed middle road (bench_packed.py --rect-varlen N).
RECT_VARLEN_MAX = 0
VARLEN_MIN_RECTS = 2


def _reversed_causal(c, n, m) -> bool:
    """A band edge that is a causal square once q and kv are reversed: keep b >= a, n == m."""
    return isinstance(c, Band) and c.c == 0 and n == m


def _group(name, pieces):
    """Pieces -> items: ("dense", piece), ("varlen", [causal diagonal pieces tiling one contiguous run]) or
    ("rects", [non-causal rectangles, any rows], last)."""
    items, run, rects = [], [], []

    def flush():
        if len(run) >= VARLEN_MIN_DOCS and name in VARLEN:
            items.append(("varlen", list(run)))
        else:
            items.extend(("dense", p) for p in run)
        run.clear()

    def diagonal(qs, ks, causal):  # a causal piece on the diagonal that a varlen run of this backend can take
        return qs == ks and (causal is True or (isinstance(causal, Window) and causal.causal and causal.d == 0
                                                and name in VARLEN_WINDOW))
    for p in pieces:
        qs, ks, causal = p
        if diagonal(qs, ks, causal) and (not run or run[-1][0].stop == qs.start):
            run.append(p)
            continue
        flush()
        if diagonal(qs, ks, causal):
            run.append(p)
        elif causal is False and name in VARLEN and \
                (qs.stop - qs.start) * (ks.stop - ks.start) <= RECT_VARLEN_MAX:
            rects.append(p)
        else:
            items.append(("dense", p))
    flush()
    if len(rects) >= VARLEN_MIN_RECTS:
        items.append(("rects", rects))
    else:
        items.extend(("dense", p) for p in rects)
    return items


def _flat(x, bs, span):  # (B, L, H, D) rows of a run -> (B * n, H, D) for a varlen kernel
    t = x[bs, span]
    return t.reshape(-1, *t.shape[2:])


def _cu(run, batch, device):
    return _cu_of(tuple(p[0].stop - p[0].start for p in run), batch, device)


@functools.lru_cache(maxsize=256)
def _cu_of(lens: tuple, batch: int, device: torch.device):
    """cu_seqlens on ``device``, made once per run of lengths: every layer, forward, recompute and backward asks for
    the same. The copy is non-blocking: a blocking copy from pageable host memory synchronises the stream, and one
    per varlen call drained the GPU's queue several times a layer."""
    cu = F.pad(torch.tensor(lens * batch, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    return cu.to(device, non_blocking=True), max(lens)


def _spans(slices) -> tuple:
    return tuple((s.start, s.stop) for s in slices)


@functools.lru_cache(maxsize=1024)
def _index_of(spans: tuple, device: torch.device) -> torch.Tensor:
    """The rows of ``spans`` ((start, stop) pairs, in order) as one index on ``device``, made once (non-blocking)."""
    idx = torch.cat([torch.arange(a, b) for a, b in spans])
    return idx.to(device, non_blocking=True)


@functools.lru_cache(maxsize=1024)
def _disjoint_rounds(spans: tuple) -> tuple:
    """Piece numbers in rounds whose q rows do not overlap (one index merge each; a document's q rows against two
    separate kv runs give two rectangles of the same rows, merged in two rounds)."""
    rounds: list[list[int]] = []
    for i, (a, b) in enumerate(spans):
        for rd in rounds:
            if all(b <= spans[j][0] or spans[j][1] <= a for j in rd):
                rd.append(i)
                break
        else:
            rounds.append([i])
    return tuple(tuple(rd) for rd in rounds)


def _rects_layout(q, bs, rects):
    """(batch rows, q spans, q row index, kv row index, varlen lengths (cu_q, cu_k, max_q, max_k)) of rectangles."""
    nb = q[bs].shape[0]
    qsp, ksp = _spans(p[0] for p in rects), _spans(p[1] for p in rects)
    cu_q, mq = _cu_of(tuple(b - a for a, b in qsp), nb, q.device)
    cu_k, mk = _cu_of(tuple(b - a for a, b in ksp), nb, q.device)
    return nb, qsp, _index_of(qsp, q.device), _index_of(ksp, q.device), (cu_q, cu_k, mq, mk)


def _rects_forward(name, q, k, v, bs, rects, scale, out, lse, merge=merge_attn_out):
    """The rectangles of a block in one non-causal varlen call; merged into ``out``/``lse`` (fp32) by row index."""
    nb, qsp, qi, ki, lens = _rects_layout(q, bs, rects)

    def dense():
        parts = [_FORWARD[name](q[bs, qs], k[bs, ks], v[bs, ks], False, scale) for qs, ks, _ in rects]
        return _pack_varlen(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 2), nb)
    flat = [t[bs].index_select(1, i).reshape(-1, *t.shape[2:]) for t, i in ((q, qi), (k, ki), (v, ki))]
    o, l = VARLEN[name][0](*flat, *lens, False, scale, dense)
    o = o.view(nb, -1, *o.shape[1:])
    l = l.view(l.shape[0], nb, -1).transpose(0, 1)
    rounds = _disjoint_rounds(qsp)
    at = [0]
    for a, b in qsp if len(rounds) > 1 else ():
        at.append(at[-1] + b - a)  # where each rectangle's rows start in the gathered q
    for rd in rounds:
        if len(rounds) == 1:
            idx, o_r, l_r = qi, o, l
        else:
            pos = _index_of(tuple((at[j], at[j + 1]) for j in rd), q.device)
            idx = _index_of(tuple(qsp[j] for j in rd), q.device)
            o_r, l_r = o.index_select(1, pos), l.index_select(2, pos)
        acc_o, acc_l = out[bs].index_select(1, idx), lse[bs].index_select(2, idx)
        merge(acc_o, acc_l, o_r, l_r)
        out[bs].index_copy_(1, idx, acc_o)
        lse[bs].index_copy_(2, idx, acc_l)


def _rects_backward(name, dout, q, k, v, out, lse, bs, rects, scale, grads):
    """The rectangles' gradients in one non-causal varlen call, added into the fp32 ``grads`` by row index."""
    nb, _, qi, ki, lens = _rects_layout(q, bs, rects)

    def dense():
        parts = [_BACKWARD[name](dout[bs, qs], q[bs, qs], k[bs, ks], v[bs, ks], out[bs, qs], lse[bs, :, qs], False,
                                 scale) for qs, ks, _ in rects]
        return tuple(torch.cat(x, dim=1).reshape(-1, *x[0].shape[2:]) for x in zip(*parts))
    flat = [t[bs].index_select(1, i).reshape(-1, *t.shape[2:])
            for t, i in ((dout, qi), (q, qi), (k, ki), (v, ki), (out, qi))]
    l_flat = lse[bs].index_select(2, qi).transpose(0, 1).reshape(lse.shape[1], -1).contiguous()
    g = VARLEN[name][1](*flat, l_flat, *lens, False, scale, dense)
    for acc, x, i in zip(grads, g, (qi, ki, ki)):
        acc[bs].index_add_(1, i, x.view(nb, -1, *x.shape[1:]).to(acc.dtype))


def _doc_forward(name, q, k, v, scale, docs, into=None, merge=merge_attn_out):
    """``into``: fp32 (out, lse) accumulators of all q rows to merge the pieces into (returned; None if no piece):
    a step of a ring then costs only its pieces' rows, not a full-size buffer, cast and merge. ``merge``: the
    facade's ``merge_attn_out`` (passed per call: what folds the pieces is the facade's, as for the modes)."""
    out, lse = into if into is not None else (None, None)
    hit = False
    for bs, pieces in _doc_rows(q, docs):
        for kind, item in _group(name, pieces):
            hit = True
            if out is None:
                acc = torch.float64 if q.dtype == torch.float64 else torch.float32
                out = torch.zeros(q.shape, dtype=acc, device=q.device)
                lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=acc, device=q.device)
            if kind == "rects":
                _rects_forward(name, q, k, v, bs, item, scale, out, lse, merge)
                continue
            if kind == "dense":
                qs, ks, causal = item
                o, l = _piece_forward(name, q[bs, qs], k[bs, ks], v[bs, ks], causal, scale)
            else:  # one varlen launch over a diagonal run of documents
                qs = slice(item[0][0].start, item[-1][0].stop)
                o, l = _run_forward(name, q, k, v, bs, item, scale)
            merge(out[bs, qs], lse[bs, :, qs], o, l)  # a row may get pieces of two runs
    if into is not None:
        return into if hit else None
    return None if out is None else (out.to(q.dtype), lse)


def _piece_forward(name, q, k, v, causal, scale):
    """One dense piece: causal True/False on the backend, a ``Window`` in one windowed call or in tiles, a ``Band``
    reversed onto the causal kernel when it is a causal square that way, else on the math kernel."""
    if isinstance(causal, Band):
        if _reversed_causal(causal, q.shape[1], k.shape[1]):
            o, l = _FORWARD[name](q.flip(1), k.flip(1), v.flip(1), True, scale)
            return o.flip(1), l.flip(2)
        return _math_forward(q, k, v, causal, scale)
    if not isinstance(causal, Window):
        return _FORWARD[name](q, k, v, causal, scale)
    n, m = q.shape[1], k.shape[1]
    if name in WINDOWED:
        left, right = causal.kernel_window(n, m)
        return WINDOWED[name][0](q, k, v, left, right, scale, lambda: _tiled_forward(name, q, k, v, causal, scale))
    return _tiled_forward(name, q, k, v, causal, scale)


def _tiled_forward(name, q, k, v, win, scale):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=acc, device=q.device)
    for qs, ks, c in win.tiles(q.shape[1], k.shape[1]):
        o, l = _piece_forward(name, q[:, qs], k[:, ks], v[:, ks], c, scale)
        merge_attn_out(out[:, qs], lse[:, :, qs], o, l)
    return out.to(q.dtype), lse.to(torch.float32) if acc == torch.float32 else lse


def _piece_backward(name, dout, q, k, v, out, lse, causal, scale):
    if isinstance(causal, Band):
        if _reversed_causal(causal, q.shape[1], k.shape[1]):
            g = _BACKWARD[name](*(x.flip(1) for x in (dout, q, k, v, out)), lse.flip(2), True, scale)
            return tuple(x.flip(1) for x in g)
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    if not isinstance(causal, Window):
        return _BACKWARD[name](dout, q, k, v, out, lse, causal, scale)
    n, m = q.shape[1], k.shape[1]
    if name in WINDOWED:
        left, right = causal.kernel_window(n, m)
        return WINDOWED[name][1](dout, q, k, v, out, lse, left, right, scale,
                                 lambda: _tiled_backward(name, dout, q, k, v, out, lse, causal, scale))
    return _tiled_backward(name, dout, q, k, v, out, lse, causal, scale)


def _tiled_backward(name, dout, q, k, v, out, lse, win, scale):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v)]
    for qs, ks, c in win.tiles(q.shape[1], k.shape[1]):
        g = _piece_backward(name, dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs], c, scale)
        grads[0][:, qs] += g[0]
        grads[1][:, ks] += g[1]
        grads[2][:, ks] += g[2]
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def _run_forward(name, q, k, v, bs, run, scale):
    """(out (B, n, H, D), lse (B, H, n)) of a diagonal run of documents in one varlen launch: windowed (VARLEN_WINDOW)
    when it holds a ``Window`` piece. Fallbacks: one call a document, or for a refused windowed launch the run as it
    would be without one (``_parts``)."""
    qs = slice(run[0][0].start, run[-1][0].stop)
    nb, n = q[bs].shape[0], qs.stop - qs.start
    cu, mx = _cu(run, nb, q.device)
    flat = (_flat(q, bs, qs), _flat(k, bs, qs), _flat(v, bs, qs))
    win = _run_window(run)
    if win is None:
        o, l = VARLEN[name][0](*flat, cu, cu, mx, mx, True, scale,
                               lambda: _pack_varlen(*_varlen_by_pieces(name, q[bs], k[bs], v[bs], run, scale), nb))
    else:
        def by_parts():
            got = [_run_forward(name, q, k, v, bs, part, scale) if varlen else
                   _varlen_by_pieces(name, q[bs], k[bs], v[bs], part, scale) for part, varlen in _parts(name, run)]
            return _pack_varlen(torch.cat([x[0] for x in got], 1), torch.cat([x[1] for x in got], 2), nb)
        o, l = VARLEN_WINDOW[name][0](*flat, cu, mx, win - 1, scale, by_parts)
    return o.view(nb, n, *o.shape[1:]), l.view(l.shape[0], nb, n).transpose(0, 1)


def _run_backward(name, dout, q, k, v, out, lse, bs, run, scale):
    """(dq, dk, dv) (B, n, ...) of a diagonal run in one varlen launch, as ``_run_forward``."""
    qs = slice(run[0][0].start, run[-1][0].stop)
    nb, n = q[bs].shape[0], qs.stop - qs.start
    cu, mx = _cu(run, nb, q.device)
    l_flat = lse[bs, :, qs].transpose(0, 1).reshape(lse.shape[1], -1).contiguous()
    flat = [_flat(t, bs, qs) for t in (dout, q, k, v, out)]

    def by_pieces(part):  # (B, n_part, ...) grads, one call a piece
        g = [_piece_backward(name, dout[bs, p[0]], q[bs, p[0]], k[bs, p[1]], v[bs, p[1]], out[bs, p[0]],
                             lse[bs, :, p[0]], p[2], scale) for p in part]
        return tuple(torch.cat(x, dim=1) for x in zip(*g))

    def packed(grads):  # (B, n, ...) -> the varlen layout
        return tuple(x.reshape(-1, *x.shape[2:]) for x in grads)
    win = _run_window(run)
    if win is None:
        g = VARLEN[name][1](*flat, l_flat, cu, cu, mx, mx, True, scale, lambda: packed(by_pieces(run)))
    else:
        def by_parts():
            got = [_run_backward(name, dout, q, k, v, out, lse, bs, part, scale) if varlen else by_pieces(part)
                   for part, varlen in _parts(name, run)]
            return packed(tuple(torch.cat(x, dim=1) for x in zip(*got)))
        g = VARLEN_WINDOW[name][1](*flat, l_flat, cu, mx, win - 1, scale, by_parts)
    return [x.view(nb, n, *x.shape[1:]) for x in g]


def _parts(name, run):
    """A windowed run as it goes without a windowed varlen kernel: (pieces, in one plain varlen launch?) for each
    ``Window`` piece alone and each stretch of causal pieces between them."""
    out, cur = [], []
    for p in run:
        if isinstance(p[2], Window):
            out += [cur, [p]] if cur else [[p]]
            cur = []
        else:
            cur.append(p)
    if cur:
        out.append(cur)
    return [(part, len(part) >= VARLEN_MIN_DOCS and name in VARLEN and _run_window(part) is None) for part in out]


def _run_window(run) -> int | None:
    """The window of a diagonal run holding a ``Window`` piece (one windowed varlen call), else None."""
    return next((p[2].w for p in run if isinstance(p[2], Window)), None)


def _varlen_by_pieces(name, q, k, v, run, scale):
    """Fallback of a varlen call: the run's documents one dense causal (or windowed) call each -> (out, lse)."""
    outs, lses = zip(*(_piece_forward(name, q[:, p[0]], k[:, p[1]], v[:, p[1]], p[2], scale) for p in run))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _pack_varlen(o, l, nb):  # (B, n, H, D), (B, H, n) -> the varlen layout (B*n, H, D), (H, B*n)
    return o.reshape(-1, *o.shape[2:]), l.transpose(0, 1).reshape(l.shape[1], -1)


def _doc_backward(name, dout, q, k, v, out, lse, scale, docs, into=None):
    """``into``: fp32 (dq, dk, dv) accumulators to add the pieces' gradients to (returned; None if no piece)."""
    grads = list(into) if into is not None else None
    hit = False
    for bs, pieces in _doc_rows(q, docs):
        for kind, item in _group(name, pieces):
            hit = True
            if grads is None:
                acc = torch.float64 if q.dtype == torch.float64 else torch.float32
                grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v)]
            if kind == "rects":
                _rects_backward(name, dout, q, k, v, out, lse, bs, item, scale, grads)
                continue
            if kind == "dense":
                qs, ks, causal = item
                g = _piece_backward(name, dout[bs, qs], q[bs, qs], k[bs, ks], v[bs, ks], out[bs, qs],
                                    lse[bs, :, qs], causal, scale)
            else:
                qs = ks = slice(item[0][0].start, item[-1][0].stop)
                g = _run_backward(name, dout, q, k, v, out, lse, bs, item, scale)
            grads[0][bs, qs] += g[0]
            grads[1][bs, ks] += g[1]
            grads[2][bs, ks] += g[2]
    if into is not None:
        return into if hit else None
    return None if grads is None else tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


