"""RULER-style synthetic tasks, generated offline for any tokenizer and any context length.

RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?")
measures retrieval, multi-hop tracing and aggregation with synthetic prompts of a chosen token length. This
module writes its own generators for seven of RULER's 13 tasks (the two QA tasks need SQuAD/HotpotQA,
and the uuid / needle-haystack NIAH variants are left out). Every prompt is built as token ids: the
filler is tokenized once (``easy_context.haystack``) and the task's pieces are tokenized separately and
spliced in, so a prompt has exactly the requested length where RULER's binary search over the amount of
text lands somewhat below it.

Shared with RULER
  * prompt = task template (RULER's wording, paraphrased minimally) + the question, then the task's
    *answer prefix* appended after the (optional) chat template, so the model continues the answer;
  * per-task generation budget (``--max_new_tokens`` overrides): NIAH 128, vt 30, cwe 120, fwe 50;
  * answers are scored by string-match recall (``scoring.py``).

Tasks (RULER's defaults from its synthetic.yaml unless noted)
  niah_single      one needle "One of the special magic numbers for {key} is: {value}." in the filler;
                   key = adjective-noun word, value = 7-digit number (RULER niah_single_2, words->numbers).
  niah_multikey    4 needles with different keys, one is asked (niah_multikey_1: 3 distractor needles).
  niah_multivalue  4 needles with the same key and different values; all 4 values are expected.
  niah_multiquery  4 needles with different keys; all 4 keys are asked, all 4 values expected.
                   NIAH needles go at depths drawn without replacement from RULER's 40-point grid
                   linspace(0, 100%, 40), each snapped to the next sentence end of the filler; the question is
                   "What are all the special magic numbers for {key(s)} mentioned in the provided text?".
  vt               variable tracking: 1 chain of 4 hops, "VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE."
                   ... (5-letter upper-case names, 5-digit value) at sorted random sentence ends; all 5
                   names are expected.
  cwe              common-word extraction: a numbered list "1. w 2. w ..." where 10 common words appear 30
                   times and the others 3 times; the 10 common words are expected.
  fwe              frequent-word extraction: 2000 coded 6-letter words, word of rank k appears
                   int(N k^-2 / zeta(2)) times (Zipf alpha = 2), the top one is "..." (noise, as in RULER);
                   the words of ranks 2-4 are expected.

Where it differs from RULER
  * Filler: easy_context.haystack's text (generated prose, or --haystack_dir) for every NIAH task and vt;
    RULER uses Paul Graham essays for NIAH and "The grass is green. ..." noise for niah_single_1 and vt.
  * Words: NIAH keys come from a bundled adjective/noun list and cwe words are generated 6-letter
    consonant-vowel words (RULER samples English words from the wonderwords package); equal-length words
    also keep one expected word from being a substring of another.
  * No in-context example for vt / cwe / fwe (RULER prepends one); short lengths could not hold it.
  * Short contexts: when cwe's 30/3 repeats do not fit, 10/2, then 4/1, then 2/1 are used (the common
    words stay strictly more frequent); a length too short for a task is a clear error, not a silent skip.
  * vt's answer prefix spells "assigned" (RULER's template has "assgined") and carries no trailing space.
"""
from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass, field

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
GEN_TOKENS = {"niah_single": 128, "niah_multikey": 128, "niah_multivalue": 128, "niah_multiquery": 128,
              "vt": 30, "cwe": 120, "fwe": 50}  # RULER's tokens_to_generate

# --- NIAH (RULER's niah template, numbers as values) ---
NIAH_HEAD = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the numbers afterwards.\n")
NIAH_NEEDLE = " One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = " The special magic numbers for {query} mentioned in the provided text are"
DEPTHS = tuple(round(100 * i / 39) / 100 for i in range(40))  # RULER: np.linspace(0, 100, 40), rounded

