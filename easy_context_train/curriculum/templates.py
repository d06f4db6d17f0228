"""The curriculum's wordings: needle kinds, question and answer phrasings, prompt frames; each with an id.

Every string here is the training side's own: tests/test_curriculum.py checks on thousands of generated
conversations that no id and no word 4-gram of this fixed wording is one of eval_needle's (``haystack.NEEDLE``,
``PREFIX``, ``QUESTION_STR``), RULER's (``ruler.tasks``) or the held-out probes' (``haystack.heldout``). Placeholders:
{key}, {value}, {values}, {keys}, {var}, {src}, {line}, {question}.
"""
from __future__ import annotations

# --- needles: one fact inserted into the haystack ---------------------------------------------------
NEEDLES = {
    "number": ("The {key} code reads {value}.", "Remember this: {key} corresponds to {value}.",
               "For the record, the figure attached to {key} is {value}.", "Note: {key} -> {value}",
               "{key} was registered under number {value}.", "Ledger entry {key}: {value}"),
    "word": ("The password for {key} is {value}.", "{key} uses the codeword {value}.",
             "Keep in mind that the word linked to {key} is {value}.", "{key} = \"{value}\"",
             "Our team named {key} after the word {value}."),
    "kv": ("\"{key}\": \"{value}\",", "{key} := {value}", "| {key} | {value} |", "key {key} holds {value}",
           "setting[{key}] = '{value}'"),
}
# --- questions about one needle (first turn) / a follow-up turn -------------------------------------
QUESTIONS = {
    "number": ("Which number belongs to {key}?", "What figure goes with {key}?", "Give the number recorded for {key}.",
               "Find {key} in the text and report its number.",
               "According to the passage, what number is tied to {key}?",
               "{key}: which number?"),
    "word": ("Which word is linked to {key}?", "What codeword does {key} use?", "Tell me the password for {key}.",
             "Look for {key} above. Which word was given for it?"),
    "kv": ("Look up {key}: what does it hold?", "Which entry does the key {key} map to?",
           "Return the setting of {key}.", "{key} maps to what?"),
}
FOLLOW_UPS = ("And {key}?", "Now do the same for {key}.", "What about {key}?", "One more: {key}.")
ANSWERS = {
    "number": ("{value}", "{key} has the number {value}.", "The number for {key} is {value}.", "{key}: {value}",
               "It is {value}."),
    "word": ("{value}", "The word is {value}.", "{key} goes with \"{value}\".", "{value}, for {key}."),
    "kv": ("{value}", "{key} maps to {value}.", "It holds {value}.", "{key} -> {value}"),
}
# several needles of one key (all values asked) / several keys asked at once
LIST_QUESTIONS = ("List every number recorded for {key}.", "{key} shows up more than once. Give all of its numbers.",
                  "Collect each figure attached to {key}.")
LIST_ANSWERS = ("{values}", "The numbers for {key} are {values}.", "{key}: {values}")
MULTI_QUESTIONS = ("Give the numbers for {keys}.", "Report the figures attached to {keys}, in that order.")
MULTI_ANSWERS = ("{pairs}",)

# --- multi-hop variable chains --------------------------------------------------------------------
CHAIN_FIRST = ("Let {var} be {value}.", "{var} starts out as {value}.", "Initialize {var} to {value}.")
CHAIN_HOP = ("{var} takes the value of {src}.", "Set {var} equal to {src}.", "{var} copies {src}.",
             "Make {var} the same as {src}.")
CHAIN_QUESTIONS = ("Follow the chain: what value does {var} end up with?", "What is {var} equal to?",
                   "Trace {var} back to its start. What number is it?")
CHAIN_ANSWERS = ("{value}", "{var} equals {value}.", "It ends up as {value}.")
CHAIN_LIST_QUESTIONS = ("Name every variable whose value is {value}.",
                        "Which names end up holding {value}? List them all.")
CHAIN_LIST_ANSWERS = ("{vars}", "These hold {value}: {vars}.")

# --- counting: one word mentioned more often than the others (aggregation over the whole context) -------
COUNT_LINES = ("Logged token: {value}", "(tally mark for {value})", "Seen again: {value}.")
COUNT_QUESTIONS = ("Which logged token shows up most often?", "Of the tallied words, which one was recorded the most?")
COUNT_ANSWERS = ("{value}", "{value} appears most often.")

# --- spans of the haystack itself -----------------------------------------------------------------
SPAN_NEXT = ("Which line comes right after this one: \"{line}\"?", "Quote the line that follows \"{line}\".",
             "Copy out the next line after:\n{line}")
SPAN_PREV = ("Which line comes directly before \"{line}\"?", "Quote the line just above \"{line}\".")

# --- prompt frames: (before the haystack, after it); {question} is the first turn's question ----------
FRAMES = (
    ("Read the text below, then reply.\n\n", "\n\n{question}"),
    ("<context>\n", "\n</context>\n{question}"),
    ("{question}\n\nMaterial:\n", "\n\n(Reply to the request above.)"),
    ("", "\n\n---\n{question}"),
    ("[TEXT]\n", "\n[/TEXT]\nTask: {question}"),
    ("Here is some material.\n\n", "\n\nUsing only the material above: {question}"),
    ("{question}\n\n", "\n\nOnce more: {question}"),
    ("Begin.\n", "\nStop.\nQ: {question}"),
    ("```\n", "\n```\n{question}"),
)
# a reply sometimes starts with a given lead (context, not trained): the model learns to finish a primed answer
LEADS = ("Sure. ", "From the text: ", "Here it is: ", "Answer - ")


def template_ids() -> set[str]:
    """Every id this module can emit (tests compare them with the eval side's)."""
    ids = {f"needle/{k}/{i}" for k, v in NEEDLES.items() for i in range(len(v))}
    ids |= {f"question/{k}/{i}" for k, v in QUESTIONS.items() for i in range(len(v))}
    ids |= {f"answer/{k}/{i}" for k, v in ANSWERS.items() for i in range(len(v))}
    for name in ("FOLLOW_UPS", "LIST_QUESTIONS", "LIST_ANSWERS", "MULTI_QUESTIONS", "MULTI_ANSWERS", "CHAIN_FIRST",
                 "CHAIN_HOP", "CHAIN_QUESTIONS", "CHAIN_ANSWERS", "CHAIN_LIST_QUESTIONS", "CHAIN_LIST_ANSWERS",
                 "COUNT_LINES", "COUNT_QUESTIONS", "COUNT_ANSWERS", "SPAN_NEXT", "SPAN_PREV", "FRAMES", "LEADS"):
        ids |= {f"{name.lower()}/{i}" for i in range(len(globals()[name]))}
    return {"train/" + i for i in ids}


def all_wording() -> list[str]:
    """Every fixed string of this module (frames flattened)."""
    out = []
    for v in list(NEEDLES.values()) + list(QUESTIONS.values()) + list(ANSWERS.values()):
        out += v
    for t in (FOLLOW_UPS, LIST_QUESTIONS, LIST_ANSWERS, MULTI_QUESTIONS, MULTI_ANSWERS, CHAIN_FIRST, CHAIN_HOP,
              CHAIN_QUESTIONS, CHAIN_ANSWERS, CHAIN_LIST_QUESTIONS, CHAIN_LIST_ANSWERS, COUNT_LINES, COUNT_QUESTIONS,
              COUNT_ANSWERS, SPAN_NEXT, SPAN_PREV, LEADS):
        out += t
    return out + [s for f in FRAMES for s in f]
