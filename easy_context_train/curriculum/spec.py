"""One retrieval conversation as text (no tokenizer, no haystack yet): what to insert, what to ask, what to answer.

Kinds (``KIND_WEIGHTS``): a single fact (number / word / key-value), several facts with distractors (one asked,
all of one key asked, several keys asked at once), a multi-hop variable chain (its end value asked, or every name
holding a value), counting (the word tallied most often), and a span of the haystack itself (the line after / before a quoted line; realised in
``rows.py``, which sees the haystack). A conversation may go on with follow-up turns on other inserted facts.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from . import templates as T

KIND_WEIGHTS = {"number": 13, "word": 9, "kv": 9, "multikey": 13, "multivalue": 8, "multiquery": 8, "chain": 12,
                "chain_list": 8, "count": 6, "span": 9}
_A = ("Harlow", "Corvid", "Alder", "Brisk", "Marlin", "Tansy", "Quill", "Ember", "Solace", "Pinecrest", "Vantage",
      "Larkspur", "Onyx", "Halcyon", "Rook", "Fennel", "Garnet", "Juno", "Kestrel", "Moss")
_B = ("account", "archive", "project", "station", "locker", "ticket", "vault", "channel", "ledger", "depot",
      "cabinet", "route", "batch", "module", "license", "order")
_WORDS = ("amber", "basalt", "cedar", "dune", "fjord", "granite", "hazel", "indigo", "jasper", "kelp", "lagoon",
          "mango", "nectar", "opal", "prairie", "quince", "russet", "sienna", "tamarind", "umber", "walnut", "yarrow",
          "zinnia", "birch", "cobble", "drizzle", "fable", "glimmer", "harvest", "ivory")
_SNAKE = ("max_retries", "pool_size", "log_level", "api_region", "cache_ttl", "batch_limit", "mirror_host",
          "queue_name", "shard_count", "backup_slot", "color_theme", "locale_tag")


@dataclass
class Spec:
    kind: str
    frame: tuple[str, str]                   # (head, tail), "{question}" not yet filled
    question: str                            # first turn's question ("{line}" left for span kinds)
    reply: str                               # first turn's reply ("" for span kinds: filled from the haystack)
    inserts: list[str] = field(default_factory=list)
    ordered: bool = False                    # chain statements keep their order in the haystack
    follow: list[tuple[str, str]] = field(default_factory=list)  # (user, reply) turns after the first
    lead: str = ""                           # given start of the first reply (context, not trained)
    ids: list[str] = field(default_factory=list)
    span: str = ""                           # "next" / "prev" for span kinds


def _pick(rng, name: str, options, ids: list[str]) -> str:
    i = rng.randrange(len(options))
    ids.append(f"train/{name}/{i}")
    return options[i]


def _key(rng, kind: str) -> str:
    if kind == "kv":
        return f"{rng.choice(_SNAKE)}_{rng.randint(1, 99)}"
    return f"{rng.choice(_A)} {rng.choice(_B)} {rng.randint(2, 999)}"


def _value(rng, kind: str) -> str:
    if kind == "number":
        d = rng.randint(3, 9)
        return str(rng.randint(10 ** (d - 1), 10 ** d - 1))
    if kind == "word":
        return rng.choice(_WORDS)
    return "".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randint(4, 8)))


def _fact(rng, kind, key, value, ids):
    return _pick(rng, f"needle/{kind}", T.NEEDLES[kind], ids).format(key=key, value=value)


def draw_spec(rng: random.Random) -> Spec:
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    ids: list[str] = []
    frame = _pick(rng, "frames", T.FRAMES, ids)
    lead = _pick(rng, "leads", T.LEADS, ids) if rng.random() < 0.25 else ""
    base = kind if kind in ("number", "word", "kv") else "number"
    s = Spec(kind, frame, "", "", lead=lead, ids=ids)
    if kind in ("number", "word", "kv", "multikey"):
        n = 1 if kind != "multikey" else rng.randint(2, 5)
        sub = [rng.choice(("number", "word", "kv")) if kind == "multikey" else kind for _ in range(n)]
        keys = list(dict.fromkeys(_key(rng, k) for k in sub))
        facts = [(k, sk, _value(rng, sk)) for k, sk in zip(keys, sub)]
        s.inserts = [_fact(rng, sk, k, v, ids) for k, sk, v in facts]
        k, sk, v = facts[0]  # asked first; the others are distractors or follow-ups
        s.question = _pick(rng, f"question/{sk}", T.QUESTIONS[sk], ids).format(key=k)
        s.reply = _pick(rng, f"answer/{sk}", T.ANSWERS[sk], ids).format(key=k, value=v)
        for k2, sk2, v2 in facts[1:]:
            if rng.random() < 0.5:
                s.follow.append((_pick(rng, "follow_ups", T.FOLLOW_UPS, ids).format(key=k2),
                                 _pick(rng, f"answer/{sk2}", T.ANSWERS[sk2], ids).format(key=k2, value=v2)))
    elif kind == "multivalue":
        key, others = _key(rng, base), [_key(rng, base) for _ in range(rng.randint(0, 2))]
        vals = [_value(rng, base) for _ in range(rng.randint(2, 4))]
        s.inserts = [_fact(rng, base, key, v, ids) for v in vals]
        s.inserts += [_fact(rng, base, k, _value(rng, base), ids) for k in others if k != key]
        s.question = _pick(rng, "list_questions", T.LIST_QUESTIONS, ids).format(key=key)
        s.reply = _pick(rng, "list_answers", T.LIST_ANSWERS, ids).format(key=key, values=", ".join(vals))
    elif kind == "multiquery":
        keys = list(dict.fromkeys(_key(rng, base) for _ in range(rng.randint(2, 4))))
        vals = [_value(rng, base) for _ in keys]
        s.inserts = [_fact(rng, base, k, v, ids) for k, v in zip(keys, vals)]
        s.inserts += [_fact(rng, base, _key(rng, base), _value(rng, base), ids) for _ in range(rng.randint(0, 2))]
        s.question = _pick(rng, "multi_questions", T.MULTI_QUESTIONS, ids).format(keys=" and ".join(keys))
        _pick(rng, "multi_answers", T.MULTI_ANSWERS, ids)
        s.reply = "; ".join(f"{k}: {v}" for k, v in zip(keys, vals))
    elif kind in ("chain", "chain_list"):
        s.inserts, s.ordered = _chains(rng, s, ids)
    elif kind == "count":  # the asked word 4-7 times, 2-4 others 1-3 times each
        words = rng.sample(_WORDS, rng.randint(3, 5))
        line = _pick(rng, "count_lines", T.COUNT_LINES, ids)
        s.inserts = [line.format(value=w) for i, w in enumerate(words) for _ in range(rng.randint(4, 7) if i == 0
                                                                                       else rng.randint(1, 3))]
        s.question = _pick(rng, "count_questions", T.COUNT_QUESTIONS, ids)
        s.reply = _pick(rng, "count_answers", T.COUNT_ANSWERS, ids).format(value=words[0])
    else:
        s.span = rng.choice(("next", "next", "prev"))
        s.question = _pick(rng, "span_next" if s.span == "next" else "span_prev",
                           T.SPAN_NEXT if s.span == "next" else T.SPAN_PREV, ids)
    return s


def _var(rng, taken: set) -> str:
    while True:
        v = rng.choice((lambda: "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6))),
                        lambda: f"{rng.choice(string.ascii_lowercase)}{rng.randint(1, 99)}",
                        lambda: "".join(rng.choices(string.ascii_uppercase, k=4))))()
        if v not in taken:
            taken.add(v)
            return v


def _chains(rng, s: Spec, ids: list[str]) -> tuple[list[str], bool]:
    """1-3 chains of 1-5 hops; the first is asked. Statements of one chain stay in order (a chain is read forward)."""
    taken: set = set()
    chains = []
    for _ in range(rng.randint(1, 3)):
        names = [_var(rng, taken) for _ in range(rng.randint(2, 6))]
        chains.append((names, str(rng.randint(10, 99999))))
    lines = []
    for names, value in chains:
        st = [_pick(rng, "chain_first", T.CHAIN_FIRST, ids).format(var=names[0], value=value)]
        st += [_pick(rng, "chain_hop", T.CHAIN_HOP, ids).format(var=b, src=a) for a, b in zip(names, names[1:])]
        lines.append(st)
    names, value = chains[0]
    if s.kind == "chain":
        s.question = _pick(rng, "chain_questions", T.CHAIN_QUESTIONS, ids).format(var=names[-1])
        s.reply = _pick(rng, "chain_answers", T.CHAIN_ANSWERS, ids).format(var=names[-1], value=value)
    else:
        s.question = _pick(rng, "chain_list_questions", T.CHAIN_LIST_QUESTIONS, ids).format(value=value)
        s.reply = _pick(rng, "chain_list_answers", T.CHAIN_LIST_ANSWERS, ids).format(value=value, vars=", ".join(names))
    # interleave chains, each in its own order: the realisation places inserts in list order at sorted depths
    merged, queues = [], [list(x) for x in lines]
    while any(queues):
        q = rng.choice([q for q in queues if q])
        merged.append(q.pop(0))
    return merged, True


def render(s: Spec, question: str) -> tuple[str, str]:
    """The frame's head and tail with the first turn's question filled in."""
    head, tail = s.frame
    return head.replace("{question}", question), tail.replace("{question}", question)


__all__ = ["Spec", "KIND_WEIGHTS", "draw_spec", "render"]
