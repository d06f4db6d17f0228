"""Packed documents: position_ids that restart at 0 mark documents (Hugging Face's packing convention,
``DataCollatorWithFlattening``); attention is then causal *within* each document.

Every rank learns the global boundaries itself: one all-gather of the local position ids inside the sp group
per forward (``gather_positions``), reused by every layer (hf/attention.py caches it per position tensor). A row
without restarts is one document and takes the dense path unchanged (``documents`` returns None).

``Documents`` holds the document id of every global token, ``(B, L)`` on the CPU. A mode describes each
block it computes by the global indices of its q rows and kv rows; ``Documents.block(q_idx, k_idx)`` gives
the ``BlockDocs`` the kernel facade turns into dense pieces (``pieces``):

  kv run strictly before the q run    documents are contiguous, so at most one document spans both: the
                                      rectangle (q rows of that document) x (kv rows of it), non-causal;
                                      none -> the pair is skipped (no kernel call, no merge)
  kv run == q run (a diagonal)        one causal piece per document inside the run
  kv run after the q run              nothing (causal)
So attention costs sum(doc_len^2)/2, not L^2/2, and no varlen kernel is needed off the diagonal. A block may
hold several runs (the zigzag pair; the whole local q and kv of a k-pair ring step, sharding.py): every (q run,
kv run) pair is one of the three cases above, and the rectangles of one document that are adjacent in the block's
local rows are joined into one (``_join``) so a document crossing many fine chunks costs fewer kernel calls.

Sliding windows (Mistral's ``sliding_window``, Gemma 3's local layers) ride on the same blocks: a ``Documents``
with ``window=W`` (one document when the row is not packed) keeps key j for query i only when j > i - W (HF's
rule), also inside a document. Each piece is trimmed to the keys some row of it sees and the rows that see some key;
a piece the window leaves whole stays a plain causal / rectangle piece, the others become one ``Window`` piece:
the mask (band below, causal diagonal above) in one kernel call where the kernel has a window (fa4's
window_size), else cut by the kernel facade into q tiles of W rows (``Window.tiles``): a tile [s, e) needs
  keys [e - W, s)      seen by every row of the tile          -> a dense piece
  keys [s, e)          its causal diagonal (W rows: all inside the window) -> a causal piece
  keys [s - W + 1, e - W)  seen by some rows only (j >= i - W + 1) -> a ``Band`` piece (explicit mask)
and keys further back are skipped, so a ring step whose kv block lies wholly outside every q row's window
computes nothing, and the cost follows L * W instead of L^2 / 2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sharding import packed_rows


class PackedPositionsError(ValueError):
    pass


@dataclass(frozen=True)
class Band:
    """Mask of a piece cut by a sliding window: key b is kept for query a (piece-local) iff b - a >= c."""
    c: int


@dataclass(frozen=True)
class Window:
    """A piece under a sliding window ``w``: key b is kept for query a (piece-local) iff b - a > d - w and, when
    ``causal`` (a diagonal piece, d = 0), b <= a. ``d``: global index of the piece's first q row minus that of its
    first kv row. Pieces are trimmed so that every row keeps at least one key (a kernel never sees an empty row)."""
    w: int
    d: int
    causal: bool

    def kernel_window(self, n: int, m: int) -> tuple[int, int | None]:
        """(left, right) in flash-attention's bottom-right-aligned convention for n q rows and m keys: key b kept
        for query a iff a + m - n - left <= b (<= a + m - n + right when right is not None)."""
        return m - n - self.d + self.w - 1, (self.d - (m - n)) if self.causal else None

    def tiles(self, n: int, m: int) -> list[tuple[slice, slice, "bool | Band"]]:
        """The same mask as dense / causal / ``Band`` pieces in q tiles of w rows (kernels without a window)."""
        out, w = [], self.w
        for s in range(self.d, self.d + n, w):  # q rows in kv-local coordinates [d, d + n)
            e = min(s + w, self.d + n)
            lo, hi = max(0, s - w + 1), min(m, e)
            if lo >= hi:
                continue  # the whole piece lies before this tile's window
            full_lo, full_hi = max(lo, e - w), (min(hi, s) if self.causal else hi)
            q_sl = slice(s - self.d, e - self.d)
            if lo < min(e - w, hi):  # keys only some rows of the tile see (rows past the last one's window: none)
                q_end = min(e, min(e - w, hi) - 1 + w)
                out.append((slice(s - self.d, q_end - self.d), slice(lo, min(e - w, hi)), Band(s - w + 1 - lo)))
            if full_lo < full_hi:
                out.append((q_sl, slice(full_lo, full_hi), False))
            if self.causal:
                out.append((q_sl, slice(s, e), True))
        return out


def piece_mask(kind: "bool | Band | Window", n: int, m: int) -> torch.Tensor:
    """The (n, m) bool keep-mask a piece of n q rows and m kv rows stands for (the readable definition; tests)."""
    a, b = torch.arange(n)[:, None], torch.arange(m)[None, :]
    if kind is False:
        return torch.ones(n, m, dtype=torch.bool)
    if kind is True:
        return b <= a
    if isinstance(kind, Band):
        return b - a >= kind.c
    return (b - a > kind.d - kind.w) & ((b <= a + kind.d) if kind.causal else True)


def documents(positions: torch.Tensor, window: int | None = None) -> "Documents | None":
    """Documents of global ``positions`` (B, L); None when every row is one run of consecutive positions
    (and no ``window`` shorter than the row applies).

    Raises ``PackedPositionsError`` naming the row and index for positions that jump inside a document
    (a new document must restart at 0)."""
    pos = positions.detach().to("cpu", torch.long)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    step = pos[:, 1:] - pos[:, :-1]
    restart = pos[:, 1:] == 0
    bad = (step != 1) & ~restart
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise PackedPositionsError(
            f"position_ids row {b} jumps from {int(pos[b, i])} to {int(pos[b, i + 1])} at index {i + 1}: inside a "
            "document positions must increase by 1, and a new (packed) document must restart at 0")
    window = window if window is not None and window < pos.shape[1] else None
    if not packed_rows(pos):  # the one packed test, shared with the sharding (sharding.py)
        return None if window is None else Documents(torch.zeros_like(pos), window)
    starts = torch.zeros_like(pos, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = restart
    return Documents(torch.cumsum(starts.long(), dim=1) - 1, window)


@dataclass
class Documents:
    doc_ids: torch.Tensor  # (B, L) long, CPU, nondecreasing per row, starting at 0
    window: int | None = None  # sliding window (keys j > i - window), None = full causal
    dispatch: object = None    # dispatch.Dispatch the rows were sharded with (packed rows), None = a fixed layout

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")
        self.uniform = bool((self.doc_ids == self.doc_ids[:1]).all())  # every batch row packed alike
        # some row has a second document, i.e. its positions restart at 0 after index 0: sharding.packed_rows of
        # the positions ``documents`` was built from (what the sharding decided the layout on)
        self.packed = bool((self.doc_ids[:, -1] > 0).any())
        self._pieces: dict = {}
        self._windowed: dict = {}

    def with_window(self, window: int | None) -> "Documents":
        """The same documents under a sliding window (cached: every local layer asks for the same one)."""
        if window is None or window >= self.length:
            window = None
        if window == self.window:
            return self
        hit = self._windowed.get(window)
        if hit is None:
            hit = self._windowed[window] = Documents(self.doc_ids, window, self.dispatch)
            hit.packed = self.packed  # chunk-cut documents keep the layout flag of the cut (with_chunks)
        return hit

    def with_chunks(self, chunk: int) -> "Documents":
        """The same rows with every document also cut where its position is a multiple of ``chunk`` (Llama 4's
        chunked local attention, each document as if alone: its chunks start at its own position 0). The layout
        flags (``packed``, ``dispatch``) stay those of the cut: chunks change the mask, not how the row was sharded."""
        if chunk >= self.length:
            return self
        key = ("chunks", chunk)
        hit = self._windowed.get(key)
        if hit is None:
            new_doc = torch.ones_like(self.doc_ids, dtype=torch.bool)
            new_doc[:, 1:] = self.doc_ids[:, 1:] != self.doc_ids[:, :-1]
            idx = torch.arange(self.length).expand_as(self.doc_ids)
            start = torch.cummax(torch.where(new_doc, idx, torch.zeros_like(idx)), dim=1).values
            cut = new_doc | ((idx - start) % chunk == 0)
            hit = Documents(torch.cumsum(cut.long(), dim=1) - 1, self.window, self.dispatch)
            hit.packed = self.packed
            self._windowed[key] = hit
        return hit

    @property
    def length(self) -> int:
        return self.doc_ids.shape[1]

    def pairs(self, world: int) -> int:
        """k of the zigzag ring layout these rows were sharded in over ``world`` ring ranks (1 unless packed)."""
        from .sharding import zigzag_pairs
        return zigzag_pairs(self.length, world) if self.packed else 1

    def block(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> "BlockDocs":
        return BlockDocs(self, q_idx.cpu(), k_idx.cpu())

    def count(self) -> int:
        return int(self.doc_ids[:, -1].max()) + 1


def _runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: (offset in the block, global start, length)."""
    cuts = [0] + ((idx[1:] != idx[:-1] + 1).nonzero().flatten() + 1).tolist() + [len(idx)]
    return [(s, int(idx[s]), e - s) for s, e in zip(cuts[:-1], cuts[1:])]


