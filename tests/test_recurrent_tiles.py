"""configure_memory(recurrent_tiles=N): on one process a hybrid's recurrent layers run their sequence as N tiles one
after another (recurrent/chain.py's chain, every tile this rank's), the backward recomputing one tile at a time.
Exact against the plain model (packed rows: each document alone), and the forward keeps only the layer inputs and
the tiles' incoming states: fewer saved bytes than the untiled patch, which keeps the layers' internals."""
from __future__ import annotations

import copy

import pytest
import torch

from easy_context import apply_seq_parallel_monkey_patch
from easy_context.memory import configure_memory
from tests.hybrid_models import MAMBA2, SUPPORTED, build_hybrid
from tests.model_equiv import make_batch, per_document_reference, reference_step
from tests.test_hybrid import _packed
from tests.tols import assert_close

L = 48


def _saved_bytes(model, ids, pos):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, position_ids=pos, use_cache=False).logits.sum()
    return total[0]


@pytest.mark.parametrize("family", [*SUPPORTED, MAMBA2[0]])
def test_recurrent_tiles_equal_the_plain_model_and_keep_less(family, monkeypatch):
    ref = build_hybrid(family)
    untiled, tiled = copy.deepcopy(ref), copy.deepcopy(ref)  # each patched itself (a patch holds its layers)
    for m in (untiled, tiled):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", m)  # one process: the plan is one piece
    configure_memory(tiled, checkpointing="none", recurrent_tiles=3)
    from easy_context.recurrent import chain
    runs = []
    real = chain.chain_forward
    monkeypatch.setattr(chain, "chain_forward", lambda plan, *a, **k: runs.append(len(plan.pieces)) or real(plan, *a, **k))
    ids, pos, tgt = make_batch(2, L, ref.config.vocab_size, seed=3)
    for packed in (False, True):
        p = _packed(2, L, seed=5) if packed else pos
        want = (per_document_reference if packed else reference_step)(ref, ids, p, tgt)
        runs.clear()
        got = reference_step(tiled, ids, p, tgt)
        assert runs and all(n == 3 for n in runs), f"{family}: the layers did not run in 3 tiles: {runs}"
        tag = f"{family} tiles=3 packed={packed}"
        assert_close(got[0], want[0], 1e-5, f"{tag} logits")
        assert_close(got[1], want[1], 1e-5, f"{tag} loss")
        for name in want[2]:
            assert_close(got[2][name], want[2][name], 1e-5, f"{tag} grad {name}")
    assert _saved_bytes(tiled, ids, pos) < _saved_bytes(untiled, ids, pos)


def test_recurrent_tiles_need_the_patch():
    model = build_hybrid("qwen3_5")
    with pytest.raises(ValueError, match="recurrent_tiles needs recurrent layers routed by the patch"):
        configure_memory(model, checkpointing="none", recurrent_tiles=2)
    with pytest.raises(ValueError, match="recurrent_tiles must be >= 1"):
        configure_memory(model, checkpointing="none", recurrent_tiles=0)
    assert configure_memory(model, checkpointing="none").recurrent_tiles == 1


def test_a_deep_copy_of_a_patched_model_trains_its_own_layers(monkeypatch):
    """copy.deepcopy of a patched, tiled model (TRL's reference model, an EMA copy): the copy's recurrent layers run
    through the copy's context (its position ids, its tiles) on its own parameters; the original gets no gradient."""
    ref = build_hybrid("qwen3_5")
    patched = copy.deepcopy(ref)
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", patched)
    configure_memory(patched, checkpointing="none", recurrent_tiles=3)
    clone = copy.deepcopy(patched)
    from easy_context.recurrent import chain
    seen = []
    real = chain.chain_forward
    monkeypatch.setattr(chain, "chain_forward", lambda plan, adapter, layer, *a, **k:
                        seen.append((len(plan.pieces), layer)) or real(plan, adapter, layer, *a, **k))
    ids, _, tgt = make_batch(2, L, ref.config.vocab_size, seed=3)
    pos = _packed(2, L, seed=5)
    want = per_document_reference(ref, ids, pos, tgt)
    got = reference_step(clone, ids, pos, tgt)
    mine = {id(m) for m in clone.modules()}
    assert seen and all(n == 3 and id(layer) in mine for n, layer in seen), "the copy's layers did not run its tiles"
    assert all(p.grad is None for p in patched.parameters()), "the copy trained the original's parameters"
    assert_close(got[1], want[1], 1e-5, "copy loss")
    for name in want[2]:
        assert_close(got[2][name], want[2][name], 1e-5, f"copy grad {name}")
