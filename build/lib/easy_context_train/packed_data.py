"""Packed documents and chat data: rows of ``input_ids`` + ``labels`` + ``position_ids`` (positions restart at 0
at every document, the Hugging Face packing convention that the sequence-parallel attention reads).

Row format (what train.py reads; ``prepare_data.py --format chat`` or ``--document-masking`` writes it): every
row holds exactly ``seq_length + 1`` tokens, like the plain packed rows. ``labels[i]`` is ``input_ids[i]`` where
the token is trained and -100 elsewhere (chat: everything but assistant turns; filler); train.py predicts
``labels[1:]`` from ``input_ids[:-1]`` and never across a document start (the target at position 0 of a document
is -100: the previous document cannot see it).

Chat: ``messages`` = [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...] rendered with the
tokenizer's chat template. Assistant spans are found by rendering the conversation prefix by prefix: the tokens
an assistant message adds are trained (the template's own markup around them too, e.g. the end-of-turn token,
which the model must learn to emit). Whole conversations are packed greedily; one that alone exceeds a row is cut
into row-sized pieces, each its own document (counted and reported). A row's unused tail is a filler document of
pad tokens with labels -100.
"""
from __future__ import annotations

from easy_context.loss import IGNORE_INDEX
from .errors import UsageError

ROLES = ("system", "user", "assistant", "tool")


def check_chat_tokenizer(tok, name: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"tokenizer {name!r} has no chat template (tokenizer.chat_template is empty): --format chat "
                         "needs one; use an instruct model's tokenizer or set tokenizer.chat_template")


def render_chat(tok, messages, row: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation; labels -100 outside assistant turns."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"row {row}: 'messages' must be a non-empty list of {{role, content}}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UsageError(f"row {row}, message {j}: needs a role in {ROLES} and a string content; got "
                             f"{str(m)[:80]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise UsageError(f"row {row}: no assistant turn (nothing to train on)")

    def ids_of(msgs):
        out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    ids, labels, prev = [], [], []
    for j in range(len(messages)):
        cur = ids_of(messages[: j + 1])
        if cur[: len(prev)] != prev:
            raise UsageError(f"row {row}: the chat template does not render conversations prefix by prefix "
                             f"(message {j} changes earlier tokens); cannot locate the assistant turns")
        new = cur[len(prev):]
        ids += new
        labels += new if messages[j]["role"] == "assistant" else [IGNORE_INDEX] * len(new)
        prev = cur
    return ids, labels


def pack_examples(examples, seq_length: int, pad_id: int, stats: dict):
    """Greedy packing of (ids, labels) documents into rows of seq_length + 1 with restarting positions."""
    row_len = seq_length + 1
    ids, labels, pos = [], [], []

    def flush():
        if ids:
            fill = row_len - len(ids)
            yield {"input_ids": ids + [pad_id] * fill, "labels": labels + [IGNORE_INDEX] * fill,
                   "position_ids": pos + list(range(fill))}
            ids.clear(), labels.clear(), pos.clear()
    for doc_ids, doc_labels in examples:
        pieces = [(doc_ids, doc_labels)]
        if len(doc_ids) > row_len:  # alone longer than a row: row-sized pieces, each its own document
            stats["split"] = stats.get("split", 0) + 1
            pieces = [(doc_ids[s:s + row_len], doc_labels[s:s + row_len]) for s in range(0, len(doc_ids), row_len)]
        for p_ids, p_labels in pieces:
            if len(ids) + len(p_ids) > row_len:
                yield from flush()
            ids += p_ids
            labels += p_labels
            pos += range(len(p_ids))
            stats["docs"] = stats.get("docs", 0) + 1
    yield from flush()


def pack_text(docs, seq_length: int, bos, eos):
    """--format text --document-masking: BOS + doc + EOS, concatenated and cut into rows like the plain format,
    positions restarting at each document (a document cut by a row end restarts at 0 in the next row)."""
    row_len = seq_length + 1
    ids, pos = [], []
    for doc in docs:
        toks = ([bos] if bos is not None else []) + list(doc) + ([eos] if eos is not None else [])
        ids += toks
        pos += range(len(toks))
        while len(ids) >= row_len:
            row_pos = pos[:row_len]
            first_zero = row_pos.index(0) if 0 in row_pos else row_len
            if first_zero:  # the row starts inside a document: it is a new document from this row's view
                row_pos[:first_zero] = range(first_zero)
            yield {"input_ids": ids[:row_len], "labels": ids[:row_len], "position_ids": row_pos}
            del ids[:row_len], pos[:row_len]


def save_rows(rows: list[dict], output: str) -> None:
    """Rows of int lists (input_ids / labels / position_ids) as a dataset at ``output`` (temp dir + rename)."""
    import datasets

    from .data import save_dataset_atomic
    feats = datasets.Features({k: datasets.Sequence(datasets.Value("int32")) for k in rows[0]})
    save_dataset_atomic(datasets.Dataset.from_list(rows, features=feats), output)


def batch_targets(batch: dict):
    """(input_ids, position_ids, targets) of a collated batch of rows of seq_length + 1."""
    import torch
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    inp, tgt = ids[:, :-1], labels[:, 1:].clone()
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(inp.shape[1]).unsqueeze(0).expand(inp.shape[0], -1)
    else:
        tgt[pos[:, 1:] == 0] = IGNORE_INDEX  # never predict a document's first token from the previous one
        pos = pos[:, :-1]
    return inp, pos, tgt