@dataclass
class BlockDocs:
    """One block's rows (global indices of its q and kv rows) and the documents they lie in."""
    docs: Documents
    q_idx: torch.Tensor
    k_idx: torch.Tensor

    def pieces(self, row: int = 0) -> list[tuple[slice, slice, bool]]:
        """Dense sub-blocks (q rows, kv rows, causal) of batch row ``row`` that the document mask keeps
        (cached on the Documents: every layer asks for the same blocks)."""
        qr, kr = _runs(self.q_idx), _runs(self.k_idx)
        key = (tuple(qr), tuple(kr), row if not self.docs.uniform else 0)
        hit = self.docs._pieces.get(key)
        if hit is None:
            hit = self.docs._pieces[key] = _pieces(self.docs.doc_ids[key[2]], qr, kr, self.docs.window)
        return hit


def _pieces(d: torch.Tensor, q_runs, k_runs, window=None) -> list[tuple[slice, slice, "bool | Window"]]:
    out = []

    def add(qo, qg, n, ko, kg, m, causal):  # a piece in block offsets (qo, ko) and global starts (qg, kg)
        if window is None:
            out.append((slice(qo, qo + n), slice(ko, ko + m), causal))
        else:
            out.extend(_windowed(qo, qg, n, ko, kg, m, causal, window))
    for qo, qa, qn in q_runs:
        for ko, ka, kn in k_runs:
            if ka == qa and kn == qn:  # a diagonal run: one causal piece per document
                seg = d[qa:qa + qn]
                cuts = [0] + ((seg[1:] != seg[:-1]).nonzero().flatten() + 1).tolist() + [qn]
                for s, e in zip(cuts[:-1], cuts[1:]):
                    add(qo + s, qa + s, e - s, ko + s, ka + s, e - s, True)
            elif ka + kn <= qa:  # kv strictly before q: the one document spanning both, if any
                doc = int(d[qa])
                if int(d[ka + kn - 1]) != doc:
                    continue  # every kv document ended before the q documents start: skipped
                qe = int((d[qa:qa + qn] == doc).sum())
                ks = kn - int((d[ka:ka + kn] == doc).sum())
                add(qo, qa, qe, ko + ks, ka + ks, kn - ks, False)
            elif ka >= qa + qn:
                continue  # kv after q: masked by causality
            else:
                raise AssertionError(f"q run [{qa}, {qa + qn}) and kv run [{ka}, {ka + kn}) partly overlap: "
                                     "not a block of a causal schedule")
    return out if window is not None else _join(out)


