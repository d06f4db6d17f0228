"""A tiny, fully local training setup: Llama from a config, byte-level BPE tokenizer, packed corpus.

Used by the CPU demo (``python -m easy_context_train.toy OUT``) and the tests. No downloads: the
tokenizer is trained with the ``tokenizers`` library on a generated corpus of templated sentences
(learnable, so the loss drops within a few steps).
"""
from __future__ import annotations

import argparse
import os
import random

_SUBJ = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher", "our team"]
_VERB = ["sees", "likes", "builds", "paints", "finds", "carries", "reads", "watches"]
_OBJ = ["the red ball", "a long river", "the tall tree", "a quiet house", "the blue sky", "a new book",
        "the green field", "a warm cup of tea"]
_END = ["today.", "every morning.", "in the park.", "at night.", "with great care.", "again and again."]


def make_corpus(n_docs: int = 200, seed: int = 0) -> list[str]:
    """Documents of templated sentences; each also states a number the model can copy later."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sents = [f"{rng.choice(_SUBJ).capitalize()} {rng.choice(_VERB)} {rng.choice(_OBJ)} {rng.choice(_END)}"
                 for _ in range(rng.randint(4, 12))]
        docs.append(" ".join(sents) + f" The magic number is {rng.randint(0, 9999)}.")
    return docs


NEEDLE_CITIES = ("Singapore", "Oslo", "Lima", "Cairo", "Madrid", "Dublin", "Seoul", "Quito", "Vienna", "Nairobi")


def _haystack_sentences() -> list[str]:
    """The sentences of eval_needle's default haystack, from its start (what eval_needle cuts from)."""
    from easy_context.haystack import filler_text

    return [s.strip().rstrip(".") + "." for s in filler_text().replace("\n\n", " ").split(". ")]


def make_needle_corpus(n_docs: int = 400, seed: int = 0, max_sentences: int = 16, digits=(4, 10),
                       cities=NEEDLE_CITIES) -> list[str]:
    """Passkey documents in eval_needle.py's exact format: PREFIX, the first 0..``max_sentences`` sentences of
    the eval's default haystack with one NEEDLE at a random sentence end, QUESTION_STR, then the number.

    ``cities``: by default the city varies per document (Singapore, which the eval asks for, among them):
    packed rows hold several documents without masking, so the question's city, not recency, picks the needle.
    ``digits``: an int, or a (min, max) range drawn per document (longer numbers = more copy steps to learn).
    """
    from easy_context.haystack import NEEDLE, PREFIX, QUESTION_STR, random_number

    rng = random.Random(seed)
    # the eval's own default haystack, from its start (what eval_needle cuts from): the model can learn the
    # prose by heart, so the remaining loss - and the gradient - is the needle number
    sents = _haystack_sentences()[:max_sentences]
    docs = []
    for _ in range(n_docs):
        n = rng.randint(0, max_sentences)
        body = sents[:n]
        k = rng.randint(0, n)
        city = rng.choice(cities)
        number = random_number(rng, digits if isinstance(digits, int) else rng.randint(*digits))
        needle = NEEDLE.replace("Singapore", city).format(number)
        text = " ".join(body[:k]) + needle + " ".join(body[k:])
        docs.append(PREFIX + text + QUESTION_STR.replace("Singapore", city) + f" {number}.")
    return docs


# A minimal ChatML-like template: every message is "<s>role\ncontent</s>", so prefixes render as prefixes and an
# assistant turn's tokens (with its closing </s>) are exactly what it adds.
CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}")


def make_chat_corpus(n: int = 60, seed: int = 0) -> list[list[dict]]:
    """Conversations whose assistant answers are read off the user's text (learnable)."""
    rng = random.Random(seed)
    docs = make_corpus(n, seed)
    out = []
    for d in docs:
        number = d.rsplit(" ", 1)[1].rstrip(".")
        conv = [{"role": "user", "content": d + " What is the magic number?"},
                {"role": "assistant", "content": f"The magic number is {number}."}]
        if rng.random() < 0.5:
            conv = [{"role": "system", "content": "Answer briefly."}] + conv + [
                {"role": "user", "content": "Say it again."}, {"role": "assistant", "content": number}]
        out.append(conv)
    return out


