"""Training data: load a packed dataset, validate it, pack token streams, a resumable dp-sharded loader.

A training dataset is a table with an ``input_ids`` column whose rows hold at least ``seq_length + 1``
tokens (packed text; ``prepare_data.py`` makes one). Batches are a pure function of (seed, epoch,
index); the loader's ``state_dict`` (epoch, batch) is stored in checkpoints.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import torch

from .errors import UsageError

PREP_HINT = "tokenize and pack it with: python prepare_data.py --dataset TEXT --tokenizer MODEL --seq-length {L} --output DIR"


def load_any_dataset(name: str, split: str = "train", subset: str | None = None):
    """Hub name (``subset``: its config name), a ``save_to_disk`` directory, or json/jsonl/parquet/arrow/csv/txt
    files (their one split is "train"); unreadable input (an empty file, non-UTF-8 text, malformed json) is one
    UsageError line. Shared by train.py, prepare_data.py and the evals."""
    if os.path.isfile(name) and os.path.getsize(name) == 0:
        raise UsageError(f"dataset {name!r} is an empty file (no rows)")
    try:
        return _load_any_dataset(name, split, subset)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets wraps parse errors; report the root cause in one line
        root = e
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        from .writes import WRITE_ERRNOS, write_error
        if isinstance(root, OSError) and root.errno in WRITE_ERRNOS:  # datasets' cache could not be written: 74
            raise write_error(root, "the datasets cache for", name, then="then rerun") from None
        if isinstance(root, UnicodeDecodeError):
            raise UsageError(f"dataset {name!r} is not UTF-8 text ({root.reason} at byte {root.start}); convert it "
                             "to UTF-8 first") from None
        raise UsageError(f"cannot read dataset {name!r}: {type(root).__name__}: "
                         f"{str(root).splitlines()[0] if str(root) else ''}") from None


def _load_any_dataset(name: str, split: str = "train", subset: str | None = None):
    import datasets

    ext = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv",
           ".txt": "text"}
    if os.path.isdir(name) and (os.path.exists(os.path.join(name, "dataset_info.json"))
                                or os.path.exists(os.path.join(name, "dataset_dict.json"))):
        ds = datasets.load_from_disk(name)
    elif os.path.isfile(name) and os.path.splitext(name)[1] in ext:
        ds = datasets.load_dataset(ext[os.path.splitext(name)[1]], data_files=name, split="train")
    elif os.path.exists(name):
        ds = datasets.load_dataset(name, split=split)  # a folder of data files
    else:
        try:
            ds = datasets.load_dataset(name, name=subset, split=split)
        except Exception as e:  # noqa: BLE001 - reported as one line
            raise UsageError(f"cannot load dataset {name!r}: not a local path and the Hub said "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UsageError(f"dataset {name!r} has no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    return ds


OPTIONAL = ("labels", "position_ids")  # packed documents / chat data (easy_context_train/packed_data.py)


def validate_packed(ds, name: str, seq_length: int, vocab_size: int | None = None, model: str | None = None):
    """Keep ``input_ids`` (+ ``labels``/``position_ids`` when present); every row must hold >= seq_length + 1
    tokens (checked on Arrow offsets); labels/positions rows must match (checked row by row, vectorised); with
    ``vocab_size`` (the model's), every token id (and label other than -100) must be in [0, vocab_size)."""
    if "input_ids" not in ds.column_names:
        raise UsageError(f"dataset {name!r} has no 'input_ids' column (columns: {', '.join(ds.column_names)}); "
                         + PREP_HINT.format(L=seq_length))
    ds = ds.select_columns(["input_ids"] + [c for c in OPTIONAL if c in ds.column_names])
    if len(ds) == 0:
        raise UsageError(f"dataset {name!r} is empty (0 rows)")
    feat = ds.features["input_ids"]
    inner = getattr(feat, "feature", None)
    if inner is None or getattr(inner, "dtype", "").startswith(("string", "large_string", "float")):
        raise UsageError(f"dataset {name!r}: 'input_ids' must be lists of token ids (integers); got {feat}. "
                         + PREP_HINT.format(L=seq_length))
    shortest = _min_row_length(ds)
    if shortest < seq_length + 1:
        raise UsageError(f"dataset {name!r} has rows of {shortest} tokens but --seq-length {seq_length} needs "
                         f">= {seq_length + 1} per row; " + PREP_HINT.format(L=seq_length))
    if len(ds.column_names) > 1:
        _check_packed_columns(ds, name)
    if vocab_size is not None:
        _check_token_ids(ds, name, vocab_size, model)
    if "labels" in ds.column_names:
        _check_trainable(ds, name, seq_length)
    return ds.with_format("torch")


MOSTLY_MASKED = 0.5  # below this trainable share of the targets, the run says so once (not an error)


def trainable_fraction(ds, seq_length: int) -> tuple[int, int]:
    """(trainable targets, all targets) as train.py reads them (``packed_data.batch_targets``): ``labels[1:L + 1]``
    other than -100 and not a document's first token (``position_ids`` 0); Arrow, one batch of rows at a time."""
    import numpy as np
    import pyarrow.compute as pc
    table = ds.data.table if ds._indices is None else ds.with_format(None).data.table
    cols = [c for c in ("labels", "position_ids") if c in table.column_names]
    good = total = 0
    for rb in table.select(cols).to_batches(max_chunksize=256):
        cut = {c: pc.list_flatten(pc.list_slice(rb.column(i), 1, seq_length + 1)).to_numpy(zero_copy_only=False)
               for i, c in enumerate(cols)}
        ok = cut["labels"] != -100
        if "position_ids" in cut:
            ok &= cut["position_ids"] != 0
        good, total = good + int(np.count_nonzero(ok)), total + len(ok)
    return good, total


def _check_trainable(ds, name: str, seq_length: int) -> None:
    """Nothing to learn is an error (a loss of 0.0 every step); mostly masked labels are said once, with the share."""
    good, total = trainable_fraction(ds, seq_length)
    if good == 0:
        raise UsageError(f"dataset {name!r}: every target of the 'labels' column is -100 (masked) in the "
                         f"{len(ds)} rows: there is nothing to learn (the loss would be 0.0 at every step). Likely "
                         "cause: a chat template that never marks an assistant turn, so no token is labelled; check "
                         "the template (prepare_data.py --format chat labels the assistant turns) or drop the "
                         "'labels' column to train on every token")
    if good < MOSTLY_MASKED * total and os.environ.get("RANK", "0") == "0":
        print(f"train.py: warning: dataset {name!r}: only {100 * good / total:.1f}% of the targets are trainable "
              f"({good} of {total}; the rest of 'labels' is -100): the loss and its gradient come from those",
              flush=True)


def data_identity(ds, samples: int = 64) -> dict:
    """What the rows are, for run.json (compared on --resume): row count, token count and the sha256 of up to
    ``samples`` evenly spaced rows (every column), cheap at any size; a dataset replaced at the same path differs."""
    import hashlib

    import numpy as np
    import pyarrow.compute as pc
    n, arrow = len(ds), ds.with_format("arrow")
    idx = sorted({int(i) for i in np.linspace(0, n - 1, num=min(n, samples))}) if n else []
    h = hashlib.sha256()
    sub = arrow[idx] if idx else None
    for col in sorted(ds.column_names):
        h.update(col.encode())
        if sub is not None:
            h.update(pc.list_flatten(sub.column(col)).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
    tokens = int(pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0)  # the underlying table's
    return {"rows": n, "tokens": tokens, "sha256": h.hexdigest()[:16]}


def _check_token_ids(ds, name: str, vocab_size: int, model: str | None) -> None:
    """Every id in [0, vocab_size) (labels: or -100): one pass of Arrow min/max per column, the first bad one
    located only when there is one. An id outside the embedding would crash mid-step (or index memory on a GPU)."""
    import numpy as np
    import pyarrow.compute as pc
    table = ds.data.table if ds._indices is None else ds.with_format(None).data.table
    for col in ("input_ids", "labels"):
        if col not in table.column_names:
            continue
        flat = pc.list_flatten(table.column(col))
        vals = pc.filter(flat, pc.not_equal(flat, -100)) if col == "labels" else flat
        mm = pc.min_max(vals).as_py() if len(vals) else {"min": 0, "max": 0}
        if mm["min"] >= 0 and mm["max"] < vocab_size:
            continue
        base = 0
        for rb in table.select([col]).to_batches(max_chunksize=256):
            arr = rb.column(0)
            ids = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64)
            bad = (ids < 0) | (ids >= vocab_size)
            if col == "labels":
                bad &= ids != -100
            if bad.any():
                i = int(np.nonzero(bad)[0][0])
                ends = np.cumsum(pc.list_value_length(arr).to_numpy(zero_copy_only=False))
                row = int(np.searchsorted(ends, i, side="right"))
                at = i - (int(ends[row - 1]) if row else 0)
                what = "token id" if col == "input_ids" else "label (a token id or -100)"
                raise UsageError(f"dataset {name!r} row {base + row}: {what} {ids[i]} at index {at} is outside the "
                                 f"vocabulary of --model {model or 'the model'} (vocab_size {vocab_size}: ids 0.."
                                 f"{vocab_size - 1}); was it tokenized with another tokenizer? "
                                 + PREP_HINT.format(L="N").replace("MODEL", model or "MODEL"))
            base += rb.num_rows


def _check_packed_columns(ds, name: str) -> None:
    """labels / position_ids of every row: same length as input_ids; positions restart at 0 or step by 1."""
    import numpy as np
    import pyarrow.compute as pc
    table = ds.data.table if ds._indices is None else ds.with_format(None).data.table
    base = 0
    for rb in table.to_batches(max_chunksize=256):
        lens = pc.list_value_length(rb.column(rb.schema.get_field_index("input_ids"))).to_numpy()
        for col in ("labels", "position_ids"):
            if col not in rb.schema.names:
                continue
            arr = rb.column(rb.schema.get_field_index(col))
            clen = pc.list_value_length(arr).to_numpy()
            bad = np.nonzero(clen != lens)[0]
            if len(bad):
                r = base + int(bad[0])
                raise UsageError(f"dataset {name!r} row {r}: {col!r} has {clen[bad[0]]} entries but 'input_ids' has "
                                 f"{lens[bad[0]]}")
            if col == "position_ids":
                flat = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64)
                starts = np.zeros(len(flat), dtype=bool)
                starts[np.cumsum(clen)[:-1]] = True
                starts[0:1] = True
                ok = starts.copy()
                ok[1:] |= (flat[1:] == 0) | (flat[1:] == flat[:-1] + 1)
                if not ok.all():
                    i = int(np.nonzero(~ok)[0][0])
                    row = int(np.searchsorted(np.cumsum(clen), i, side="right"))
                    at = i - int(np.concatenate([[0], np.cumsum(clen)])[row])
                    raise UsageError(f"dataset {name!r} row {base + row}: position_ids jump from {flat[i - 1]} to "
                                     f"{flat[i]} at index {at}; inside a document they increase by 1 and a new "
                                     "document restarts at 0")
        base += rb.num_rows


