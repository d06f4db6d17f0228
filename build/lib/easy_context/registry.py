"""Mode name -> ``Mode`` (easy_context/mode.py). Adding a sequence-parallel mode is one package plus one line here
(or one ``register_mode`` call at run time).

Each line names the class ("package.module:Class"); it is imported on first use, so ``import easy_context`` and
train.py's flag parsing load no torch. Every list of mode names (``SEQ_ALGOS``, train.py's ``--parallel_mode``
choices, the eval and check CLIs, the planner's search) is read from here.
"""
from __future__ import annotations

import importlib

from .mode import Mode

_MODES: dict[str, str | Mode] = {
    "data_parallel": "easy_context.data_parallel.mode:DataParallelMode",
    "zigzag_ring_attn": "easy_context.zigzag_ring_attn.mode:ZigzagRingMode",
    "dist_flash_attn": "easy_context.dist_flash_attn.mode:DistFlashMode",
    "ulysses_attn": "easy_context.ulysses_attn.mode:UlyssesMode",
    "usp_attn": "easy_context.usp.mode:UspMode",
}
SEQ_ALGOS: tuple[str, ...] = tuple(_MODES)  # the built-in modes (public API); mode_names() adds registered ones
DEFAULT_MODE = "zigzag_ring_attn"           # train.py's and the evals' --parallel_mode default
PLAIN_MODE = "data_parallel"                # no sequence parallelism: every rank runs whole sequences


def mode_names() -> tuple[str, ...]:
    """Every mode name, built-in and registered, in registration order."""
    return tuple(_MODES)


def register_mode(mode, name: str | None = None) -> Mode:
    """Add a mode at run time: a ``Mode`` subclass, an instance, or a "package.module:Class" string. Its name is
    ``mode.name`` (or ``name=``); registering a name twice is an error (built-in modes cannot be replaced)."""
    if isinstance(mode, str):
        mode = _load(mode)
    elif isinstance(mode, type) and issubclass(mode, Mode):
        mode = mode()
    if not isinstance(mode, Mode):
        raise TypeError(f"register_mode needs a Mode subclass, instance or 'module:Class' string; got {mode!r}")
    name = name or mode.name
    if not name or name in _MODES:
        raise ValueError(f"cannot register mode {name!r}: " + ("it has no name" if not name else "already registered"))
    if mode.name != name:
        raise ValueError(f"register_mode: name {name!r} differs from the Mode's own name {mode.name!r}")
    _MODES[name] = mode
    return mode


def unregister_mode(name: str) -> None:
    """Remove a mode added with ``register_mode`` (tests); built-in modes stay."""
    if name in SEQ_ALGOS:
        raise ValueError(f"{name} is a built-in mode and cannot be removed")
    _MODES.pop(name, None)


def _load(path: str) -> Mode:
    mod, cls = path.split(":")
    return getattr(importlib.import_module(mod), cls)()


def get_mode(mode) -> Mode:
    """The ``Mode`` of a name (or the Mode itself); an unknown name -> ValueError naming the valid ones."""
    if isinstance(mode, Mode):
        return mode
    try:
        entry = _MODES[mode]
    except (KeyError, TypeError):
        raise ValueError(f"unknown sequence-parallel mode {mode!r}; valid modes: {', '.join(_MODES)}") from None
    if isinstance(entry, str):
        entry = _MODES[mode] = _load(entry)
    return entry


def modes_taking(degree: str) -> list[str]:
    """Names of the modes whose cut takes ``degree`` (e.g. "ring_degree"), for error messages."""
    return [n for n in _MODES if degree in get_mode(n).degree_kwargs]


__all__ = ["SEQ_ALGOS", "DEFAULT_MODE", "PLAIN_MODE", "get_mode", "mode_names", "register_mode", "unregister_mode",
           "modes_taking"]
