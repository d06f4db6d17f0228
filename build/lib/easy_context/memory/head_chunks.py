"""Head-chunked attention blocks: a layer's attention backward one group of heads at a time.

At the attention backward's peak a 7B layer holds q, k, v, out, dout, dq, dk, dv for all 32 heads (8 KB/token
each, bf16) next to the block's input and gradients. Split the heads into ``n`` groups (whole GQA sets) and run
projections -> RoPE -> attention -> the group's slice of o_proj per group: the block's output is the sum of the
groups' partial products, so the maths is the same. With ``n`` groups only one group's q/k/v/dout/dq/dk/dv exists
at a time (7B, offload, H200: 96.6 -> 56.6 KB/token with 8 groups, 0.96x the speed at 128K; CPU census,
bench/trace_memory.py: 93.3 -> 73.4 with 4, 61.3 with 8). The idea of UPipe (head-chunked context parallelism);
no code of it is used.

Attention runs as often as without chunking (forward, plus one recompute under layer checkpointing). Needs a
mode's lean attention (any mode, sp = 1 included; ``apply_seq_parallel_monkey_patch`` first) and separate
q/k/v/o ``nn.Linear`` projections whose heads are contiguous rows (Llama, Mistral, Qwen2/3, Mixtral, Qwen MoE,
Gemma 3). Under DeepSpeed ZeRO-3 the groups slice the weights directly, bypassing the Linear modules' hooks that
would gather them, so the block gathers its parameters itself (``deepspeed.zero.GatheredParameters``) for its forward
and again for its backward: one gather per pass, as the modules' hooks would make, and the gradients reach ZeRO-3's
reduce hooks once per parameter.

The groups' machinery (one ``autograd.Function`` per attention block call: forward without autograd, backward
group by group) is in head_groups.py; here: which attention blocks can be chunked (``_check``,
``head_chunk_problem``) and the patch of their forward.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from .head_groups import (_PENDING, PROJECTIONS, _first, _gathered, _group_view, _HeadChunked,  # noqa: F401
                          _projection_params, _release_pending, _release_when_accumulated)

ATTR = "_easy_context_head_chunks"
# attention classes whose q/k norms (if any) act per head, so a group of heads computes exactly its share
CHUNKABLE = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention", "MixtralAttention",
             "Qwen2MoeAttention", "Qwen3MoeAttention", "Gemma3Attention")


def _check(attn, n: int):
    name = type(attn).__name__
    if name not in CHUNKABLE:
        raise ValueError(f"head_chunks: {name} is not supported (supported: {', '.join(CHUNKABLE)}); its "
                         f"projections or q/k norms are not per head. Use head_chunks=1")
    for p in PROJECTIONS:
        m = getattr(attn, p, None)
        if type(m) is not torch.nn.Linear:
            raise ValueError(f"head_chunks: {name}.{p} is {type(m).__name__}, not a plain torch.nn.Linear (LoRA and "
                             f"quantised layers are not supported); use head_chunks=1")
    if len({getattr(attn, p).bias is None for p in PROJECTIONS[:3]}) > 1:  # one q/k/v product per group needs it
        raise ValueError(f"head_chunks: {name} has biases on some of q/k/v_proj only; use head_chunks=1")
    head_dim = attn.head_dim
    heads, kv = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    if kv % n or heads % n:
        raise ValueError(f"head_chunks={n} must divide the number of key/value heads ({kv}) so every group holds "
                         f"whole GQA sets; choose one of {[d for d in range(1, kv + 1) if kv % d == 0]}")


def _attention_modules(model):
    from transformers.modeling_layers import GradientCheckpointingLayer
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                yield attn


def _chunked_forward(attn, n: int, forward):
    def chunked(hidden_states, *args, **kwargs):
        _release_pending(attn)  # ZeRO-3: a gather a backward left for gradients that never accumulated
        def run(g, h, hooks, record=None):
            with _group_view(attn, g, n, hooks, record):
                return forward(h, *args, **kwargs)

        needs_grad = torch.is_grad_enabled() and (
            hidden_states.requires_grad or any(p.requires_grad for p in attn.parameters()))
        if not needs_grad:
            y = None
            with _gathered(_projection_params(attn)):
                for g in range(n):
                    yg = _first(run(g, hidden_states, False))
                    y = yg if y is None else y.add_(yg)
            return y, None
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))):
            raise ValueError("head-chunked attention: only the hidden states may require grad (position embeddings, "
                             "masks and other inputs must not)")
        named = tuple((name, p) for name, p in attn.named_parameters() if p.requires_grad)
        with _gathered(attn.parameters()):  # ZeRO-3: whole while the graph records their shapes (gradients come whole)
            return _HeadChunked.apply((run, attn, tuple(nm for nm, _ in named)), n, hidden_states,
                                      *(p for _, p in named)), None
    return chunked


def apply_head_chunks(model, n: int) -> int:
    """Run every decoder layer's attention block in ``n`` head groups (see the module doc). ``n = 1`` undoes it.
    Returns the number of attention blocks chunked."""
    n = int(n)
    if n < 1:
        raise ValueError(f"head_chunks must be >= 1, got {n}")
    attns = list(_attention_modules(model))
    if n > 1:
        if not attns:
            raise ValueError(f"head_chunks: {type(model).__name__} has no decoder layer with a self_attn module")
        for attn in attns:
            _check(attn, n)
    remove_head_chunks(model)
    if n == 1:
        return 0
    for attn in attns:
        # the class's forward looked up per call: a class swapped later (fused RoPE, ops/rope.py) is honoured
        attn.forward = _chunked_forward(attn, n, lambda *a, _m=attn, **k: type(_m).forward(_m, *a, **k))
        setattr(attn, ATTR, n)
    return len(attns)


def remove_head_chunks(model) -> None:
    for attn in _attention_modules(model):
        if ATTR in attn.__dict__:
            del attn.__dict__["forward"]
            del attn.__dict__[ATTR]


def head_chunk_problem(model) -> str | None:
    """Why ``model``'s attention blocks cannot run in head groups now (None: they can): an unsupported attention
    class or projection, ZeRO-3 parameters, or an attention that is the model's own (not a mode's)."""
    attns = list(_attention_modules(model))
    if not attns:
        return f"{type(model).__name__} has no decoder layer with a self_attn module"
    try:
        for attn in attns:
            _check(attn, 1)
    except ValueError as e:
        return str(e)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from .selective import _is_lean
    impl = getattr(model.config, "_attn_implementation", None)
    fn = ALL_ATTENTION_FUNCTIONS.get(impl) if impl in ALL_ATTENTION_FUNCTIONS else None
    if fn is None or not _is_lean(fn):
        return (f"the attention ({impl}) is the model's own, not a mode's: call apply_seq_parallel_monkey_patch(mode, "
                "model) first")
    return None


def head_chunk_options(model, most: int = 8) -> tuple[int, ...]:
    """The head-group counts ``model`` can run with: the divisors of its kv heads up to ``most``; (1,) when
    ``head_chunk_problem`` says it cannot."""
    if head_chunk_problem(model) is not None:
        return (1,)
    attn = next(_attention_modules(model))
    kv = attn.k_proj.out_features // attn.head_dim
    return tuple(c for c in range(1, min(kv, most) + 1) if kv % c == 0)


def head_chunks_of(model) -> int:
    return max((getattr(a, ATTR, 1) for a in _attention_modules(model)), default=1)


__all__ = ["apply_head_chunks", "remove_head_chunks", "head_chunks_of", "head_chunk_problem", "head_chunk_options",
           "CHUNKABLE"]