def build_tokenizer(texts: list[str], out_dir: str, vocab_size: int = 384, split_digits: bool = False):
    """Byte-level BPE (GPT-2 style) trained on ``texts``; saved as a transformers fast tokenizer.

    ``split_digits``: every digit is its own pre-token, a leading space staying on the first (" 4" "8" "2" "1"),
    so a number's first token is told apart from the haystack's spaces by content (bench/needle_recipe_probe.py).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = byte_level if not split_digits else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r" ?\d"), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: str, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, rope_theta: float = 10000.0, max_pos: int = 4096, seed: int = 0):
    """A tiny LlamaForCausalLM (float32, random init) saved in HF format."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab_size,
                      max_position_embeddings=max_pos, rope_theta=rope_theta, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out_dir)
    return model


DRILL_STYLES = {
    # Mohtashami & Jaggi's passkey sentence (landmark attention's test, which EasyContext's needle descends from)
    "passkey": "The pass key is {n}. Remember it. {n} is the pass key.",
    # the number asked for again with the phrase that introduced it, as eval_needle's question does with its needle
    # ("The special magic Singapore number is: N." ... "Answer: The special magic Singapore number is:" -> N)
    "recall": "The pass key is: {n}. Remember it. The pass key is: {n}.",
}


def make_drill_corpus(n_docs: int = 400, seed: int = 0, digits=(6, 16), style: str = "passkey") -> list[str]:
    """Passkey drills: one number N (``digits``: a (min, max) range drawn per drill) stated and then copied, in the
    sentence ``DRILL_STYLES[style]``. Dense copy targets: on the toy model they grow the attention heads that read
    a needle's digits (needle documents alone never did; bench/needle_recipe_probe.py).

    "recall" asks for the copy the way eval_needle asks for its needle (after "is:"), so the head that finds a
    drill's first digit is the one the needle's first digit needs: with it the demo learns both digits of 2-digit
    needles by step ~500 of 2000 for every seed tried; with "passkey" (copy after "Remember it.") each seed
    learned about one of the two digits, which one by chance (issue #45, bench/demo_recipe_probe.py).
    """
    from easy_context.haystack import random_number

    if style not in DRILL_STYLES:
        raise ValueError(f"drill style must be one of {sorted(DRILL_STYLES)}, got {style!r}")
    rng = random.Random(seed)
    return [DRILL_STYLES[style].format(n=random_number(rng, rng.randint(*digits))) for _ in range(n_docs)]


def _fitting_sentences(tok, max_tokens: int, digits) -> int:
    """The most eval-haystack sentences a needle document may hold and still fit ``max_tokens`` tokens."""
    from easy_context.haystack import NEEDLE, PREFIX, QUESTION_STR

    sents = _haystack_sentences()
    widest = "9" * (digits if isinstance(digits, int) else max(digits))
    fixed = len(tok(PREFIX + NEEDLE.format(widest) + QUESTION_STR + f" {widest}.", add_special_tokens=False)
                ["input_ids"]) + 2 + 4  # BOS/EOS of packing, a few tokens for the longest city name
    n, used = 0, fixed
    while n < len(sents):
        used += len(tok(" " + sents[n], add_special_tokens=False)["input_ids"])
        if used > max_tokens:
            break
        n += 1
    return n


