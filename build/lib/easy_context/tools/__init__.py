"""Command-line tools behind ``python -m easy_context <command>``: ``check`` (does sequence parallelism
reproduce the single-process model for my config?) and ``plan`` (layout planning)."""
