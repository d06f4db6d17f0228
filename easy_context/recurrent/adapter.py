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

    register_adapter("Qwen3NextGatedDeltaNet", MyAdapter())   # by class name (no transformers import)

Rules an adapter keeps: run_chunk(x[:, :a]) then run_chunk(x[:, a:]) with the first call's final state equals
one run_chunk(x) (within float rounding); the state tuple holds only tensors (no None); it allocates what it
returns (the chain keeps references to the states it receives).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch


class Adapter(Protocol):
    def zero_state(self, layer, batch: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]: ...

    def run_chunk(self, layer, hidden_states: torch.Tensor, state: tuple[torch.Tensor, ...],
                  resets: torch.Tensor | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...


_ADAPTERS: dict[str, Adapter] = {}


def register_adapter(layer_class_name: str, adapter: Adapter) -> None:
    """Make ``layer_class_name`` (``type(module).__name__``) supported under every sequence-parallel mode."""
    for attr in ("zero_state", "run_chunk"):
        if not callable(getattr(adapter, attr, None)):
            raise TypeError(f"adapter for {layer_class_name} has no {attr}() (see easy_context/recurrent/adapter.py)")
    _ADAPTERS[layer_class_name] = adapter


def get_adapter(layer) -> Adapter | None:
    """The adapter of a layer instance (by its class name), None when its class is not supported."""
    from . import builtin  # noqa: F401  (registers the adapters shipped with the package)
    return _ADAPTERS.get(type(layer).__name__)


def supported_classes() -> tuple[str, ...]:
    from . import builtin  # noqa: F401
    return tuple(sorted(_ADAPTERS))


def run_with_resets(run: Callable, adapter: Adapter, layer, x: torch.Tensor, state: tuple, resets):
    """``run(layer, x, state) -> (out, state)`` without resets, turned into one that honours ``resets``: the
    chunk is cut at every document start and the state is zeroed there. Rows with different cuts run one by
    one (a reset in row b must not zero row b' != b)."""
    if resets is None or not bool(resets.any()):
        return run(layer, x, state)
    if not bool((resets == resets[:1]).all()):  # rows differ: each row on its own
        outs, finals = [], []
        for b in range(x.shape[0]):
            o, f = run_with_resets(run, adapter, layer, x[b:b + 1], tuple(s[b:b + 1] for s in state),
                                   resets[b:b + 1])
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 0), tuple(torch.cat(parts, 0) for parts in zip(*finals))
    cuts = resets[0].nonzero().flatten().tolist()
    bounds = ([0] if cuts[0] != 0 else []) + cuts + [x.shape[1]]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if s in cuts:
            state = adapter.zero_state(layer, x.shape[0], x.dtype, x.device)
        o, state = run(layer, x[:, s:e], state)
        outs.append(o)
    return torch.cat(outs, 1), state


__all__ = ["Adapter", "register_adapter", "get_adapter", "supported_classes", "run_with_resets"]
