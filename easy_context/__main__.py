"""``python -m easy_context <command> ...``: the library's command-line tools, each in
``easy_context/tools/<command>/`` with ``main(argv) -> exit status``, imported only when chosen (``--help`` is
instant). The recipe's data and model preparation and the fault table live behind their own door,
``python -m easy_context_train <command>`` (train.py's library); their old spellings here still run, after one line
saying where the command went."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "check": ("easy_context.tools.check", "does sequence parallelism reproduce the single-process model "
                                          "for a config? (logits, loss, gradients; PASS/FAIL; --census: every family)"),
    "plan": ("easy_context.tools.plan", "plan a parallel layout for a model and sequence length"),
    "launch": ("easy_context.tools.launch", "accelerate launch with the rendezvous store on loopback (one node)"),
}
MOVED = ("convert", "fetch-smollm2", "fetch-gemma3", "real-text", "retrieval-data", "faults")  # -> easy_context_train


def run(prog: str, commands: dict, argv: list[str]) -> int:
    """Dispatch ``argv`` over ``commands`` (name -> ("module[:function]", description)); also the door of
    ``python -m easy_context_train``. A command is imported only when chosen."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        width = max(map(len, commands))
        rows = "\n".join(f"  {name:<{width}}  {desc}" for name, (_, desc) in commands.items())
        print(f"usage: python -m {prog} <command> [options]\n\ncommands:\n{rows}\n\n"
              f"python -m {prog} <command> --help for a command's options")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"python -m {prog}: error: unknown command {name!r}; commands: {', '.join(commands)}", file=sys.stderr)
        return 2
    module_name, _, function = commands[name][0].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # a dependency is missing: show the real error
        print(f"python -m {prog}: error: command {name!r} is not available in this installation "
              f"({e.name} not found)", file=sys.stderr)
        return 2
    return int(getattr(module, function or "main")(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in MOVED:
        print(f"python -m easy_context {argv[0]}: moved to `python -m easy_context_train {argv[0]}` (running it)",
              file=sys.stderr)
        door = "easy_context_train.__main__"  # the train package's front door, by name: the library never imports it
        return importlib.import_module(door).main(argv)
    return run("easy_context", COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
