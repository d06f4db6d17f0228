"""One adapter for every layer that speaks transformers' hybrid-cache protocol (gated DeltaNet of qwen3_next /
qwen3_5, lfm2's short convolution, ...): the layer's OWN forward runs with a stand-in cache that hands it the
incoming state and catches the outgoing one, so no model code is copied and upstream changes follow.

The protocol, as those forwards use it (transformers 5.x, modeling_qwen3_next.Qwen3NextGatedDeltaNet.forward):
  cache.get_conv_state / get_recurrent_state(layer_idx)   -> the state (never None here)
  cache.is_recording_past(layer_idx)                      -> True: always the prefill path (no in-place decode
                                                             kernel), also for a chunk of one token
  cache.update_conv_state(x, layer_idx, ...)              -> cat(window, x): the conv sees the previous kernel-1
                                                             inputs; the new window is the last kernel-1 of that
  cache.update_recurrent_state(s, layer_idx)              -> the state after the chunk
All of it differentiable: the window and the state are ordinary autograd tensors (no in-place copies).
"""
from __future__ import annotations

import torch

from .resets import run_with_resets


class _StateCache:
    """Duck-typed transformers cache holding one layer's state for one chunk."""

    def __init__(self, window: torch.Tensor, recurrent: torch.Tensor | None):
        self.window, self.recurrent = window, recurrent

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.window

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def is_recording_past(self, layer_idx=None):
        return True

    def update_conv_state(self, conv_states, layer_idx=None, state_idx=0, **kwargs):
        full = torch.cat([self.window.to(conv_states.dtype), conv_states], dim=-1)
        self.window = full[..., full.shape[-1] - self.window.shape[-1]:]
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx=None, state_idx=0, **kwargs):
        self.recurrent = recurrent_states
        return recurrent_states


def _conv(layer) -> torch.nn.Conv1d:
    for c in layer.children():
        if isinstance(c, torch.nn.Conv1d):
            return c
    raise TypeError(f"{type(layer).__name__} has no Conv1d child: not a hybrid-cache layer this adapter knows")


class HybridCacheAdapter:
    """State = (conv window (B, channels, kernel-1) in the layer's dtype[, recurrent state (B, *recurrent_shape)
    in float32]). ``recurrent_shape(layer)`` is None for a layer without a recurrent state (a short convolution)."""

    def __init__(self, recurrent_shape=None):
        self.recurrent_shape = recurrent_shape
        self._known: dict = {}

    def supports(self, layer) -> bool:
        """Does the installed transformers' forward of this class take ``cache=`` and use the protocol above
        (transformers 5.24; older releases pass ``cache_params`` with other methods)? If not, the class is treated
        as unsupported, i.e. refused by name (detect.py), never run through a protocol it does not speak."""
        cls = type(layer)
        if cls not in self._known:
            import inspect
            try:
                src = inspect.getsource(cls.forward)
                params = inspect.signature(cls.forward).parameters
            except (OSError, TypeError, ValueError):
                src, params = "", {}
            need = ("update_conv_state", "is_recording_past") + (("update_recurrent_state",)
                                                                 if self.recurrent_shape else ())
            self._known[cls] = "cache" in params and all(n in src for n in need)
        return self._known[cls]

    def zero_state(self, layer, batch, dtype, device):
        conv = _conv(layer)
        state = (torch.zeros(batch, conv.in_channels, conv.kernel_size[0] - 1, dtype=conv.weight.dtype,
                             device=device),)
        if self.recurrent_shape is not None:  # the torch / fla chunk rules keep the state in float32
            state += (torch.zeros(batch, *self.recurrent_shape(layer), dtype=torch.float32, device=device),)
        return state

    def _run(self, layer, x, state):
        cache = _StateCache(state[0], state[1] if len(state) > 1 else None)
        out = type(layer).forward(layer, x, cache=cache)  # the class's forward: the instance one is our wrapper
        final = (cache.window.to(state[0].dtype),) + ((cache.recurrent.float(),) if len(state) > 1 else ())
        return out, final

    def run_chunk(self, layer, hidden_states, state, resets):
        return run_with_resets(self._run, self, layer, hidden_states, state, resets)

    def run_plan(self, plan, layer, x):
        """All of this rank's pieces at once, no serial chain (chain.run_layer calls it first): gated DeltaNet by
        delta_parallel.py, a conv-only layer by conv_parallel.py; None -> the serial chain."""
        if self.recurrent_shape is None:
            from .conv_parallel import run_plan
            return run_plan(self, plan, layer, x)
        from .delta_parallel import run_plan
        return run_plan(plan, layer, x)


def delta_rule_state(layer) -> tuple[int, int, int]:
    """Gated DeltaNet's recurrent state per row: (value heads, key head dim, value head dim)."""
    return (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
