"""Fused ops (easy_context.ops): the same numbers as HF's RMSNorm / RoPE, forward and backward.

On CPU the ops run their eager math (torch.compile is CUDA-only), so float32 results must match HF's to
rounding and float64 exactly; the compiled kernels are checked against the eager path on the GPU in
bench/bench_train_step.py (bf16 tolerance).
"""
from __future__ import annotations

import copy
import types

import pytest
import torch

from easy_context.ops import (RMSNormFunction, apply_fused_ops, fuse_rope, fused_rope, remove_fused_ops,
                              rms_norm)
from easy_context.ops import rope as rope_mod
from tests.model_equiv import FAMILIES, build_model
from tests.tols import assert_close


def _hf_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    return getattr(apply_rotary_pos_emb, "_easy_context_original", apply_rotary_pos_emb)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rope_matches_hf_forward_backward(dtype):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, D = 2, 4, 2, 37, 16
    # as in HF: projections (B, L, H*D) viewed and transposed to (B, H, L, D)
    q0 = torch.randn(B, L, H, D, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    k0 = torch.randn(B, L, Hkv, D, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    cos, sin = (torch.randn(B, L, D, generator=g, dtype=dtype) for _ in range(2))
    dq, dk = torch.randn(B, H, L, D, generator=g, dtype=dtype), torch.randn(B, Hkv, L, D, generator=g, dtype=dtype)
    ref = _hf_rope()(q0, k0, cos, sin)
    ref_grads = torch.autograd.grad(ref, (q0, k0), (dq, dk))
    out = fused_rope(q0, k0, cos, sin)
    grads = torch.autograd.grad(out, (q0, k0), (dq, dk))
    for name, a, e in (("q", out[0], ref[0]), ("k", out[1], ref[1]), ("dq", grads[0], ref_grads[0]),
                       ("dk", grads[1], ref_grads[1])):
        assert_close(a, e, rel=1e-12 if dtype == torch.float64 else 1e-6, name=name)
    # output keeps the (B, L, H, D) memory layout of the projections (no copy before the attention kernel)
    assert out[0].transpose(1, 2).is_contiguous() and out[1].transpose(1, 2).is_contiguous()
    # unsqueeze_dim=2: tensors already (B, L, H, D)
    out2 = fused_rope(q0.transpose(1, 2), k0.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    assert_close(out2[0].transpose(1, 2), ref[0], rel=1e-6, name="q (unsqueeze_dim=2)")


@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_rms_norm_matches_hf(chunk_rows, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    if chunk_rows:  # the eager path in row chunks (as for long sequences) gives the same numbers
        orig = rms_norm.row_chunks
        monkeypatch.setattr(rms_norm, "row_chunks", lambda n, d: orig(n, d, chunk_rows * d))
    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    x = torch.randn(2, 13, 24, generator=g).requires_grad_()
    dy = torch.randn(2, 13, 24, generator=g)
    ref = norm(x)
    rdx, rdw = torch.autograd.grad(ref, (x, norm.weight), dy)
    out = RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon)
    dx, dw = torch.autograd.grad(out, (x, norm.weight), dy)
    assert torch.equal(out, ref)  # eager forward: same ops in the same order
    assert_close(dx, rdx, rel=1e-6, name="dx")
    assert_close(dw, rdw, rel=1e-6, name="dw")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused (compiled) kernel runs on CUDA"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plus_one_rms_norm_matches_hf(device, dtype, monkeypatch):
    """The (1 + w) form (Qwen3.5 / Qwen3-Next / Gemma): eager row chunks on CPU, the compiled kernel on CUDA."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
    orig = rms_norm.row_chunks
    monkeypatch.setattr(rms_norm, "row_chunks", lambda n, d: orig(n, d, 5 * d))
    g = torch.Generator().manual_seed(1)
    norm = Qwen3_5RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(256, generator=g))
    norm = norm.to(device, dtype)
    x = torch.randn(2, 13, 256, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(2, 13, 256, generator=g).to(device, dtype)
    ref = norm(x)
    rdx, rdw = torch.autograd.grad(ref, (x, norm.weight), dy)
    out = RMSNormFunction.apply(x, norm.weight, norm.eps, True)
    dx, dw = torch.autograd.grad(out, (x, norm.weight), dy)
    if device == "cpu":
        assert torch.equal(out, ref)  # eager forward: same ops in the same order
    rel = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output / of the input gradient
    assert_close(out, ref, rel=rel, name="y")
    assert_close(dx, rdx, rel=rel, name="dx")
    assert_close(dw, rdw, rel=rel, name="dw")


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_fused_ops_is_exact_and_reversible(family):
    torch.manual_seed(0)
    model = build_model(family)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss, {n: p.grad for n, p in m.named_parameters()}

    ref_loss, ref_grads = step(plain)
    counts = apply_fused_ops(model)
    n_layers = model.config.num_hidden_layers
    assert counts["rope"] == n_layers and counts["norms"] >= 2 * n_layers + 1, counts
    assert set(model.state_dict()) == set(plain.state_dict())  # parameter names unchanged
    loss, grads = step(model)
    assert_close(loss, ref_loss, rel=1e-6, name="loss")
    for n, gr in ref_grads.items():
        assert_close(grads[n], gr, rel=1e-5, name=n)
    # the fused path really ran: the family's module function is our dispatcher, and only opted-in
    # attention modules take it (the untouched copy still computes through HF's function)
    mod = __import__(type(plain.model.layers[0].self_attn).__module__, fromlist=["x"])
    assert hasattr(mod.apply_rotary_pos_emb, "_easy_context_original")
    calls = []
    monkey = rope_mod.RotaryFunction.apply
    rope_mod.RotaryFunction.apply = lambda *a: calls.append(1) or monkey(*a)
    try:
        step(plain)
        assert not calls
        step(model)
        assert len(calls) == 2 * n_layers
    finally:
        rope_mod.RotaryFunction.apply = monkey
    remove_fused_ops(model)
    assert type(model.model.layers[0].self_attn) is type(plain.model.layers[0].self_attn)
    assert type(model.model.norm) is type(plain.model.norm)
    loss2, _ = step(model)
    assert loss2.item() == ref_loss.item()


def test_fused_rope_refuses_a_different_rope(monkeypatch):
    """A family whose apply_rotary_pos_emb is not x*cos + rotate_half(x)*sin is refused, not changed."""
    fake = types.ModuleType("fake_modeling")
    fake.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q * cos.unsqueeze(1), k * cos.unsqueeze(1))
    cls = type("LlamaAttention", (torch.nn.Module,), {"__module__": "fake_modeling"})
    monkeypatch.setitem(__import__("sys").modules, "fake_modeling", fake)
    with pytest.raises(ValueError, match="--no-fused-ops"):
        fuse_rope(cls())
    other = type("GPT2Attention", (torch.nn.Module,), {})
    with pytest.raises(ValueError, match="fused RoPE supports"):
        fuse_rope(other())


def test_compiled_falls_back_to_eager_once_with_a_warning(monkeypatch):
    """A compile failure at the first CUDA call warns once and the eager function is used from then on."""
    from easy_context.ops import jit as compiled_mod
    calls = []

    def broken_compile(fn, **kw):
        def run(*a):
            calls.append("compiled")
            raise RuntimeError("no triton here")
        return run
    monkeypatch.setattr(compiled_mod.torch, "compile", broken_compile)

    class FakeCuda:  # only .is_cuda is looked at before dispatch
        is_cuda = True

    f = compiled_mod.compiled(lambda x, y: y + 1)
    with pytest.warns(UserWarning, match="no triton here"):
        assert f(FakeCuda(), 1) == 2
    assert f(FakeCuda(), 2) == 3 and calls == ["compiled"]  # not retried
    monkeypatch.setenv("EASY_CONTEXT_COMPILE", "0")
    g = compiled_mod.compiled(lambda x, y: y * 2)
    assert g(FakeCuda(), 4) == 8 and calls == ["compiled"]  # disabled: never compiled
