"""The recurrent layers inside SeqParallelLM (eval_needle / eval_ppl): prefill through the chain, decode from the
state after the prompt, replicated on every rank.

* forward (nll, teacher forcing): the chain, as in training (no graph).
* prefill of a prompt of n tokens (padded at the end to the layout's multiple): the chain with a piece boundary at
  global index n; the rank that computed the state before token n (after the last real prompt token; padding comes
  later in sequence order and never reaches it) broadcasts it to the sp group.
* decode: every rank runs the new token through the layer from that state (``adapter.run_chunk`` on one token)
  and keeps the new state: identical on all ranks, like the engine's replicated generated-token KV.
"""
from __future__ import annotations

import torch.distributed as dist

from .adapter import get_adapter
from .chain import chain_forward
from .patch import apply as patch_model
from ..registry import PLAIN_MODE


class RecurrentDecode:
    """Per engine: which phase, the prompt length, the per-layer decode state."""

    def __init__(self, engine_state, group):
        self.engine_state, self.group = engine_state, group
        self.prompt_len = None
        self.states: dict = {}

    def run(self, ctx, layer, hidden_states):
        phase = self.engine_state.phase
        adapter = get_adapter(layer)
        if phase == "decode":
            out, state = adapter.run_chunk(layer, hidden_states, self.states[id(layer)], None)
            self.states[id(layer)] = tuple(state)
            return out
        plan = ctx.plan(hidden_states.shape[0], hidden_states.shape[1])
        if phase != "prefill":
            return chain_forward(plan, adapter, layer, hidden_states)[0]
        n = self.prompt_len
        plan = plan.cut_at(n)
        capture = {n: None}
        out, _ = chain_forward(plan, adapter, layer, hidden_states, capture)
        owner = next(p.owner for p in plan.pieces if p.start + p.length == n)
        state = capture[n] if capture[n] is not None else adapter.zero_state(layer, hidden_states.shape[0],
                                                                            hidden_states.dtype, hidden_states.device)
        state = tuple(t.contiguous() for t in state)
        if dist.is_available() and dist.is_initialized() and not plan.single:
            for t in state:
                dist.broadcast(t, src=owner, group=self.group)
        self.states[id(layer)] = state
        return out


def attach(model, mode, groups: dict, engine_state, group):
    """Patch ``model``'s recurrent layers for the engine (refusing unsupported ones under an sp mode); returns the
    decode handle, or None for a model without recurrent layers."""
    patch_model(mode, model, groups)
    ctx = getattr(model, "_easy_context_recurrent", None)
    if ctx is None:
        from .detect import recurrent_layers
        if recurrent_layers(model):  # data_parallel with an unsupported class: decode would lose its state
            from .detect import refuse_in_inference
            refuse_in_inference(model)
        return None
    ctx.infer = RecurrentDecode(engine_state, group)
    return ctx.infer


def detach(model) -> None:
    patch_model(PLAIN_MODE, model, {})
    ctx = getattr(model, "_easy_context_recurrent", None)
    if ctx is not None:
        ctx.infer = None
