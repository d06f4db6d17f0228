"""Head-chunked attention blocks (easy_context/memory/head_chunks.py): exact under every checkpointing choice,
attention computed as often as without chunks, and clear errors for what it cannot do.
W=2 in every mode: tests/test_memory.py (the head_chunks configs of its sequence-parallel spawn)."""
from __future__ import annotations

import copy

import pytest
import torch

from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs
from easy_context.memory import causal_lm_loss, configure_memory, head_chunks_of
from easy_context.registry import SEQ_ALGOS, get_mode
from tests.model_equiv import build_model, make_batch, reference_step
from tests.tols import assert_close

REL = 1e-5
# a ring mode with the lean attention cache; at sp = 1 it is the plain kernel
MODE = next(m for m in SEQ_ALGOS if get_mode(m).uses_ring and get_mode(m).supports_attention_cache)
MEMORY = [dict(checkpointing="none"), dict(checkpointing="layer"), dict(checkpointing="offload"),
          dict(checkpointing="offload", offload_every_k=2), dict(checkpointing="offload", offload_every_k=3,
                                                                    selective=True),
          dict(checkpointing="selective"), dict(checkpointing="nested", offload_every_k=2, tiled_mlp=3, lean_norm=True),
          dict(checkpointing="nested", offload_every_k=2, keep_nested_attention=False)]


def _step(model, p):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, p["local_input_ids"], p["local_position_ids"], p["local_target_ids"], chunk_size=7)
    loss.backward()
    return loss.detach(), {n: q.grad.detach().clone() for n, q in model.named_parameters()}


def _setup(family, layers=4, **overrides):
    ref = build_model(family, num_hidden_layers=layers, **overrides)
    ids, pos, tgt = make_batch(2, 24, ref.config.vocab_size, labels_mask="random")
    _, ref_loss, ref_grads = reference_step(copy.deepcopy(ref), ids, pos, tgt)
    model = apply_seq_parallel_monkey_patch(MODE, copy.deepcopy(ref))
    p = prepare_seq_parallel_inputs(MODE, ids, pos, tgt, 0, 1, torch.device("cpu"))
    return model, p, ref_loss, ref_grads


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
                                               ("gemma3", {}), ("mixtral", {}), ("llama", dict(num_key_value_heads=4))])
def test_head_chunks_exact_under_every_checkpointing(family, overrides):
    """qwen2: q/k/v biases (o_proj's bias once); qwen3 / gemma3: per-head q/k norms (gemma3: local/global layers,
    query_pre_attn_scalar); mixtral: MoE MLP; kv = q heads: one head per group."""
    model, p, ref_loss, ref_grads = _setup(family, **overrides)
    kv = model.config.num_key_value_heads
    for cfg in MEMORY:
        for n in sorted({2, kv}):
            configure_memory(model, head_chunks=n, **cfg)
            assert head_chunks_of(model) == n
            loss, grads = _step(model, p)
            tag = f"[{family} {overrides} {cfg} head_chunks={n}]"
            assert_close(loss, ref_loss, REL, f"{tag} loss")
            for name, g in grads.items():
                assert_close(g, ref_grads[name], REL, f"{tag} grad {name}")
    configure_memory(model, "layer")  # configuring again undoes the chunks
    assert head_chunks_of(model) == 1 and "forward" not in model.model.layers[0].self_attn.__dict__


def test_head_chunks_compute_attention_as_often_as_without():
    """Each group's attention runs as often as the whole block's would (forward + one recompute; nested groups keep
    what their rebuild computed), so chunking adds no attention work: n x the calls, each 1/n of the heads."""
    import importlib
    model, p, _, _ = _setup("llama", num_key_value_heads=4)
    impl = importlib.import_module(type(get_mode(MODE)).__module__.rsplit(".", 1)[0] + ".attention")
    name = next(n for n in dir(impl) if n.endswith("_ring_forward"))  # what the mode's Function calls to compute
    real, calls = getattr(impl, name), []

    def counted(q, *a, **kw):
        calls.append(q.shape[2])  # heads of this call ((B, S, H, D) layout)
        return real(q, *a, **kw)
    setattr(impl, name, counted)
    try:
        seen = {}
        for cfg in (dict(checkpointing="offload"), dict(checkpointing="nested", offload_every_k=2),
                    dict(checkpointing="selective")):
            for n in (1, 4):
                configure_memory(model, head_chunks=n, **cfg)
                calls.clear()
                _step(model, p)
                seen[str(cfg), n] = list(calls)
    finally:
        setattr(impl, name, real)
    for cfg in {c for c, _ in seen}:
        one, four = seen[cfg, 1], seen[cfg, 4]
        assert len(four) == 4 * len(one) and set(one) == {4} and set(four) == {1}, (cfg, one, four)


def test_head_chunks_errors():
    model = build_model("llama")
    with pytest.raises(ValueError, match="must divide the number of key/value heads"):
        configure_memory(model, "layer", head_chunks=3)
    with pytest.raises(ValueError, match="head_chunks must be >= 1"):
        configure_memory(model, "layer", head_chunks=0)
    for family in ("phi3", "olmo2"):  # fused qkv / norms over all heads
        with pytest.raises(ValueError, match="is not supported"):
            configure_memory(build_model(family), "layer", head_chunks=2)
    # a model attention (not a mode's) keeps no (out, lse): refused at the first step, before any wrong gradient
    configure_memory(model, "offload", head_chunks=2)
    ids, pos, tgt = make_batch(1, 16, model.config.vocab_size)
    with pytest.raises(ValueError, match="apply_seq_parallel_monkey_patch"):
        causal_lm_loss(model, ids, pos, tgt).backward()
    # ZeRO-3 parameters: the blocks gather them themselves (tests/test_head_chunks_zero3.py)


def test_head_chunks_accumulate_each_parameter_once():
    """The groups' parameter gradients are summed inside and accumulated once per backward: DDP's and ZeRO-2's
    gradient hooks (one firing per parameter per backward) see what they see without groups."""
    model, p, ref_loss, ref_grads = _setup("qwen3", num_key_value_heads=4)  # q/k norms: shared by the groups
    configure_memory(model, "offload", offload_every_k=2, head_chunks=4)
    fired = {}
    hooks = [q.register_post_accumulate_grad_hook(lambda t, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
             for n, q in model.named_parameters()]
    try:
        loss, grads = _step(model, p)
    finally:
        for h in hooks:
            h.remove()
    assert fired and set(fired.values()) == {1}, {n: c for n, c in fired.items() if c != 1}
    assert len(fired) == len(dict(model.named_parameters()))
    assert_close(loss, ref_loss, REL, "loss")
    for name, g in grads.items():
        assert_close(g, ref_grads[name], REL, f"grad {name}")