_ADJ = ("quiet", "brave", "shiny", "frozen", "gentle", "hollow", "ancient", "bitter", "clever", "dusty",
        "eager", "fancy", "golden", "humble", "icy", "jolly", "lively", "misty", "noble", "orange", "proud",
        "rapid", "silent", "tidy", "upbeat", "vivid", "wooden", "young", "zesty", "calm")
_NOUN = ("harbor", "lantern", "meadow", "pebble", "falcon", "violin", "canyon", "teapot", "glacier", "orchard",
         "compass", "blanket", "thunder", "ribbon", "castle", "walnut", "feather", "engine", "island", "ladder",
         "marble", "needle", "oyster", "parrot", "quilt", "rocket", "saddle", "tunnel", "wagon", "zebra")
KEYS = tuple(f"{a}-{n}" for a in _ADJ for n in _NOUN)

# --- variable tracking ---
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables "
                    "are assigned the value {value}, they are:")

# --- common / frequent words ---
CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
CWE_QUESTION = "\nQuestion: What are the {n} most common words in the above list?"
CWE_ANSWER_PREFIX = " Answer: The top {n} words that appear most often in the list are:"
CWE_REPEATS = ((30, 3), (10, 2), (4, 1), (2, 1))  # (common, uncommon); RULER's is the first
FWE_HEAD = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. ")
FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                "most frequently appeared words in the above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

_CONS, _VOW = "bdfgklmnprstvz", "aeiou"
_SYLL = [c + v for c in _CONS for v in _VOW]  # 70 syllables -> 343,000 six-letter words


@dataclass
class RulerSample:
    task: str
    length: int               # requested prompt length (tokens)
    input_ids: list[int]      # the whole prompt (BOS or chat template, task text, answer prefix)
    answers: list[str]        # expected strings (score = fraction found in the generation)
    max_new_tokens: int
    info: dict = field(default_factory=dict)


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    """One RNG per (task, length, sample): prompts do not depend on which others are generated."""
    return random.Random(f"ruler/{seed}/{task}/{length}/{index}")


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _zeta(alpha: float, terms: int = 100000) -> float:
    return sum(k ** -alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1)