def _join(pieces):
    """Fewer kernel calls: diagonal pieces first (in order, so a varlen backend takes them in one launch), then
    the rectangles, with those that are contiguous in the block's local rows joined: one document crossing several
    chunks of a fine (k-pair) layout gives one rectangle per (q chunk, kv chunk), and the union of adjacent ones
    with the same q rows (or the same kv rows) is again a rectangle of that document."""
    diag = [p for p in pieces if p[2] is True]
    by_q: list = []
    for qs, ks, _ in (p for p in pieces if p[2] is False):  # same q rows, next kv rows (consecutive in the list)
        if by_q and by_q[-1][0] == qs and by_q[-1][1].stop == ks.start:
            by_q[-1] = (qs, slice(by_q[-1][1].start, ks.stop), False)
        else:
            by_q.append((qs, ks, False))
    rects: list = []
    open_at: dict = {}  # (kv start, kv stop, q stop) -> index of the rectangle that the next q rows could extend
    for qs, ks, _ in by_q:
        j = open_at.pop((ks.start, ks.stop, qs.start), None)
        if j is None:
            j = len(rects)
            rects.append((qs, ks, False))
        else:
            rects[j] = (slice(rects[j][0].start, qs.stop), ks, False)
        open_at[(ks.start, ks.stop, qs.stop)] = j
    return diag + rects


