"""The state-only passes of gated DeltaNet's parallel path (easy_context/recurrent/delta_kernels.py, torch backend):
``summarize`` gives each sequence's (R, P) with S_end = P S_0 + R, ``adjoint`` the gradient of its own outputs
w.r.t. S_0 — both against a sequential float64 recurrence, on varlen rows of multi-chunk sequences (chunk 64) with
grouped value heads. And the parallel path on one process with multi-chunk pieces and document starts inside them
equals the layer (output, input and every parameter gradient, fp32 1e-5). (GPU: tests/test_delta_fla.py.)"""
from __future__ import annotations

import inspect
import sys

import torch

from easy_context.recurrent.delta_kernels import TorchKernels
from tests.tols import assert_close

CU = [0, 150, 151, 300, 364, 430]  # 3 chunks, 1 token, 3 chunks, exactly one chunk, one chunk + 2
H, HK, DK, DV = 4, 2, 16, 8


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    N = CU[-1]
    q, k = torch.randn(N, HK, DK, generator=g), torch.randn(N, HK, DK, generator=g)
    v = torch.randn(N, H, DV, generator=g)
    decay = -(0.05 + 0.45 * torch.rand(N, H, generator=g)) * torch.rand(N, H, generator=g)  # slow: state survives
    beta = torch.rand(N, H, generator=g)
    return [t.to(dtype) for t in (q, k, v, decay, beta)]


