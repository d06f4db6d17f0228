"""Real text from what every Python installation carries: CPython's documentation topics and standard library.

    python -m easy_context real-text OUT_DIR            # writes the files below (a few seconds)
    python prepare_data.py --dataset OUT_DIR/train.jsonl --tokenizer MODEL --seq-length 65536 --output data/64K
    python eval_ppl.py -m MODEL -d OUT_DIR/heldout_long.jsonl --dataset-min-tokens 65536 --min-tokens 1024 ...
    python eval_needle.py --model MODEL --haystack_dir OUT_DIR/haystack --chat-template ...

No hub, no download: the texts are read from the running interpreter's own files, so they are reproducible for a
given Python version (``manifest.json`` records it). Licence: all of it is part of the Python distribution,
under the PSF License Agreement (Python 2.0 licence); ``pydoc_data/topics.py`` is generated from the Python
documentation, distributed under the same licence.

Sources:
* **prose**: ``pydoc_data.topics.topics``, the ~80 topics of the Python Language Reference that ``help()`` shows
  (plain text, ~465K characters in 3.11). Never trained on: it is the needle haystack (``haystack/*.txt``) and one
  held-out long prose document (``python-docs-topics``).
* **code + docstrings**: the standard library's ``.py`` files (``sysconfig.get_paths()["stdlib"]``) without
  ``site-packages``, ``encodings`` (codec tables), ``pydoc_data`` (above) and files that are not UTF-8.

Documents: a top-level module is one document; a package is one document, its ``.py`` files in sorted order each
after a ``# file: pkg/sub.py`` line (repository-level concatenation: names defined in one file are used in the
next, so the documents are long and have long-range dependencies); the ``test`` package is one document per
top-level entry (independent test files).

Split (whole documents; a held-out document is never in ``train.jsonl``): documents are ordered by the sha256 of
their name; of those with at least ``long_chars`` characters the first ``heldout_long`` are held out, and of the
rest every one whose hash falls in the first ``heldout_fraction``.

Outputs in OUT_DIR (each written to a temp name and renamed):
  train.jsonl         {"name", "source", "text"} per line: the documents to train on
  heldout.jsonl       every held-out document (code and the prose topics)
  heldout_long.jsonl  the held-out documents of >= long_chars characters (perplexity vs length / position)
  haystack/NNN-TOPIC.txt  the prose topics, one file each (eval_needle --haystack_dir; read in sorted order)
  manifest.json       python version, sources, licence, the split rule, per-file counts (documents, characters)
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

LICENSE = "PSF-2.0 (Python Software Foundation License Version 2; CPython's standard library and documentation)"
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data")
PROSE_DOC = "python-docs-topics"


@dataclass(frozen=True)
class Document:
    name: str    # "email" (a package), "argparse" (a module), "test/test_descr" (one test entry)
    source: str  # "stdlib" or "pydoc_data.topics"
    text: str


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def _py_files(root: str) -> list[str]:
    """Every .py under ``root`` in sorted order (directories walked sorted), excluded folders skipped."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS)
        out.extend(os.path.join(d, f) for f in sorted(files) if f.endswith(".py"))
    return out


def _concat(paths: list[str], lib: str) -> str:
    parts = []
    for p in paths:
        text = _read(p)
        if text and text.strip():
            parts.append(f"# file: {os.path.relpath(p, lib)}\n{text.rstrip()}\n")
    return "\n".join(parts)


def stdlib_documents(lib: str | None = None) -> list[Document]:
    """The standard library as documents (module / package / test entry), sorted by name."""
    lib = lib or sysconfig.get_paths()["stdlib"]
    docs = []
    for entry in sorted(os.listdir(lib)):
        path = os.path.join(lib, entry)
        if entry in EXCLUDED_DIRS or entry.startswith("."):
            continue
        if os.path.isfile(path) and entry.endswith(".py"):
            text = _read(path)
            if text and text.strip():
                docs.append(Document(entry[:-3], "stdlib", text))
        elif os.path.isdir(path) and entry == "test":
            for sub in sorted(os.listdir(path)):
                sp = os.path.join(path, sub)
                files = [sp] if sub.endswith(".py") else _py_files(sp) if os.path.isdir(sp) else []
                text = _concat(files, lib) if files else ""
                if text.strip() and sub not in EXCLUDED_DIRS:
                    docs.append(Document(f"test/{sub.removesuffix('.py')}", "stdlib", text))
        elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "__init__.py")):
            text = _concat(_py_files(path), lib)
            if text.strip():
                docs.append(Document(entry, "stdlib", text))
    return docs


def prose_topics() -> list[tuple[str, str]]:
    """(topic, text) of ``pydoc_data.topics``, sorted by topic name."""
    from pydoc_data.topics import topics
    return sorted((k, v.strip() + "\n") for k, v in topics.items() if v.strip())


