"""Lazy package attributes (PEP 562): a mode package's ``mode.py`` is imported without its attention's torch
imports, so train.py can read mode names and attributes before any heavy import."""
from __future__ import annotations

import importlib


def lazy_attrs(package: str, table: dict[str, str]):
    """``__getattr__`` for ``package`` resolving each name of ``table`` from its submodule (".attention")."""
    def __getattr__(name):
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            setattr(importlib.import_module(package), name, value)  # later lookups skip __getattr__
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