class RulerBuilder:
    """Builds RULER prompts of exact token lengths over one tokenized filler.

    ``wrap``: an ``easy_context.evals.ChatWrap`` (chat template) or None (BOS, if the tokenizer adds one).
    """

    def __init__(self, tokenizer, haystack_text: str, max_length: int, wrap=None):
        from easy_context.haystack import NeedleHaystack
        self.tok = tokenizer
        self.hay = NeedleHaystack(tokenizer, haystack_text, max(1, max_length))  # ids + sentence ends, reused
        self.wrap = wrap
        probe = list(tokenizer("a")["input_ids"])
        bos = tokenizer.bos_token_id
        self.bos = [bos] if bos is not None and probe[:1] == [bos] else []

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def overhead(self) -> int:
        return self.wrap.overhead if self.wrap is not None else len(self.bos)

    def frame(self, content: list[int], answer_prefix: list[int]) -> list[int]:
        if self.wrap is not None:
            return self.wrap(content, answer_prefix)
        return self.bos + content + answer_prefix

    # ------------------------------------------------------------------------------------------
    def build(self, task: str, length: int, index: int = 0, seed: int = 0,
              max_new_tokens: int | None = None) -> RulerSample:
        if task not in TASKS:
            raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
        rng = sample_rng(seed, task, length, index)
        if task.startswith("niah"):
            n_keys, n_values, n_queries = {"niah_single": (1, 1, 1), "niah_multikey": (4, 1, 1),
                                           "niah_multivalue": (1, 4, 1), "niah_multiquery": (4, 1, 4)}[task]
            content, prefix, answers, info = self._niah(task, rng, length, n_keys, n_values, n_queries)
        else:
            content, prefix, answers, info = getattr(self, "_" + task)(rng, length)
        ids = self.frame(content, prefix)
        assert len(ids) <= length, (task, len(ids), length)
        return RulerSample(task, length, ids, answers, max_new_tokens or GEN_TOKENS[task], info)

    def _too_short(self, task: str, length: int, need: int):
        return ValueError(f"{task}: a {length}-token prompt cannot hold the task (it needs at least {need} tokens "
                          "with this tokenizer); raise --min_context_length or drop the task with --tasks")

    def _splice(self, n_hay: int, inserts: list[tuple[int, list[int]]]) -> list[int]:
        """The first ``n_hay`` filler tokens with each insert after the sentence end at/after its position
        (before it when the cut has none after)."""
        import bisect
        hay, ends = self.hay.ids[:n_hay], self.hay.sentence_ends

        def snap(p):  # the next sentence end inside the cut, else the previous one: never mid-sentence
            if p <= 0:
                return 0
            k = bisect.bisect_left(ends, p)
            if k < len(ends) and ends[k] <= n_hay:
                return ends[k]
            k = bisect.bisect_right(ends, n_hay) - 1
            return ends[k] if k >= 0 else 0
        snapped = sorted(((snap(p), i, ids) for i, (p, ids) in enumerate(inserts)), key=lambda x: (x[0], x[1]))
        body, prev = [], 0
        for p, _, ids in snapped:
            body += hay[prev:p] + ids
            prev = p
        return body + hay[prev:]

    def _niah(self, task, rng, length, n_keys, n_values, n_queries):
        keys = rng.sample(KEYS, n_keys)
        values = [[str(rng.randint(10 ** 6, 10 ** 7 - 1)) for _ in range(n_values)] for _ in keys]
        needles = [NIAH_NEEDLE.format(key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        queried = keys[:n_queries]
        query = _join_keys(queried)
        head, question = self.ids(NIAH_HEAD), self.ids(NIAH_QUESTION.format(query=query))
        prefix = self.ids(NIAH_ANSWER_PREFIX.format(query=query))
        needle_ids = [self.ids(n) for n in needles]
        fixed = self.overhead() + len(head) + len(question) + len(prefix) + sum(map(len, needle_ids))
        n_hay = length - fixed
        if n_hay < 0:
            raise self._too_short(task, length, fixed)
        depths = sorted(rng.sample(DEPTHS, len(needles)))
        body = self._splice(n_hay, [(int(n_hay * d), ids) for d, ids in zip(depths, needle_ids)])
        answers = [v for k, vs in zip(keys, values) if k in queried for v in vs]
        return head + body + question, prefix, answers, {"keys": keys, "depths": depths}

    def _vt(self, rng, length, num_chains: int = 1, num_hops: int = 4):
        names: list[str] = []
        while len(names) < num_chains * (num_hops + 1):
            v = "".join(rng.choices(string.ascii_uppercase, k=5))
            if v not in names:
                names.append(v)
        chains, values = [], []
        for c in range(num_chains):
            vs = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
            value = str(rng.randint(10000, 99999))
            values.append(value)
            chains.append([f" VAR {vs[0]} = {value}."] + [f" VAR {vs[j + 1]} = VAR {vs[j]}." for j in range(num_hops)])
        value, answers = values[0], names[:num_hops + 1]  # the first chain is asked
        head, question = self.ids(VT_HEAD), self.ids(VT_QUESTION.format(value=value))
        prefix = self.ids(VT_ANSWER_PREFIX.format(n=num_hops + 1, value=value))
        stmt_ids = [[self.ids(s) for s in chain] for chain in chains]
        fixed = self.overhead() + len(head) + len(question) + len(prefix) + sum(len(s) for ch in stmt_ids for s in ch)
        n_hay = length - fixed
        if n_hay < 0:
            raise self._too_short("vt", length, fixed)
        inserts = []
        for ch in stmt_ids:  # a chain's statements in order at sorted random positions
            for p, s in zip(sorted(rng.randrange(n_hay + 1) for _ in ch), ch):
                inserts.append((p, s))
        inserts.sort(key=lambda x: x[0])  # stable: equal positions keep chain order
        return head + self._splice(n_hay, inserts) + question, prefix, answers, {"value": value}

    def _fit(self, task, length, make, lo: int, hi: int):
        """The largest n in [lo, hi] whose prompt ``make(n)`` fits ``length`` (binary search; token counts
        grow with n), as (n, content, prefix)."""
        def size(n):
            content, prefix = make(n)
            return self.overhead() + len(content) + len(prefix), content, prefix
        s, content, prefix = size(lo)
        if s > length:
            return None, s, None
        best = (lo, content, prefix)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            s, content, prefix = size(mid)
            if s <= length:
                lo, best = mid, (mid, content, prefix)
            else:
                hi = mid - 1
        return best

    def _cwe(self, rng, length, num_cw: int = 10):
        pool_rng = random.Random(rng.random())
        need = None
        for freq_cw, freq_ucw in CWE_REPEATS:
            upper = min(len(_SYLL) ** 3 - num_cw, max(num_cw, length // freq_ucw))
            words = []
            seen = set()
            while len(words) < num_cw + upper:  # distinct, drawn lazily: long contexts need many
                w = "".join(pool_rng.choice(_SYLL) for _ in range(3))
                if w not in seen:
                    seen.add(w)
                    words.append(w)
            common = words[:num_cw]
            head = self.ids(CWE_HEAD)
            question, prefix = self.ids(CWE_QUESTION.format(n=num_cw)), self.ids(CWE_ANSWER_PREFIX.format(n=num_cw))

            def make(n_unc, common=common, words=words, freq_cw=freq_cw, freq_ucw=freq_ucw):
                lst = common * freq_cw + words[num_cw:num_cw + n_unc] * freq_ucw
                random.Random(f"{pool_rng_seed}/{n_unc}").shuffle(lst)
                ctx = " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))
                return head + self.ids(ctx) + question, prefix

            pool_rng_seed = rng.random()
            n, content, prefix_ids = self._fit("cwe", length, make, num_cw, upper)
            if n is not None:
                return content, prefix_ids, common, {"repeats": (freq_cw, freq_ucw), "uncommon": n}
            need = content  # the size of the smallest attempt
        raise self._too_short("cwe", length, need)

    def _fwe(self, rng, length, vocab_size: int = 2000, word_len: int = 6, alpha: float = 2.0):
        vocab = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_len)))
        vocab = sorted(vocab)
        rng.shuffle(vocab)
        vocab[0] = "..."  # RULER: the most frequent "word" is noise
        z = _zeta(alpha)
        head, question, prefix = self.ids(FWE_HEAD), self.ids(FWE_QUESTION), self.ids(FWE_ANSWER_PREFIX)
        order_seed = rng.random()

        def counts(n):
            return [int(n * k ** -alpha / z) for k in range(1, vocab_size + 1)]

        def make(n):
            lst = [w for w, c in zip(vocab, counts(n)) for _ in range(c)]
            random.Random(f"{order_seed}/{n}").shuffle(lst)
            return head + self.ids(" ".join(lst)) + question, prefix

        lo = 8
        while counts(lo)[3] <= counts(lo)[4] or counts(lo)[3] < 1:  # ranks 2-4 must be strictly ahead of 5
            lo += 1
        n, content, prefix_ids = self._fit("fwe", length, make, lo, max(lo, 4 * length))
        if n is None:
            raise self._too_short("fwe", length, content)
        while counts(n)[3] <= counts(n)[4]:  # the largest fitting n can tie ranks 4/5: step back
            n -= 1
            content, prefix_ids = make(n)
        return content, prefix_ids, vocab[1:4], {"words": n}


__all__ = ["TASKS", "GEN_TOKENS", "KEYS", "DEPTHS", "RulerBuilder", "RulerSample", "sample_rng"]