def _min_row_length(ds) -> int:
    import pyarrow.compute as pc

    col = ds.data.column("input_ids")
    lengths = pc.list_value_length(col)
    if ds._indices is not None:  # a selected/shuffled view: fall back to the rows themselves
        return min(len(r) for r in ds["input_ids"])
    return int(pc.min(lengths).as_py())


def pack_documents(token_docs, seq_length: int, output: str, bos_id, eos_id, progress: bool = True,
                   keep_remainder: bool = False) -> str:
    """BOS + doc + EOS, concatenated and cut into rows of seq_length + 1; saved atomically to ``output``."""
    import datasets
    from tqdm.auto import tqdm

    row = seq_length + 1

    def rows():
        buf: list[int] = []
        for doc in tqdm(token_docs, desc="packing", unit="doc", disable=not progress):
            buf.extend(([bos_id] if bos_id is not None else []) + list(doc) + ([eos_id] if eos_id is not None else []))
            start = 0
            while len(buf) - start >= row:
                yield {"input_ids": buf[start:start + row]}
                start += row
            del buf[:start]
        if keep_remainder and buf:
            yield {"input_ids": buf}

    from datasets.arrow_writer import ArrowWriter

    feats = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    with scratch_dir(output) as work:  # streamed to disk (memory stays one row), in a directory of our own
        scratch = os.path.join(work, "rows.arrow")
        with ArrowWriter(features=feats, path=scratch) as writer:
            for r in rows():
                writer.write(r)
            writer.finalize()
        ds = None
        try:
            ds = datasets.Dataset.from_file(scratch)
            if len(ds) == 0:
                raise UsageError(f"not enough tokens for one row of {row} tokens")
            save_dataset_atomic(ds, output)
        finally:
            del ds
    return output


