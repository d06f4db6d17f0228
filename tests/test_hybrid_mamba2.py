"""Mamba-2 mixers run chunk by chunk (easy_context/recurrent/mamba2.py) equal the layer's own forward.

Single process, no spawn: the whole sequence from a zero state equals the HF layer (torch path, no cache);
chunks chained through the returned states equal the full run; document resets equal per-document layer
calls — forward and backward (the input and every parameter), float32 within 1e-5 relative, at awkward sizes
(chunks not multiples of the SSD chunk size, a reset exactly at a chunk boundary, one-token documents and
chunks). The states themselves are checked against a float64 token-by-token recurrence.
"""
from __future__ import annotations

import pytest
import torch

from easy_context.recurrent.mamba2 import MAMBA2_CLASSES, run_chunk, segment_ids, zero_state
from tests.tols import assert_close

SEQ = 37          # not a multiple of the SSD chunk size (8)
CUTS = (0, 5, 13, 14, 16, 30, SEQ)          # chunk edges: a 1-token chunk, 16 = two whole SSD chunks
DOCS = (0, 1, 13, 14, 16, 21, 36)           # document starts: 1-token documents, starts on chunk edges
MODEL_TYPES = ("nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "falcon_h1_norm")


def make_hybrid_config(model_type: str, **overrides):
    """A tiny float32 hybrid config: Mamba-2 (8 heads x 8, d_state 16, 2 groups, conv 4, SSD chunk 8) + attention."""
    import transformers as tf
    attn = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=4096, tie_word_embeddings=False)
    mamba = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
                 mamba_chunk_size=8, mamba_expand=1)
    if model_type == "nemotron_h":  # mamba, attention, mlp, mamba
        cfg = tf.NemotronHConfig(**attn, head_dim=16, num_hidden_layers=4, hybrid_override_pattern="M*-M",
                                 mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4,
                                 chunk_size=8)
    elif model_type == "bamba":
        cfg = tf.BambaConfig(**attn, **mamba, num_hidden_layers=2, attn_layer_indices=[1])
    elif model_type == "granitemoehybrid":
        cfg = tf.GraniteMoeHybridConfig(**attn, **mamba, num_hidden_layers=2, num_local_experts=4,
                                        num_experts_per_tok=2, shared_intermediate_size=64,
                                        layer_types=["mamba", "attention"])
    elif model_type in ("falcon_h1", "falcon_h1_norm"):  # attention and mamba side by side in every layer
        cfg = tf.FalconH1Config(**attn, **mamba, num_hidden_layers=2, mamba_d_ssm=64,
                                mamba_rms_norm=model_type == "falcon_h1_norm", mamba_norm_before_gate=False,
                                ssm_in_multiplier=0.7, ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.6])
    else:
        raise ValueError(f"unknown model type {model_type!r}; choose one of {MODEL_TYPES}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_mixer(model_type: str, seed: int = 0):
    """The first Mamba-2 mixer of a tiny random model, every parameter moved off its init (so each gets a grad);
    decays from slow (the state lives tens of tokens) to fast, so a wrong state shows."""
    import transformers as tf
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(make_hybrid_config(model_type))
    layer = next(m for m in model.modules() if type(m).__name__ in MAMBA2_CLASSES)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.05, 2.0).log())
    return layer.train()


def _grads(layer, x, fn, probe):
    x = x.detach().requires_grad_(True)
    out = fn(x)
    params = [p for _, p in layer.named_parameters()]
    grads = torch.autograd.grad((out * probe).sum(), [x] + params)
    return out.detach(), dict(zip(["input"] + [n for n, _ in layer.named_parameters()], grads))


def _chained(layer, x, cuts, docs=None):
    """run_chunk over the pieces ``cuts`` of ``x``, each from the previous piece's final state."""
    state = zero_state(layer, x.shape[0], x.dtype, x.device)
    outs = []
    for a, b in zip(cuts, cuts[1:]):
        resets = None if docs is None else torch.tensor([d - a for d in docs if a <= d < b], dtype=torch.long)
        out, state = run_chunk(layer, x[:, a:b], state, resets)
        outs.append(out)
    return torch.cat(outs, dim=1)


def _per_document(layer, x, docs):
    """The reference for packed documents: one layer call per document."""
    edges = list(docs) + [x.shape[1]]
    return torch.cat([layer(x[:, a:b]) for a, b in zip(edges, edges[1:])], dim=1)


