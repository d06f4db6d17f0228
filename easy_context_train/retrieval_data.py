"""The retrieval curriculum as training rows: `python -m easy_context retrieval-data` (issue #64; #48's stage 4).

    python -m easy_context retrieval-data --tokenizer MODEL --haystack DIR/train.jsonl --seq-length 65536 \
        --rows 160 --output data/retrieval_65536

Why: a small instruct model fine-tuned only on raw long text keeps its perplexity but loses the habit of answering
about a long prompt; #48's first fix trained eval_needle's own needle and question, and the model learned that
format (held-out wordings 0.65-0.95, RULER 8 %). These rows teach the skill instead (``curriculum/``):

* needle kinds: numbers, words, key-value pairs, several facts with distractors (one asked, all values of one key,
  several keys at once), multi-hop variable chains (the end value, or every name holding a value), and spans of the
  haystack itself (the line after / before a quoted line); follow-up turns on other facts;
* wordings: several needle, question and answer phrasings per kind, 9 prompt frames (question after, before, or
  both), a given reply lead now and then; every template id and word 4-gram disjoint from eval_needle's, RULER's
  and the held-out probes' (``easy_context/haystack/heldout.py``), checked by tests/test_curriculum.py;
* haystacks: the given documents (the training split: CPython's code), their docstrings (prose), generated prose;
* mixed with generated short chat turns and a raw-text piece per row; the loss weighting is stated in
  ``curriculum/rows.py`` (default: raw text half of a mixed row's loss, the replies the other half).

Rows: ``seq_length + 1`` tokens, positions restarting per document, labels only on replies (+ their end-of-turn
token) and on the raw piece's tail. The chat markup is the tokenizer's template rendered around placeholder contents
and tokenized on its own, the way ``evals.ChatWrap`` builds the evals' prompts.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import re
import sys
import textwrap

from easy_context.haystack import ending_ids, filler_text
from easy_context.loss import IGNORE_INDEX

from .curriculum import rows as R
from .curriculum.markup import ChatMarkup

PROG = "python -m easy_context retrieval-data"
_DOC = re.compile(r'"""(.*?)"""', re.S)


def docstrings(texts: list[str], min_chars: int = 200) -> list[str]:
    """The long docstrings of the documents, dedented: prose written by people, from the training split itself."""
    return [textwrap.dedent(m.group(1)).strip() for t in texts for m in _DOC.finditer(t)
            if len(m.group(1)) >= min_chars]


def _init(tok_path: str, streams) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_path)
    R.init(tok, ChatMarkup(tok), streams)


def _row(job) -> dict:
    cfg, seed, index = job
    return R.row(cfg, seed, index)


def build_rows(tok_path: str, haystack_jsonl: list[str], seq_length: int, rows: int, seed: int = 0,
               workers: int = 1, **cfg_kw) -> list[dict]:
    """``rows`` training rows; ``cfg_kw``: the ``RowConfig`` fields (min_length, full_share, raw_share, ...)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_path)
    ChatMarkup(tok)  # fail here, not in a worker
    texts = []
    for path in haystack_jsonl:
        with open(path, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    random.Random(seed).shuffle(texts)
    row_len = seq_length + 1
    cfg = R.RowConfig(row_len=row_len, pad=tok.pad_token_id if tok.pad_token_id is not None else
                      (tok.eos_token_id or 0), **cfg_kw)
    if cfg.min_length > row_len:
        raise ValueError(f"--min-length {cfg.min_length} exceeds a row of {row_len} tokens")
    limit = max(4 * row_len, 1 << 21)  # enough distinct text that rows rarely repeat a slice
    streams = tuple(R.stream(t, limit, tok, ending_ids) for t in
                    (texts, docstrings(texts) or texts, [filler_text(20_000, seed)]))
    for name, (ids, _) in zip(R.STREAMS, streams):
        if len(ids) < row_len:
            raise ValueError(f"the {name} haystack holds {len(ids)} tokens, fewer than one row ({row_len}): give "
                             "--haystack more documents or lower --seq-length")
    jobs = [(cfg, seed, r) for r in range(rows)]
    if workers > 1:
        with mp.get_context("fork").Pool(workers, _init, (tok_path, streams)) as pool:
            return pool.map(_row, jobs, chunksize=max(1, rows // (4 * workers)))
    _init(tok_path, streams)
    return [_row(j) for j in jobs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="the model's directory (its chat template)")
    p.add_argument("--haystack", required=True, nargs="+", help="jsonl files with a 'text' column (training split)")
    p.add_argument("--seq-length", type=int, required=True, help="rows hold seq_length + 1 tokens")
    p.add_argument("--rows", type=int, required=True, help="rows to write")
    p.add_argument("--output", required=True, help="dataset directory (written to a temp name, then renamed)")
    p.add_argument("--min-length", type=int, default=512, help="shortest retrieval conversation in tokens (512)")
    p.add_argument("--full-share", type=float, default=0.3, help="rows that are one conversation as long as the row")
    p.add_argument("--raw-share", type=float, default=0.25, help="share of a mixed row that is a raw-text piece")
    p.add_argument("--raw-label-ratio", type=float, default=1.0,
                   help="labelled raw-text tokens per labelled reply token in a mixed row (1.0: half the loss)")
    p.add_argument("--chat-share", type=float, default=0.04, help="share of a mixed row that is short chat")
    p.add_argument("--haystack-mix", type=float, nargs=3, default=(0.45, 0.35, 0.2), metavar=("CODE", "DOC", "PROSE"),
                   help="weights of the haystacks: the documents, their docstrings, generated prose")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, min(16, (mp.cpu_count() or 2) - 1)))
    p.add_argument("--overwrite", action="store_true", help="replace --output if it holds a dataset this tool wrote")
    a = p.parse_args(argv)
    from .data import check_output_dataset
    from .errors import UsageError
    from .packed_data import save_rows
    try:
        shares = (a.full_share, a.raw_share, a.chat_share)
        if a.seq_length < 1 or a.rows < 1 or not all(0 <= x <= 1 for x in shares) or a.raw_share + a.chat_share > 0.9:
            raise UsageError("--seq-length and --rows must be >= 1; --full-share, --raw-share, --chat-share in [0, 1] "
                             "with --raw-share + --chat-share <= 0.9")
        if a.raw_label_ratio < 0 or min(a.haystack_mix) < 0 or sum(a.haystack_mix) <= 0:
            raise UsageError("--raw-label-ratio must be >= 0 and --haystack-mix weights >= 0, not all 0")
        check_output_dataset(a.output, a.overwrite, inputs=tuple(a.haystack) + (a.tokenizer,))
        rows = build_rows(a.tokenizer, a.haystack, a.seq_length, a.rows, a.seed, a.workers, min_length=a.min_length,
                          full_share=a.full_share, raw_share=a.raw_share, raw_label_ratio=a.raw_label_ratio,
                          chat_share=a.chat_share, mix=tuple(a.haystack_mix))
        save_rows(rows, a.output)
    except (UsageError, ValueError, OSError) as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    trained = sum(sum(t != IGNORE_INDEX for t in r["labels"]) for r in rows)
    docs = sum(sum(1 for q in r["position_ids"][1:] if q == 0) + 1 for r in rows)
    print(f"wrote {len(rows)} rows of {a.seq_length + 1} tokens ({docs} documents incl. pads; {trained} labelled "
          f"tokens: replies + raw-text tails) to {a.output}")
    return 0


__all__ = ["ChatMarkup", "build_rows", "docstrings", "main"]

if __name__ == "__main__":
    sys.exit(main())