MARKER = ".easy_context_dataset"  # written into every dataset prepare_data.py saves


def check_output_dataset(output: str, overwrite: bool = False, inputs: tuple = ()) -> None:
    """Refuse to destroy what this tool did not write: ``output`` must be absent, an empty directory, or (with
    ``overwrite``) a dataset prepare_data.py wrote; never one of the ``inputs``."""
    real = os.path.realpath(output)
    for src in inputs:
        if src and os.path.exists(src) and (real == os.path.realpath(src)
                                            or real.startswith(os.path.realpath(src).rstrip("/") + "/")):
            raise UsageError(f"--output {output!r} is (inside) the input {src!r}; write to another directory")
    if not os.path.exists(output):
        check_parent = os.path.dirname(os.path.abspath(output))
        from .run_dir import check_writable_dir
        check_writable_dir(check_parent, "--output (its directory)")
        return
    if not os.path.isdir(output):
        raise UsageError(f"--output {output!r} is a file; pass a directory path that does not exist yet")
    if not os.listdir(output):
        return
    if not os.path.exists(os.path.join(output, MARKER)):
        raise UsageError(f"--output {output!r} is a non-empty directory that prepare_data.py did not write; "
                         "nothing was touched: choose a new directory")
    if not overwrite:
        raise UsageError(f"--output {output!r} already holds a prepared dataset; pass --overwrite to replace it")