def _compare(layer, x, fn, ref_fn, what):
    probe = torch.randn(x.shape[0], x.shape[1], layer.hidden_size)
    out, grads = _grads(layer, x, fn, probe)
    ref, ref_grads = _grads(layer, x, ref_fn, probe)
    assert_close(out, ref, name=f"{what}: output")
    for name, g in grads.items():
        assert_close(g, ref_grads[name], name=f"{what}: grad {name}")


# bamba and granitemoehybrid share nemotron_h's mixer forward line for line (transformers 5.24): slow-only extras
_SAME_CODE = pytest.mark.slow


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=_SAME_CODE) if m in ("bamba", "granitemoehybrid")
                                        else m for m in MODEL_TYPES])
def test_chunks_equal_layer(model_type):
    layer = tiny_mixer(model_type)
    x = torch.randn(2, SEQ, layer.hidden_size)
    whole = lambda t: run_chunk(layer, t, zero_state(layer, 2, t.dtype, t.device))[0]  # noqa: E731
    _compare(layer, x, whole, layer, f"{model_type} whole sequence")
    _compare(layer, x, lambda t: _chained(layer, t, CUTS), layer, f"{model_type} chained chunks")


@pytest.mark.parametrize("model_type", ["nemotron_h", pytest.param("falcon_h1", marks=pytest.mark.slow)])
def test_document_resets(model_type):
    layer = tiny_mixer(model_type)
    x = torch.randn(2, SEQ, layer.hidden_size)
    ref = lambda t: _per_document(layer, t, DOCS)  # noqa: E731
    _compare(layer, x, lambda t: _chained(layer, t, (0, SEQ), DOCS), ref, f"{model_type} resets, one chunk")
    _compare(layer, x, lambda t: _chained(layer, t, CUTS, DOCS), ref, f"{model_type} resets, chained chunks")
    if model_type == "nemotron_h":  # one-token chunks everywhere (a window shorter than the conv kernel)
        _compare(layer, x, lambda t: _chained(layer, t, tuple(range(SEQ + 1)), DOCS), ref, "1-token chunks")


def test_per_row_reset_mask():
    """A (b, L) bool mask gives each row its own documents."""
    layer = tiny_mixer("nemotron_h")
    x = torch.randn(2, SEQ, layer.hidden_size)
    rows = ((0, 9, 30), (0, 1, 2, 20))
    mask = torch.zeros(2, SEQ, dtype=torch.bool)
    for r, docs in enumerate(rows):
        mask[r, list(docs)] = True
    with torch.no_grad():
        out, _ = run_chunk(layer, x, zero_state(layer, 2, x.dtype, x.device), mask)
        for r, docs in enumerate(rows):
            assert_close(out[r:r + 1], _per_document(layer, x[r:r + 1], docs), name=f"row {r}")


def _recurrence64(layer, x, docs):
    """Float64 token-by-token Mamba-2 (conv window + SSM) with resets: (y before the norm, conv window, state)."""
    import torch.nn.functional as F
    from transformers.activations import ACT2FN
    b, L, _ = x.shape
    K, Cd = layer.conv_kernel_size, layer.conv_dim
    zxbcdt = layer.in_proj(x)
    _, xBC, dt = zxbcdt.split([layer.intermediate_size, Cd, layer.num_heads], dim=-1)
    w = layer.conv1d.weight.squeeze(1)
    A = -torch.exp(layer.A_log)
    window = torch.zeros(b, K - 1, Cd, dtype=x.dtype)
    h = torch.zeros(b, layer.num_heads, layer.head_dim, layer.ssm_state_size, dtype=x.dtype)
    ys = []
    for t in range(L):
        if t in docs:
            window, h = torch.zeros_like(window), torch.zeros_like(h)
        full = torch.cat([window, xBC[:, t:t + 1]], dim=1)  # (b, K, Cd)
        conv = ACT2FN[layer.activation]((full * w.T).sum(1) + layer.conv1d.bias)
        window = full[:, 1:]
        gn = layer.n_groups * layer.ssm_state_size
        xt, Bt, Ct = conv.split([layer.intermediate_size, gn, gn], dim=-1)
        rep = layer.num_heads // layer.n_groups
        Bt = Bt.reshape(b, layer.n_groups, -1).repeat_interleave(rep, 1)
        Ct = Ct.reshape(b, layer.n_groups, -1).repeat_interleave(rep, 1)
        xt = xt.reshape(b, layer.num_heads, layer.head_dim)
        d = F.softplus(dt[:, t] + layer.dt_bias).clamp(*layer.time_step_limit)  # (b, h)
        h = torch.exp(d * A)[..., None, None] * h + (d[..., None] * xt)[..., None] * Bt[:, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ct) + layer.D[:, None] * xt)
    return torch.stack(ys, 1), window, h


