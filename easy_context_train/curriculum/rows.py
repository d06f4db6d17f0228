"""Conversations tokenized, placed in a haystack and packed into training rows of ``seq_length + 1`` tokens.

A row is, with probability ``full_share``, one retrieval conversation as long as the row; otherwise a mix:
  * a raw-text piece (``raw_share`` of the row): a slice of the training documents, positions from 0;
  * short chat conversations (``chat_share`` of the row, ``chat.py``);
  * 1-4 retrieval conversations filling the rest (lengths from a random split: every length from ``min_length``).
Each piece is its own document (positions restart). Haystacks: slices of the training documents (code), of their
docstrings (prose written by people) and of generated prose (``haystack.filler_text``), never an eval's haystack.

**Loss weighting.** train.py's loss is the token mean over labelled tokens. Labelled: every assistant reply and its
end-of-turn token (retrieval and chat alike; a reply's given lead is context), and the LAST
``round(raw_label_ratio x replies)`` tokens of the raw piece (the farthest positions, capped at the piece). So in a
mixed row raw text carries raw_label_ratio / (1 + raw_label_ratio) of the loss (default 1.0: half), replies the rest
in proportion to their tokens; a full-length row is replies only. Labelling the whole raw piece would give raw text
~99% of the loss (a piece of 16K tokens against a few hundred reply tokens) and stall the replies.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from easy_context.loss import IGNORE_INDEX

from . import chat
from .spec import draw_spec, render

_W: dict = {}  # per worker: tokenizer, markup, streams (fork keeps the parent's copy)
STREAMS = ("code", "docprose", "prose")


@dataclass(frozen=True)
class RowConfig:
    row_len: int
    min_length: int = 512
    full_share: float = 0.3
    raw_share: float = 0.25
    raw_label_ratio: float = 1.0
    chat_share: float = 0.04
    mix: tuple = (0.45, 0.35, 0.2)   # haystack streams: code, docprose, prose
    pad: int = 0


def init(tok, markup, streams) -> None:
    _W.update(tok=tok, markup=markup, streams=streams)


def ids(text: str) -> list[int]:
    return list(_W["tok"](text, add_special_tokens=False)["input_ids"]) if text else []


def stream(texts, limit: int, tok, ending_ids) -> tuple[list[int], list[int]]:
    """Token ids of the texts joined by blank lines (up to ``limit``) and the positions after a line/sentence end."""
    out: list[int] = []
    for t in texts:
        out += list(tok(t + "\n\n", add_special_tokens=False)["input_ids"])
        if len(out) >= limit:
            break
    ends = ending_ids(tok, out, ("\n", ".", "!", "?"), strip=" \t")
    return out, [j + 1 for j, t in enumerate(out) if t in ends]


def _place(rng, ends, start: int, n: int) -> int:
    k = bisect.bisect_left(ends, start + rng.randrange(n + 1))
    return ends[k] - start if k < len(ends) and ends[k] - start <= n else rng.randrange(n + 1)


def _span_pair(rng, text: str):
    """(quoted, answer) lines for a span question, or None: consecutive non-empty lines, the quoted one unique."""
    lines = text.split("\n")[1:-1]  # the slice's first and last lines may be cut
    cands = [i for i in range(len(lines) - 1)
             if 15 <= len(lines[i].strip()) <= 160 and 15 <= len(lines[i + 1].strip()) <= 160]
    rng.shuffle(cands)
    for i in cands[:12]:
        a, b = lines[i].strip(), lines[i + 1].strip()
        if text.count(a) == 1 and a != b:
            return lines[i], lines[i + 1]
    return None


def conversation(rng: random.Random, budget: int, cfg: RowConfig):
    """(input_ids, labels) of one retrieval conversation of exactly ``budget`` tokens, or None."""
    m, s = _W["markup"], draw_spec(rng)
    hay_ids, ends = _W["streams"][rng.choices(range(3), weights=cfg.mix)[0]]
    eot, to_user = m.eot, m.to_user[len(m.eot):]
    follow = [(to_user + ids(u) + m.to_assistant, ids(r) + eot) for u, r in s.follow]
    inserts = [ids("\n" + x + "\n") for x in s.inserts]
    lead = ids(s.lead)

    def fixed(question, reply):
        head, tail = render(s, question)
        return (len(m.head) + len(ids(head)) + len(ids(tail)) + len(m.to_assistant) + len(lead) + len(reply) + 1
                + sum(len(a) + len(b) for a, b in follow) + sum(map(len, inserts)) + len(m.end) - len(eot))

    question, reply = s.question, ids(s.reply)
    if s.span:  # the haystack's own lines: pick them in a slice, then size the question around them
        n0 = budget - fixed(question, []) - 120
        if n0 < 64 or budget > len(hay_ids):
            return None
        start = rng.randrange(len(hay_ids) - budget + 1)
        pair = _span_pair(rng, _W["tok"].decode(hay_ids[start:start + n0]))
        if pair is None:
            return None
        quoted, answer = pair if s.span == "next" else pair[::-1]
        question, reply = question.replace("{line}", quoted.strip()), ids(answer.strip())
    n_hay = budget - fixed(question, reply)
    if n_hay < 16:
        return None
    if n_hay > len(hay_ids):
        raise ValueError(f"the haystack holds {len(hay_ids)} tokens, fewer than one conversation needs ({n_hay})")
    if not s.span:
        start = rng.randrange(len(hay_ids) - n_hay + 1)
    hay = hay_ids[start:start + n_hay]
    if s.span and _W["tok"].decode(hay).count(quoted.strip()) != 1:
        return None
    cuts = [_place(rng, ends, start, n_hay) for _ in inserts]
    if s.ordered:  # a chain is read forward: its statements at sorted depths in their order
        cuts.sort()
    body, prev = [], 0
    for cut, ins in sorted(zip(cuts, inserts), key=lambda x: x[0]):
        body += hay[prev:cut] + ins
        prev = cut
    body += hay[prev:]
    head, tail = render(s, question)
    inp = m.head + ids(head) + body + ids(tail) + m.to_assistant + lead
    lab = [IGNORE_INDEX] * len(inp)
    inp, lab = inp + reply + eot, lab + reply + eot
    for u, r in follow:
        inp, lab = inp + u + r, lab + [IGNORE_INDEX] * len(u) + r
    tail_end = m.end[len(eot):]
    inp, lab = inp + tail_end, lab + [IGNORE_INDEX] * len(tail_end)
    assert len(inp) == budget, (len(inp), budget, s.kind)
    return inp, lab


def chat_conversation(rng: random.Random):
    m = _W["markup"]
    inp = list(m.head)
    lab = [IGNORE_INDEX] * len(inp)
    for i, (u, r) in enumerate(chat.conversation(rng)):
        user = (ids(u) if i == 0 else m.to_user[len(m.eot):] + ids(u)) + m.to_assistant
        rep = ids(r) + m.eot
        inp, lab = inp + user + rep, lab + [IGNORE_INDEX] * len(user) + rep
    end = m.end[len(m.eot):]
    return inp + end, lab + [IGNORE_INDEX] * len(end)


def _retrieval(rng, budget, cfg):
    for _ in range(6):  # a span draw can find no usable line pair: draw again
        conv = conversation(rng, budget, cfg)
        if conv is not None:
            return conv
    return None


def row(cfg: RowConfig, seed: int, index: int) -> dict:
    rng = random.Random(seed * 1_000_003 + index)
    L, docs, raw_len = cfg.row_len, [], 0
    if rng.random() < cfg.full_share:
        budgets = [L]
    else:
        raw_len = int(cfg.raw_share * L) if cfg.raw_share > 0 and cfg.raw_share * L >= 64 else 0
        used, chat_budget = 0, int(cfg.chat_share * L)
        while True:
            c = chat_conversation(rng)
            if used + len(c[0]) > chat_budget:
                break
            docs.append(c)
            used += len(c[0])
        free = L - raw_len - used
        k = max(1, min(rng.choices((1, 2, 3, 4), weights=(35, 30, 20, 15))[0], free // cfg.min_length))
        spare = free - k * cfg.min_length
        if spare < 0:
            budgets = [free] if free >= 64 else []
        else:
            cuts = sorted(rng.randint(0, spare) for _ in range(k - 1))
            budgets = [b - a + cfg.min_length for a, b in zip([0] + cuts, cuts + [spare])]
    for b in budgets:
        conv = _retrieval(rng, b, cfg)
        if conv is not None:
            docs.append(conv)
    if raw_len:
        code, _ = _W["streams"][0]
        st = rng.randrange(len(code) - raw_len + 1)
        piece = code[st:st + raw_len]
        replies = sum(sum(t != IGNORE_INDEX for t in lab) for _, lab in docs)
        n_lab = min(raw_len - 1, round(cfg.raw_label_ratio * replies))
        docs.append((piece, [IGNORE_INDEX] * (raw_len - n_lab) + piece[raw_len - n_lab:]))
    rng.shuffle(docs)
    out_ids, labels, pos = [], [], []
    for d_ids, d_lab in docs:
        out_ids += d_ids
        labels += d_lab
        pos += range(len(d_ids))
    fill = L - len(out_ids)
    assert fill >= 0, (fill, [len(d) for d, _ in docs])
    return {"input_ids": out_ids + [cfg.pad] * fill, "labels": labels + [IGNORE_INDEX] * fill,
            "position_ids": pos + list(range(fill))}


__all__ = ["RowConfig", "STREAMS", "init", "stream", "conversation", "chat_conversation", "row"]
