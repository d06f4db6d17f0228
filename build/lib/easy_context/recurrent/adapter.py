"""The adapter interface: what the sequence-parallel chain needs to know about one recurrent layer class.

A recurrent layer (gated DeltaNet, Mamba-2 mixer, short convolution, ...) maps a sequence x (B, T, D) to
y (B, T, D) while carrying a state along the sequence. An adapter exposes the layer's own computation as a
function of (input chunk, incoming state) -> (output chunk, outgoing state), so that the chain (chain.py) can
run the global sequence piece by piece on the ranks that hold the pieces, passing the state from piece to
piece (and d(state) backwards). The chain is generic: everything layer-specific lives in the adapter.

    class MyAdapter:
        def zero_state(self, layer, batch, dtype, device) -> tuple[Tensor, ...]
            # the state before the first token of a document: every tensor all zeros (the conv window of the
            # last kernel-1 inputs, the recurrent / SSM state, ...). Shapes and dtypes are fixed per layer: the
            # chain sends these tensors between ranks and expects the same shapes back from run_chunk.
        def run_chunk(self, layer, hidden_states, state, resets) -> (out, final_state)
            # hidden_states (B, T, D): the layer's input for T consecutive tokens of the global sequence;
            # state: the tuple of zero_state's shapes holding the state after the token just before them;
            # resets: None, or a bool tensor (B, T), True at the tokens that begin a new document: the state
            #   (and the conv window) is zero just before such a token, exactly as if the document were run
            #   alone (``run_with_resets`` below turns a reset-free run_chunk into one that honours them);
            # returns out (B, T, D) = what layer.forward gives for these tokens on one process, and the state
            #   after the last token. Differentiable in hidden_states, every state tensor and the parameters.
            # Use the layer's own submodules / the model file's torch functions (kernels where installed).

        def supports(self, layer) -> bool      # optional: False when the installed model code is not the one the
            # adapter was written for (the class is then refused by name instead of run wrongly)

    register_adapter("Qwen3NextGatedDeltaNet", MyAdapter())   # by class name (no transformers import)

Rules an adapter keeps: run_chunk(x[:, :a]) then run_chunk(x[:, a:]) with the first call's final state equals
one run_chunk(x) (within float rounding); the state tuple holds only tensors (no None); it allocates what it
returns (the chain keeps references to the states it receives).
"""
from __future__ import annotations

from typing import Protocol

import torch

from .resets import run_with_resets  # noqa: F401 (easy_context.recurrent.adapter.run_with_resets, as before)


class Adapter(Protocol):
    def zero_state(self, layer, batch: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]: ...

    def run_chunk(self, layer, hidden_states: torch.Tensor, state: tuple[torch.Tensor, ...],
                  resets: torch.Tensor | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...


_ADAPTERS: dict[str, Adapter] = {}
_BUILTINS_LOADED = False  # the adapters shipped with the package are registered on the first lookup


def register_adapter(layer_class_name: str, adapter: Adapter) -> None:
    """Make ``layer_class_name`` (``type(module).__name__``) supported under every sequence-parallel mode."""
    for attr in ("zero_state", "run_chunk"):
        if not callable(getattr(adapter, attr, None)):
            raise TypeError(f"adapter for {layer_class_name} has no {attr}() (see easy_context/recurrent/adapter.py)")
    _ADAPTERS[layer_class_name] = adapter


def get_adapter(layer) -> Adapter | None:
    """The adapter of a layer instance (by its class name), None when its class is not supported."""
    _load_builtins()
    adapter = _ADAPTERS.get(type(layer).__name__)
    supports = getattr(adapter, "supports", None)  # optional: the installed model code is the one it knows
    return adapter if adapter is not None and (supports is None or supports(layer)) else None


def supported_classes() -> tuple[str, ...]:
    _load_builtins()
    return tuple(sorted(_ADAPTERS))


def _load_builtins() -> None:
    """Register the adapters shipped with the package (builtin.py) once, on the first lookup."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    from .builtin import BUILTIN
    _BUILTINS_LOADED = True
    for name, adapter in BUILTIN.items():
        register_adapter(name, adapter)


__all__ = ["Adapter", "register_adapter", "get_adapter", "supported_classes", "run_with_resets"]