@pytest.mark.parametrize("docs", [(), (0, 1, 13, 14, 16, 21, 36)])
def test_states_match_recurrence(docs):
    """The returned states are the true ones: conv window and SSM state after each chunk, float64."""
    layer = tiny_mixer("nemotron_h").double()
    x = torch.randn(2, SEQ, layer.hidden_size, dtype=torch.float64)
    state = zero_state(layer, 2, x.dtype, x.device)
    with torch.no_grad():
        for a, b in zip(CUTS, CUTS[1:]):
            resets = torch.tensor([d - a for d in docs if a <= d < b], dtype=torch.long)
            _, state = run_chunk(layer, x[:, a:b], state, resets)
            _, window, h = _recurrence64(layer, x[:, :b], docs)
            assert_close(state[0], window, rel=1e-12, name=f"conv window after {b}")
            assert_close(state[1], h, rel=1e-6, name=f"ssm state after {b}")  # fp32 scan inside


def test_dropping_the_state_fails():
    """The chain is not vacuous: restarting each chunk from zero is caught by the same check."""
    layer = tiny_mixer("nemotron_h")
    x = torch.randn(1, SEQ, layer.hidden_size)
    with torch.no_grad():
        ref = layer(x)
        outs = [run_chunk(layer, x[:, a:b], zero_state(layer, 1, x.dtype, x.device))[0]
                for a, b in zip(CUTS, CUTS[1:])]
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(torch.cat(outs, 1), ref, name="stateless chain")


def test_bad_resets_are_refused():
    with pytest.raises(ValueError, match=r"reset offsets must lie in \[0, 5\)"):
        segment_ids(torch.tensor([0, 5]), 1, 5, "cpu")
    with pytest.raises(ValueError, match="resets as a mask must be"):
        segment_ids(torch.zeros(3, 5, dtype=torch.bool), 2, 5, "cpu")
    assert segment_ids(torch.tensor([], dtype=torch.long), 1, 5, "cpu") is None
    assert segment_ids(torch.tensor([0, 3]), 1, 5, "cpu").tolist() == [[1, 1, 1, 2, 2]]


def test_family_records():
    """Each hybrid Mamba-2 family names its attention (hooked like any family) and mixers this adapter runs;
    a family string cannot patch them (their state chain needs the model instance)."""
    from easy_context import apply_seq_parallel_monkey_patch, hf
    from easy_context.families import FAMILIES, family_of_model_type
    for name in ("nemotron_h", "bamba", "granitemoehybrid", "falcon_h1"):
        fam = FAMILIES[name]
        assert fam.recurrent and set(fam.recurrent) <= set(MAMBA2_CLASSES), fam
        assert family_of_model_type(name) == name
        hf.check_transformers_compat(name)
        with pytest.raises(ValueError, match="pass the model instance"):
            apply_seq_parallel_monkey_patch("ulysses_attn", name)
        apply_seq_parallel_monkey_patch("data_parallel", name)


def test_bfloat16_follows_the_layer():
    """bf16 weights and input: the same dtype steps as the layer (fp32 scan, conv rounded once), within 1e-3."""
    layer = tiny_mixer("nemotron_h").to(torch.bfloat16)
    x = torch.randn(2, SEQ, layer.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        ref, ref_docs = layer(x), _per_document(layer, x, DOCS)
        assert_close(_chained(layer, x, CUTS), ref, rel=1e-3, name="bf16 chained")
        assert_close(_chained(layer, x, CUTS, DOCS), ref_docs, rel=1e-3, name="bf16 chained with resets")


# ------------------------------------------------------------------------------------------- multi-rank (gloo)
# Whole tiny models under sequence parallelism equal one process (tests/model_equiv.py: unsharded logits, loss and
# every gradient summed over the sp group, float32 within 1e-5; packed rows against one call per document).
# The Mamba-2 mixers run all pieces at once (recurrent/mamba2_parallel.py: conv tails and affine state summaries
# exchanged); one case per world size runs them through the serial chain instead (recurrent/chain.py).
# nemotron_h: mamba, attention, mamba (the attention output crosses a second chain); grouped B/C (2 groups of 4
# heads); 40 tokens: zigzag chunks of 10 / 5 tokens, never a multiple of the SSD chunk (8).
NEMOTRON = dict(layers_block_type=["mamba", "attention", "mamba"], mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                ssm_state_size=16)
# documents: one token long, starting exactly on the W=2 / W=4 shard edges (10, 20, 30) and zigzag chunk edges
PACKED = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8,
                       0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 0])