def _sequential(q, k, v, g, beta, S0):
    """The rule token by token in float64: outputs (T, H, dv) and final state (H, dk, dv)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    rep = H // q.shape[1]
    q, k = (torch.nn.functional.normalize(t, dim=-1, eps=0).repeat_interleave(rep, 1) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    S, outs = S0, []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        err = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t, :, None] * err)
        outs.append(torch.einsum("hk,hkv->hv", q[t], S))
    return torch.stack(outs), S


def _kern():
    from transformers.models.qwen3_next import modeling_qwen3_next
    return TorchKernels(modeling_qwen3_next)


def test_summarize_equals_the_sequential_recurrence():
    q, k, v, g, beta = _inputs()
    seqs = list(range(len(CU) - 1))
    R, P = _kern().summarize(k, v, g, beta, CU, seqs)
    eye = torch.eye(DK, dtype=torch.float64).expand(H, DK, DK)
    for s in seqs:
        a, b = CU[s], CU[s + 1]
        _, want_R = _sequential(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], torch.zeros(H, DK, DV, dtype=torch.float64))
        # P: the same run on the identity's columns as values-free state (S_end = P S_0 when v = 0)
        _, want_P = _sequential(q[a:b], k[a:b], torch.zeros(b - a, H, DK), g[a:b], beta[a:b], eye.clone())
        assert_close(R[s], want_R, 1e-5, f"R of sequence {s} ({b - a} tokens)")
        assert_close(P[s], want_P, 1e-5, f"P of sequence {s} ({b - a} tokens)")


def test_adjoint_equals_the_gradient_of_the_incoming_state():
    q, k, v, g, beta = _inputs(1)
    do = torch.randn(CU[-1], H, DV, generator=torch.Generator().manual_seed(2))
    seqs = [0, 2, 3, 4]
    got = _kern().adjoint(q, k, v, g, beta, do, CU, seqs)
    for s, d in zip(seqs, got):
        a, b = CU[s], CU[s + 1]
        S0 = torch.randn(H, DK, DV, dtype=torch.float64).requires_grad_()
        o, _ = _sequential(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], S0)
        want, = torch.autograd.grad(o, S0, do[a:b].double())
        assert_close(d, want, 1e-5, f"d S_0 of sequence {s} ({b - a} tokens)")


def test_rule_from_a_state_equals_the_sequential_recurrence():
    q, k, v, g, beta = _inputs(3)
    h0 = torch.randn(len(CU) - 1, H, DK, DV)
    o, final = _kern().rule(q, k, v, g, beta, CU, h0)
    for s in range(len(CU) - 1):
        a, b = CU[s], CU[s + 1]
        want_o, want_f = _sequential(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], h0[s].double())
        assert_close(o[a:b], want_o, 1e-5, f"output of sequence {s}")
        assert_close(final[s], want_f, 1e-5, f"final state of sequence {s}")


def test_multi_chunk_pieces_equal_the_layer(monkeypatch, family="qwen3_next"):
    """(qwen3_5's projections: tests/test_hybrid_parallel.py.) Pieces of 70, 1, 129 and 66 tokens (chunk 64) with document starts on an edge and inside pieces, rows with
    different starts: the parallel path (pre-pass, composition, one kernel pass, adjoint) equals the layer."""
    from easy_context.recurrent.adapter import get_adapter
    from easy_context.recurrent.detect import recurrent_layers
    from easy_context.recurrent.pieces import Piece, Plan
    from tests.hybrid_models import build_hybrid
    layer = recurrent_layers(build_hybrid(family))[0][1]
    adapter = get_adapter(layer)
    # the reference is the layer's own forward on CPU tensors: where fla is installed, transformers' hub wrapper
    # would hand them to fla's Triton kernels (CUDA only), so the reference runs the model file's torch rule
    mod = sys.modules[type(layer).__module__]
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", inspect.unwrap(mod.torch_chunk_gated_delta_rule))
    cuts = (0, 70, 71, 200, 266)
    L = cuts[-1]
    pieces = tuple(Piece(0, a, b - a, a) for a, b in zip(cuts, cuts[1:]))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, L, layer.hidden_size, generator=g).requires_grad_()
    params = list(layer.parameters())
    for kind in ("none", "rows"):
        r = None
        if kind == "rows":
            r = torch.zeros(2, L, dtype=torch.bool)
            r[:, 0] = True
            r[0, [71, 140]] = True  # a piece edge, inside the 129-token piece (3 chunks)
            r[1, [30, 230]] = True
        want = adapter.run_chunk(layer, x, adapter.zero_state(layer, 2, x.dtype, x.device), r)[0]
        got = adapter.run_plan(Plan(0, pieces, r), layer, x)
        dy = torch.randn(want.shape, generator=g)
        assert_close(got, want, 1e-5, f"{family} {kind} output")
        names = ["input", *[n for n, _ in layer.named_parameters()]]
        for name, a, b in zip(names, torch.autograd.grad(got, [x, *params], dy),
                              torch.autograd.grad(want, [x, *params], dy)):
            assert_close(a, b, 1e-5, f"{family} {kind} grad {name}")


def test_the_backend_is_chosen_once_and_logged(caplog, monkeypatch):
    from easy_context.recurrent import delta_kernels
    from easy_context.recurrent.detect import recurrent_layers
    from tests.hybrid_models import build_hybrid
    layer = recurrent_layers(build_hybrid("qwen3_next"))[0][1]
    monkeypatch.setattr(delta_kernels, "_CHOSEN", {})
    with caplog.at_level("WARNING", logger=delta_kernels.__name__):
        a = delta_kernels.kernels_for(layer, torch.device("cpu"))
        b = delta_kernels.kernels_for(layer, torch.device("cpu"))
    assert a is b and isinstance(a, TorchKernels)
    lines = [r.getMessage() for r in caplog.records if "gated DeltaNet" in r.getMessage()]
    assert lines == ["gated DeltaNet: torch reference path (install .[fla])"], lines
    # the reference is the model file's own torch function, never transformers' fla dispatch around it
    mod = sys.modules[type(layer).__module__]
    assert a.ref.__module__ == mod.__name__ and a.ref.__name__ == "torch_chunk_gated_delta_rule"


def test_sub_sequences_cut_every_span_from_each_start():
    """delta_fla's cut of a varlen row for the state scans: chunk-aligned from each sequence's start, the last
    sub-sequence takes the rest; span 0 cuts nothing."""
    from easy_context.recurrent.delta_fla import sub_sequences
    sub, first, count = sub_sequences([0, 300, 301, 700], 128)
    assert sub == [0, 128, 256, 300, 301, 429, 557, 685, 700]
    assert first == [0, 3, 4] and count == [3, 1, 4]
    assert sub_sequences([0, 300, 301], 0) == ([0, 300, 301], [0, 1], [1, 1])