SCRATCH = ".prepare-"  # OUTPUT's sibling ``.NAME.prepare-XXXXXXXX``: created (mkdtemp) and removed by this tool only
OWNER = "owner.json"


@contextlib.contextmanager
def scratch_dir(output: str):
    """A new private directory next to ``output`` (same file system: the final rename is atomic), removed on exit.
    Nothing that existed before is touched: the name is new (mkdtemp), so a user's ``OUTPUT.tmp`` / ``OUTPUT.old``
    stay as they are. One left by a killed run (its owner's pid is dead) is cleaned up first."""
    import socket
    import tempfile
    parent, name = os.path.split(os.path.abspath(output.rstrip("/")))
    os.makedirs(parent, exist_ok=True)  # --output's parent may not exist yet (data/NAME on a fresh clone)
    recover_scratch(output)
    work = tempfile.mkdtemp(prefix=f".{name}{SCRATCH}", dir=parent)
    with open(os.path.join(work, OWNER), "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "output": output}, f)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def recover_scratch(output: str) -> None:
    """Scratch directories of a killed ``prepare_data.py`` for ``output`` (ours by name, owner file and dead pid on
    this host): a previous dataset it had moved aside is put back when ``output`` is missing, the rest removed."""
    import socket
    parent, name = os.path.split(os.path.abspath(output.rstrip("/")))
    prefix = f".{name}{SCRATCH}"
    for n in os.listdir(parent) if os.path.isdir(parent) else ():
        work = os.path.join(parent, n)
        try:
            with open(os.path.join(work, OWNER)) as f:
                owner = json.load(f)
            pid, host = int(owner["pid"]), owner["host"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not n.startswith(prefix) or host != socket.gethostname() or _alive(pid):
            continue
        old = os.path.join(work, "old")
        if os.path.isdir(old) and not os.path.exists(output):
            os.replace(old, output)
            print(f"note: put back {output} (a prepare_data.py run was killed while replacing it)", flush=True)
        shutil.rmtree(work, ignore_errors=True)


def _alive(pid: int) -> bool:
    from .run_dir import _pid_alive  # one copy (the run lock's)
    return _pid_alive(pid)


def save_dataset_atomic(ds, output: str) -> None:
    """save_to_disk into a new scratch directory next to ``output``, then rename: ``output`` is either complete or
    absent. An existing ``output`` (a dataset this tool wrote, see ``check_output_dataset``) is moved into the
    scratch directory first and removed with it; no other path is created or removed."""
    with scratch_dir(output) as work:
        tmp = os.path.join(work, "new")
        ds.save_to_disk(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            f.write("written by easy_context prepare_data.py\n")
        if os.path.exists(output):
            if os.path.isdir(output) and os.listdir(output) and not os.path.exists(os.path.join(output, MARKER)):
                raise UsageError(f"refusing to replace {output!r}: it is not a dataset prepare_data.py wrote")
            os.replace(output, os.path.join(work, "old"))
        os.replace(tmp, output)


def make_loader(ds, layout, batch_size: int, seq_length: int, seed: int, accelerator, balance: str = "auto"):
    """Rows sharded over data-parallel ranks only (``easy_context.data.prepare_dataloader``); the sp ranks
    of one group get the same rows. Seeded per-epoch shuffle; ``state_dict()`` gives the data position.
    ``balance`` ("auto": when rows are packed, i.e. have position_ids, and dp > 1; "on"; "off"): every dp rank gets
    about the same sum of squared document lengths per step (easy_context_train/dp_balance.py)."""
    from torch.utils.data import DataLoader

    from easy_context.data import prepare_dataloader

    if len(ds) < batch_size * layout.dp:
        raise UsageError(f"dataset has {len(ds)} rows, fewer than --batch-size x data-parallel size = "
                         f"{batch_size * layout.dp}")
    cols = [c for c in ("input_ids",) + OPTIONAL if c in ds.column_names]

    def collate(rows):  # {column: (batch, seq_length + 1)}; see packed_data.batch_targets
        return {c: torch.stack([r[c][: seq_length + 1] for r in rows]).long() for c in cols}
    dl = DataLoader(ds, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=collate)
    loader = prepare_dataloader(dl, layout, accelerator, seed=seed)
    if balance not in ("auto", "on", "off"):
        raise UsageError(f"--dp-balance must be auto, on or off; got {balance!r}")
    if balance == "off" or (balance == "auto" and ("position_ids" not in cols or loader.dp == 1)):
        return loader
    from .dp_balance import BalancedLoader, row_costs
    costs = row_costs(ds, length=seq_length + 1) if "position_ids" in cols else [1.0] * len(ds)
    return BalancedLoader(ds, costs, batch_size, collate, loader.dp, loader.dp_rank, shuffle=True, seed=seed,
                          drop_last=True, device=loader.device)


def forever(loader):
    """Batches across epochs (each epoch reshuffled); EasyContext stopped when the data ran out."""
    while True:
        yield from loader
