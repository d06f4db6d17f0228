"""Kernel facade: every backend on this machine vs the float64 math reference (out, lse, dq, dk, dv)."""
import math

import pytest
import torch

from easy_context import kernels
from tests.tols import assert_close

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (batch, seq_q, seq_k, heads_q, heads_kv, head_dim, causal)
SHAPES = [
    (1, 128, 128, 4, 4, 64, True),
    (2, 96, 96, 6, 2, 64, True),       # GQA 6/2, batch 2
    (2, 64, 160, 6, 2, 128, False),    # unequal lengths, non-causal
    (1, 3824, 3824, 5, 5, 64, True),   # awkward length, 5 heads
    (1, 200, 120, 4, 1, 128, False),   # MQA
]
DTYPE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float64: 1e-12}


def _inputs(shape, dtype, device, seed=0):
    b, lq, lk, hq, hkv, d, causal = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, lq, hq, d, generator=g, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)], causal


_REFERENCES: dict = {}  # (shape index, dtype): the float64 reference of those rounded inputs, shared by backends


def _reference(q, k, v, dout, causal):
    q, k, v, dout = (t.detach().cpu().double().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout)))
    out, lse = kernels.attention_reference(q, k, v, causal=causal)
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


def _cases():
    for device in DEVICES:
        for backend in kernels.available_backends(device):
            for dtype in kernels._DTYPES[backend]:
                if device == "cpu" and dtype == torch.float16:
                    continue  # slow and unused on CPU
                if backend == "math" and dtype in (torch.float16,):
                    continue
                yield device, backend, dtype


@pytest.mark.parametrize("device,backend,dtype", list(_cases()))
def test_backend_matches_reference(device, backend, dtype):
    for i, shape in enumerate(SHAPES):
        if shape[1] > 1000 and dtype == torch.float64:
            continue  # the long awkward case is covered in fp32/bf16; float64 math is slow there
        (q, k, v, dout), causal = _inputs(shape, dtype, device, seed=i)
        out, lse = kernels.attn_forward(q, k, v, causal=causal, backend=backend)
        dq, dk, dv = kernels.attn_backward(dout, q, k, v, out, lse, causal=causal, backend=backend)
        key = (i, dtype)  # the inputs depend on the shape's seed and the dtype only, not the backend or device
        if key not in _REFERENCES:
            _REFERENCES[key] = _reference(q, k, v, dout, causal)
        r_out, r_lse, r_dq, r_dk, r_dv = _REFERENCES[key]
        tol = DTYPE_TOL[dtype]
        tag = f"{backend}/{dtype}/{device} shape={shape}"
        assert out.shape == q.shape and out.dtype == q.dtype, tag
        assert lse.shape == (shape[0], shape[3], shape[1]), f"{tag}: lse shape {tuple(lse.shape)}"
        assert dk.shape == k.shape and dv.shape == v.shape, tag
        assert_close(out, r_out, tol, f"out {tag}")
        assert_close(lse, r_lse, max(tol, 1e-6) if dtype != torch.float64 else tol, f"lse {tag}")
        for name, a, e in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
            assert_close(a, e, tol * 2, f"{name} {tag}")


def test_merge_equals_attention_over_concatenated_keys():
    torch.manual_seed(0)
    q = torch.randn(2, 33, 4, 32, dtype=torch.float64)
    k = torch.randn(2, 70, 2, 32, dtype=torch.float64)
    v = torch.randn(2, 70, 2, 32, dtype=torch.float64)
    full_out, full_lse = kernels.attn_forward(q, k, v, causal=False, backend="math")
    out = torch.zeros_like(q)
    lse = torch.full((2, 4, 33), -math.inf, dtype=torch.float64)
    for a, b in ((0, 25), (25, 26), (26, 70)):  # uneven blocks, one of a single key
        bo, bl = kernels.attn_forward(q, k[:, a:b], v[:, a:b], causal=False, backend="math")
        kernels.merge_attn_out(out, lse, bo, bl)
    assert_close(out, full_out, 1e-12, "merged out")
    assert_close(lse, full_lse, 1e-12, "merged lse")


def test_merge_is_stable_for_huge_logits():
    # scores ~ 1e4: a naive exp(lse) overflows even in float64; the merge must stay finite and exact.
    torch.manual_seed(1)
    q = torch.randn(1, 8, 2, 16) * 100
    k = torch.randn(1, 40, 2, 16) * 100
    v = torch.randn(1, 40, 2, 16)
    ref_out, ref_lse = kernels.attention_reference(q.double(), k.double(), v.double(), causal=False)
    out = torch.zeros(1, 8, 2, 16)
    lse = torch.full((1, 2, 8), -math.inf)
    for a in range(0, 40, 10):
        bo, bl = kernels.attn_forward(q, k[:, a:a + 10], v[:, a:a + 10], causal=False, backend="math")
        kernels.merge_attn_out(out, lse, bo, bl)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(lse, ref_lse, 1e-6, "lse")
    assert_close(out, ref_out, 1e-4, "out")


@pytest.mark.parametrize("args,match", [
    (((1, 8, 4, 16), (1, 8, 3, 16), (1, 8, 3, 16), True), "multiple of kv heads"),
    (((1, 8, 4, 16), (1, 6, 4, 16), (1, 6, 4, 16), True), "causal=True needs equal"),
    (((1, 8, 4, 16), (1, 8, 4, 32), (1, 8, 4, 32), False), "agree on batch and head_dim"),
    (((8, 4, 16), (8, 4, 16), (8, 4, 16), False), r"\(batch, seq, heads, head_dim\)"),
])
def test_shape_errors(args, match):
    qs, ks, vs, causal = args
    with pytest.raises(ValueError, match=match):
        kernels.attn_forward(torch.randn(qs), torch.randn(ks), torch.randn(vs), causal=causal)


def test_backend_override_and_errors(monkeypatch):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        kernels.attn_forward(q, q, q, backend="nope")
    with pytest.raises(ValueError, match="not available on cpu"):
        kernels.attn_forward(q, q, q, backend="cudnn")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="does not support torch.float64"):
            kernels.choose_backend(q.double().cuda(), "flash")
    monkeypatch.setenv(kernels.ENV_VAR, "math")
    assert kernels.choose_backend(q) == "math"
    monkeypatch.delenv(kernels.ENV_VAR)
    assert kernels.choose_backend(q) == "cpu"
    assert kernels.choose_backend(q.double()) == "math"