def _modes(world_size):
    from easy_context import ParallelLayout
    usp = ParallelLayout.build("usp_attn", ring_degree=2)  # W=2: ring 2 x ulysses 1; W=4: ring 2 x ulysses 2
    return [("zigzag_ring_attn", {}), ("ulysses_attn", {}), ("dist_flash_attn", {}),
            ("usp_attn", dict(layout_kw=usp.layout_kw, groups=usp.attn_groups(), sp_group=usp.sp_group))]


def _sp_body(rank, world_size):
    import os

    from easy_context.recurrent.mamba2_parallel import SERIAL_ENV
    from tests.hybrid_models import drop_recurrent_state
    from easy_context.tools.check.rank import packed_positions
    from tests.model_equiv import check_model_equivalence
    for mode, kw in _modes(world_size):
        if world_size == 4 and mode == "dist_flash_attn":
            continue  # same contiguous chain as ulysses; W=2 covers it
        for pos in (None, PACKED):
            check_model_equivalence(rank, world_size, mode, "nemotron_h", seq_len=40, position_ids=pos,
                                    model_kw=NEMOTRON, **kw)
    if world_size == 2:  # the other Mamba-2 families: one mode each with random packed rows, one plain
        for family, (mode, kw) in zip(("falcon_h1", "bamba", "granitemoehybrid"), _modes(world_size)):
            check_model_equivalence(rank, world_size, mode, family, position_ids=packed_positions(2, 32, 5), **kw)
            check_model_equivalence(rank, world_size, "ulysses_attn", family, labels_mask="random")
    os.environ[SERIAL_ENV] = "1"  # the same adapter through the serial chain
    try:
        check_model_equivalence(rank, world_size, "zigzag_ring_attn", "nemotron_h", seq_len=40, position_ids=PACKED,
                                model_kw=NEMOTRON)
    finally:
        os.environ.pop(SERIAL_ENV)
    # the mutation: what crosses ranks (conv tails, states) replaced by zeros must fail the same check, either path
    for serial in (False, True):
        if serial:
            os.environ[SERIAL_ENV] = "1"
        try:
            with drop_recurrent_state():
                check_model_equivalence(rank, world_size, "zigzag_ring_attn", "nemotron_h", seq_len=40,
                                        model_kw=NEMOTRON)
        except AssertionError as e:
            assert "relative error" in str(e), str(e)
        else:
            raise AssertionError(f"dropping the Mamba-2 state exchange went unnoticed (serial={serial})")
        finally:
            os.environ.pop(SERIAL_ENV, None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mamba2_hybrids_equal_one_process(world_size):
    from tests.harness import run_ranks
    run_ranks(_sp_body, world_size, timeout=900)


def test_data_parallel_resets_documents():
    """One process, data_parallel: packed rows restart the Mamba-2 state (and conv window) at every document, so
    the model equals each document run alone — forward and every gradient. (granitemoehybrid is left out: its
    model builds the softmax mask without position_ids, so HF's own attention spans documents there.)"""
    import copy

    from easy_context import apply_seq_parallel_monkey_patch
    from tests.model_equiv import build_model, make_batch, per_document_reference, reference_step
    for family in ("nemotron_h", "bamba", "falcon_h1"):
        ref = build_model(family)
        dp = copy.deepcopy(ref)
        apply_seq_parallel_monkey_patch("data_parallel", dp)
        ids, _, tgt = make_batch(2, len(PACKED), ref.config.vocab_size, seed=2)
        pos = PACKED.expand(2, -1)
        want = per_document_reference(ref, ids, pos, tgt)
        got = reference_step(dp, ids, pos, tgt)  # one call on the packed rows
        assert_close(got[0], want[0], name=f"{family} logits")
        for name in want[2]:
            assert_close(got[2][name], want[2][name], name=f"{family} grad {name}")