def _rank(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def split_documents(docs: list[Document], heldout_long: int = 3, long_chars: int = 300_000,
                    heldout_fraction: float = 0.03) -> tuple[list[Document], list[Document]]:
    """(train, held-out): whole documents; the rule in the module docstring."""
    ranked = sorted(docs, key=lambda d: _rank(d.name))
    long_out = {d.name for d in [d for d in ranked if len(d.text) >= long_chars][:heldout_long]}
    cut = int(heldout_fraction * 16 ** 8)
    held = {d.name for d in ranked if d.name in long_out or
            (len(d.text) < long_chars and int(_rank(d.name)[:8], 16) < cut)}
    return [d for d in docs if d.name not in held], [d for d in docs if d.name in held]


def _atomic_write(path: str, write) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_jsonl(path: str, docs: list[Document]) -> dict:
    def write(f):
        for d in docs:
            f.write(json.dumps({"name": d.name, "source": d.source, "text": d.text}, ensure_ascii=False) + "\n")
    _atomic_write(path, write)
    return {"documents": len(docs), "characters": sum(len(d.text) for d in docs)}


def write_corpus(out_dir: str, heldout_long: int = 3, long_chars: int = 300_000,
                 heldout_fraction: float = 0.03, lib: str | None = None) -> dict:
    """Write train / held-out / long held-out jsonl, the prose haystack and manifest.json into ``out_dir``."""
    code = stdlib_documents(lib)
    if not code:
        raise ValueError(f"no standard library sources found under {lib or sysconfig.get_paths()['stdlib']!r}")
    train, held = split_documents(code, heldout_long, long_chars, heldout_fraction)
    topics = prose_topics()
    prose = Document(PROSE_DOC, "pydoc_data.topics", "\n\n".join(f"{k}\n{'*' * len(k)}\n\n{v}" for k, v in topics))
    held = held + [prose]
    files = {"train.jsonl": _write_jsonl(os.path.join(out_dir, "train.jsonl"), train),
             "heldout.jsonl": _write_jsonl(os.path.join(out_dir, "heldout.jsonl"), held),
             "heldout_long.jsonl": _write_jsonl(os.path.join(out_dir, "heldout_long.jsonl"),
                                                [d for d in held if len(d.text) >= long_chars])}
    hay = os.path.join(out_dir, "haystack")
    for i, (k, v) in enumerate(topics):
        _atomic_write(os.path.join(hay, f"{i:03d}-{''.join(c if c.isalnum() else '_' for c in k)}.txt"),
                      lambda f, v=v: f.write(v + "\n"))
    files["haystack/"] = {"documents": len(topics), "characters": sum(len(v) + 1 for _, v in topics)}
    manifest = {"python": sys.version.split()[0], "stdlib": lib or sysconfig.get_paths()["stdlib"],
                "license": LICENSE, "sources": {"stdlib": "the standard library's .py files (code + docstrings)",
                                                "pydoc_data.topics": "the Python Language Reference topics (prose)"},
                "excluded": list(EXCLUDED_DIRS),
                "split": {"rule": "documents ranked by sha256(name); the first heldout_long of >= long_chars "
                                  "characters and the rest whose hash < heldout_fraction are held out",
                          "heldout_long": heldout_long, "long_chars": long_chars,
                          "heldout_fraction": heldout_fraction},
                "heldout_names": [d.name for d in held], "files": files}
    _atomic_write(os.path.join(out_dir, "manifest.json"), lambda f: json.dump(manifest, f, indent=2))
    return manifest


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m easy_context real-text",
                                description="Real text from CPython's own documentation and standard library "
                                            "(PSF-2.0) as jsonl documents, split by whole documents.")
    p.add_argument("out", metavar="OUT_DIR")
    p.add_argument("--heldout-long", type=int, default=3, help="long documents held out (default 3)")
    p.add_argument("--long-chars", type=int, default=300_000,
                   help="a long document has at least this many characters (default 300000: ~64K tokens of code)")
    p.add_argument("--heldout-fraction", type=float, default=0.03, help="share of the other documents held out")
    p.add_argument("--stdlib", default=None, help="another standard library folder (default: this Python's)")
    args = p.parse_args(argv)
    try:
        m = write_corpus(args.out, args.heldout_long, args.long_chars, args.heldout_fraction, args.stdlib)
    except ValueError as e:
        print(f"python -m easy_context real-text: error: {e}", file=sys.stderr)
        return 2
    for name, c in m["files"].items():
        print(f"{os.path.join(args.out, name)}: {c['documents']} documents, {c['characters'] / 1e6:.2f}M characters")
    print(f"held out: {', '.join(m['heldout_names'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