def build_all(out: str, seq_lengths=(128,), n_docs: int = 200, seed: int = 0, needle_docs: int = 0,
              needle_max_sentences: int | None = 16, needle_digits=(4, 10), drill_docs: int = 0, drill_digits=(6, 16),
              drill_style: str = "passkey", split_digits: bool = False, vocab_size: int = 384,
              document_masking: bool = False, **model_kw) -> dict:
    """Write ``out``/{model, tokenizer inside model, corpus.jsonl, data_<L>} and return their paths.

    ``needle_docs``: passkey documents (``make_needle_corpus``) shuffled into each data_<L>, so the model
    learns eval_needle's prompt format; ``needle_max_sentences=None`` fills each length's documents with up to
    as many haystack sentences as fit one row of L tokens (a fresh draw per length: longer stages see longer
    haystacks, as eval_needle will ask). ``drill_docs``: passkey drills (``make_drill_corpus``, sentence
    ``drill_style``), which teach the copying itself. ``split_digits``: the tokenizer isolates digits
    (``build_tokenizer``); with all three, the demo's model reads 2-digit needles out of its haystack (README,
    "Quick start"). The tokenizer also sees the eval's filler text. ``document_masking``: rows also carry
    ``position_ids`` restarting at every document (``prepare_data.py --document-masking``), so attention stays
    inside documents. ``corpus.jsonl`` holds the documents of the first length. ``model_kw``: ``build_model`` sizes.
    """
    import json

    from .data import pack_documents

    os.makedirs(out, exist_ok=True)
    rng = random.Random(seed)
    drills = make_drill_corpus(drill_docs, seed, drill_digits, drill_style) if drill_docs else []
    base = make_corpus(n_docs, seed) + drills
    tok_texts = base
    if needle_docs:
        from easy_context.haystack import filler_text
        tok_texts = base + make_needle_corpus(min(needle_docs, 2000), seed, needle_max_sentences or 16,
                                              needle_digits) + [filler_text(300)]
    model_dir = os.path.join(out, "tiny-llama")
    tok = build_tokenizer(tok_texts, model_dir, vocab_size, split_digits=split_digits)
    build_model(model_dir, vocab_size=len(tok), seed=seed, **model_kw)
    paths = {"model": model_dir}
    if needle_docs:  # the 8 longest of 200 fresh passkey documents with haystacks beyond the longest rows
        held = make_needle_corpus(200, seed + 1000, _fitting_sentences(tok, max(seq_lengths) + 128, needle_digits),
                                  needle_digits)
        held = sorted(held, key=lambda d: -len(tok(d)["input_ids"]))[:8]
        paths["heldout"] = os.path.join(out, "heldout.jsonl")
        with open(paths["heldout"], "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in held)
    for i, L in enumerate(seq_lengths):
        needles = []
        if needle_docs:
            sents = needle_max_sentences or _fitting_sentences(tok, L, needle_digits)
            needles = make_needle_corpus(needle_docs, seed + i, sents, needle_digits)
        docs = base + needles
        if needles or drill_docs:
            rng.shuffle(docs)
        if i == 0:
            paths["corpus"] = os.path.join(out, "corpus.jsonl")
            with open(paths["corpus"], "w") as f:
                f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        path = paths[f"data_{L}"] = os.path.join(out, f"data_{L}")
        ids = tok(docs, add_special_tokens=False)["input_ids"]
        if document_masking:  # whole documents per row (greedy, padded): a passkey document never loses its needle
            from .packed_data import pack_examples, save_rows
            whole = ([tok.bos_token_id] + d + [tok.eos_token_id] for d in ids)
            save_rows(list(pack_examples(((d, d) for d in whole), L, tok.eos_token_id, {})), path)
        else:
            pack_documents(ids, L, path, tok.bos_token_id, tok.eos_token_id, progress=False)
    return paths


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Build a tiny local Llama + byte-level tokenizer + packed corpus.")
    p.add_argument("out")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[128])
    p.add_argument("--docs", type=int, default=200)
    p.add_argument("--needle-docs", type=int, default=0, help="passkey documents in eval_needle's format")
    p.add_argument("--needle-max-sentences", type=int, default=16,
                   help="filler sentences per passkey document; 0 = as many as fit each length's rows")
    p.add_argument("--needle-digits", type=int, nargs=2, default=[4, 10], metavar=("MIN", "MAX"),
                   help="digits of the passkey documents' numbers")
    p.add_argument("--drill-docs", type=int, default=0, help="passkey drills (teach copying numbers)")
    p.add_argument("--drill-digits", type=int, nargs=2, default=[6, 16], metavar=("MIN", "MAX"),
                   help="digits of the drills' numbers")
    p.add_argument("--drill-style", choices=sorted(DRILL_STYLES), default="passkey",
                   help="drill sentence (DRILL_STYLES): passkey, or recall (asked again as eval_needle asks)")
    p.add_argument("--split-digits", action="store_true", help="tokenizer isolates digits (\" 4\" \"8\")")
    p.add_argument("--vocab", type=int, default=384, help="tokenizer vocabulary size")
    p.add_argument("--document-masking", action="store_true", help="position_ids restarting per document")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="corpus, tokenizer and initial weights")
    a = p.parse_args()
    for k, v in build_all(a.out, a.seq_lengths, a.docs, a.seed, needle_docs=a.needle_docs,
                          needle_max_sentences=a.needle_max_sentences or None, needle_digits=tuple(a.needle_digits),
                          drill_docs=a.drill_docs, drill_digits=tuple(a.drill_digits), drill_style=a.drill_style,
                          split_digits=a.split_digits, vocab_size=a.vocab, document_masking=a.document_masking,
                          hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads).items():
        print(f"{k}: {v}")