def _windowed(qo, qg, n, ko, kg, m, causal, w):
    """Trim one piece (q rows [qg, qg+n), kv rows [kg, kg+m) globally; ``causal``: a diagonal piece, else every kv
    row precedes every q row) to what the window rule j > i - w keeps: [] (nothing), the plain piece (the window
    cuts nothing) or one ``Window`` piece."""
    if causal:
        return [(slice(qo, qo + n), slice(ko, ko + m), True if n <= w else Window(w, 0, True))]
    k0 = max(0, qg - w + 1 - kg)                 # keys before this are seen by no row
    n = min(n, kg + m + w - 1 - qg)              # rows from this on see no key
    if n <= 0 or k0 >= m:
        return []
    d = qg - (kg + k0)
    q_sl, k_sl = slice(qo, qo + n), slice(ko + k0, ko + m)
    return [(q_sl, k_sl, False if n - 1 + d < w else Window(w, d, False))]


def gather_positions(mode, local: torch.Tensor, groups: dict, dispatch=None,
                     check_rows: int | None = None, require_table: bool = False) -> torch.Tensor:
    """The global (B, L) positions of the sequence this sp group shares, from every rank's local ones.

    Packed rows cut by a ``dispatch`` table (dispatch/plan.py; the one the model call carries) are un-cut by it: every
    rank adds its table's digest to the gathered tensor, so a rank without it or with another one is an error on
    every rank alike, before anything is computed, and the table's fingerprint must match the gathered positions.
    Without a table packed rows are in the mode's fixed cut (the k-pair zigzag under zigzag_ring_attn / usp_attn),
    decided from the gathered positions in rank order (``sharding.packed_rows`` reads the same there as on the
    global positions the inputs were sharded with). ``require_table``: the caller (a ``ParallelLayout`` patch) knows
    packed rows come dispatched, so packed rows without a table are an error, not a guess."""
    import torch.distributed as dist

    digest = 0 if dispatch is None else dispatch.digest()

    def gather(t, group):
        t = torch.cat([t.long(), t.new_full((t.shape[0], 1), digest, dtype=torch.long)], dim=1).contiguous()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        seen = sorted({int(p[0, -1]) for p in parts})
        if len(seen) > 1:
            from .dispatch.table import DispatchError
            raise DispatchError(
                f"{mode.name}: the ranks' model calls carry different dispatch tables (digests {seen}; 0 = none): "
                "every rank must pass the model_kwargs prepare_seq_parallel_inputs returned for the same global batch")
        return [p[:, :-1] for p in parts]

    if not (dist.is_available() and dist.is_initialized()):
        return local
    full = mode.gather_positions(local, groups, gather, dispatch)  # the Mode (``layout.mode``) undoes its own cut
    if dispatch is not None:  # ``check_rows``: the leading rows that are the positions (callers may append rows)
        from .dispatch.table import check_fingerprint
        check_fingerprint(dispatch, full if check_rows is None else full[:check_rows], mode.name)
    if full is not local and require_table:  # one rank in the group: nothing was cut, nothing to check
        _check_dispatched(mode, full if check_rows is None else full[:check_rows], dispatch)
    return full


def unshard_gathered(mode, parts, dispatch=None, **kw) -> torch.Tensor:
    """Global positions from the rank-order local ones: by the dispatch table, else (fixed cuts) the k-pair
    count read off the gathered positions."""
    from .sharding import layout_pairs
    if dispatch is not None:
        from .dispatch.table import check_world
        check_world(dispatch, len(parts), sum(p.shape[1] for p in parts), mode.name)
        return dispatch.unshard(parts, dim=1)
    cat = torch.cat(parts, dim=1)
    return mode.unshard(parts, dim=1, pairs=layout_pairs(cat, cat.shape[1], len(parts)), **kw)


def _check_dispatched(mode, full: torch.Tensor, dispatch) -> None:
    """Packed rows that a ``ParallelLayout`` dispatches must arrive with their table (a fixed cut would be a guess)."""
    from .dispatch.table import DISPATCH_KWARG, DispatchError
    if dispatch is not None or not packed_rows(full) or not mode.dispatches:
        return
    raise DispatchError(
        f"{mode.name}: these rows are packed (position_ids restart at 0) and the model was patched with a "
        f"ParallelLayout, whose prepare_inputs deals packed rows by a dispatch table, but the model call carries none: "
        f"pass **prepared.model_kwargs to the model ({DISPATCH_KWARG}=...), or cut with "
        "prepare_seq_parallel_inputs(...) without dispatch= and patch with the mode name")


__all__ = ["documents", "Documents", "Band", "Window", "piece_mask", "BlockDocs", "PackedPositionsError", "gather_positions"]
