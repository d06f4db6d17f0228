"""Gated DeltaNet's parallel path on flash-linear-attention's kernels (easy_context/recurrent/delta_kernels.py) against
the torch reference path, on a GPU (skipped without CUDA and fla: `pip install 'easy_context[fla]'`).

Every mode's layout at W = 2 / 4 / 8 is simulated in ONE process: the local tokens are all ranks' shards side by
side (rank order, `global_indices` of the mode, packed documents in its packed cut) and the plan holds every piece
(cut at rank boundaries), so each simulated rank's pieces run their pre-pass, composition, kernel pass and adjoint
as on W ranks, without the messages. Compared in global order: output, input gradient, every parameter gradient.

Bounds. The torch path is float32 throughout (1e-5 against one process, as on the CPU). fla's chunk kernels do
their triangular solve in tf32 on tensor-core GPUs (fla/ops/gated_delta_rule/chunk_fwd.py), so float32 through fla
is not 1e-5 from the reference even on one process; the parallel path must add nothing to that: its error against
the torch path on the same pieces is at most FLA_FACTOR x (fla one process vs torch one process) + 1e-5. bf16:
the same relative bound against the float32 reference, and the composed float32 transition chain must not drift
over 8 pieces (the state entering piece 8 no worse than FLA_FACTOR x the state entering piece 2).

Without a GPU: ``test_fla_prepass_interpreted_on_cpu`` runs fla's CP summary kernels under TRITON_INTERPRET=1."""
from __future__ import annotations

import os

import pytest
import torch

# Triton's float32 dots stay at fla's own default (tf32 on tensor cores): forcing TRITON_F32_DEFAULT=ieee lowers
# them to FMA loops whose compile did not finish one case in 290 s on an H100 (Triton 3.7.1); the bounds below are
# relative to fla's own one-process error, so tf32 is what they measure against.

try:
    import fla  # noqa: F401 (only whether it imports)
    HAVE_FLA = True
except Exception:  # ImportError, or a triton without a driver
    HAVE_FLA = False

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_FLA),
                         reason="needs CUDA and flash-linear-attention (.[fla])")
INTERPRETED = pytest.mark.skipif(not (HAVE_FLA and os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="needs fla and TRITON_INTERPRET=1 (a venv with triton + fla-core, CPU)")

FLA_FACTOR = 3.0
MODES = [("zigzag_ring_attn", {}), ("ulysses_attn", {}), ("dist_flash_attn", {}), ("usp_attn", {"ring_degree": 2})]


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _layer(dtype, seed=0):
    from bench.bench_hybrid import _layer as build
    torch.manual_seed(seed)
    return build("gated_deltanet", "small", torch.device("cuda"), dtype)[0]  # hidden 256, 2 x 4 heads of 64


def simulated_plan(mode, L, W, positions=None, **kw):
    """(idx: global index of every local position (all simulated ranks' shards in rank order), Plan holding every
    piece: maximal runs of consecutive global tokens inside one simulated rank's shard)."""
    from easy_context.api import global_indices
    from easy_context.recurrent.pieces import Piece, Plan
    shards = [global_indices(mode, L, r, W, positions=positions, **kw) for r in range(W)]
    idx = torch.cat(shards)
    rank_of = torch.cat([torch.full((len(s),), r) for r, s in enumerate(shards)])
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(L)
    pieces, g = [], 0
    while g < L:
        start, j = g, int(inv[g])
        while g + 1 < L and int(inv[g + 1]) == int(inv[g]) + 1 and rank_of[inv[g + 1]] == rank_of[inv[g]]:
            g += 1
        pieces.append(Piece(0, j, g - start + 1, start))
        g += 1
    resets = None if positions is None else (positions[:, idx] == 0)
    return idx, Plan(0, tuple(pieces), resets)


def _one(L, positions):
    """One process: the whole sequence as one piece (document starts as resets)."""
    from easy_context.recurrent.pieces import Piece, Plan
    return Plan(0, (Piece(0, 0, L, 0),), None if positions is None else (positions == 0).cuda())


def _run(layer, plan, x_local, kernel, dy_local, monkeypatch):
    """Output and gradients (input, every parameter) of the parallel path with ``kernel`` forced."""
    from easy_context.recurrent import delta_kernels
    from easy_context.recurrent.adapter import get_adapter
    monkeypatch.setenv(delta_kernels.KERNEL_ENV, kernel)
    x = x_local.detach().requires_grad_()
    out = get_adapter(layer).run_plan(plan, layer, x)
    assert out is not None, "the parallel path did not run"
    params = list(layer.parameters())
    grads = torch.autograd.grad(out, [x, *params], dy_local.to(out.dtype))
    return out.detach(), grads


def _packed(L, seed):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, L, (5,), generator=g).tolist()))
    pos = torch.arange(L)
    for c in cuts:  # documents restart at 0 there
        pos[c:] = torch.arange(L - c)
    return pos[None]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("W", [2, 4, 8])
@pytest.mark.parametrize("mode,kw", MODES, ids=[m for m, _ in MODES])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("fused", ["0", "1"], ids=["passes", "fused"])
def test_fla_path_equals_torch_path(mode, kw, W, packed, fused, monkeypatch):
    """fused: fla's pass as one Function (EASY_CONTEXT_DELTA_FUSED=1, delta_fla.py; its 2048-token sub-sequences cut
    the one-process 4096-token row); passes: pre-pass, kernel pass and adjoint each on their own."""
    from easy_context.recurrent.delta_kernels import FUSED_ENV
    monkeypatch.setenv(FUSED_ENV, fused)
    L = 4096  # W = 8 zigzag: pieces of 256 tokens, 4 chunks of 64
    layer = _layer(torch.float32)
    pos = _packed(L, W) if packed else None
    idx, plan = simulated_plan(mode, L, W, positions=pos, **kw)
    one = _one(L, pos)
    g = torch.Generator(device="cuda").manual_seed(W)
    x = torch.randn(1, L, 256, device="cuda", generator=g)
    dy = torch.randn(1, L, 256, device="cuda", generator=g)
    if pos is not None:
        plan.resets = plan.resets.cuda()
    ref_o, ref_g = _run(layer, one, x, "torch", dy, monkeypatch)       # one process, torch path
    base_o, base_g = _run(layer, one, x, "fla", dy, monkeypatch)       # one process, fla
    par = {k: _run(layer, plan, x[:, idx], k, dy[:, idx], monkeypatch) for k in ("torch", "fla")}
    names = ["output", "input grad", *[n for n, _ in layer.named_parameters()]]
    for k, (o, grads) in par.items():
        o, gx = o[:, torch.argsort(idx)], grads[0][:, torch.argsort(idx)]  # back to global order
        for name, a, ref, base in zip(names, [o, gx, *grads[1:]], [ref_o, *ref_g], [base_o, *base_g]):
            err = _rel(a, ref)
            bound = 1e-5 if k == "torch" else FLA_FACTOR * _rel(base, ref) + 1e-5
            assert err <= bound, f"{mode} W={W} {'packed' if packed else 'plain'} {k} path {name}: {err:.2e} > {bound:.2e}"


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_fla_sub_sequence_cut_equals_torch_path(packed, monkeypatch):
    """The fused fla Function (EASY_CONTEXT_DELTA_FUSED=1) cuts every sequence into sub-sequences of
    EASY_CONTEXT_DELTA_SPAN tokens for its state scans (delta_fla.py): at 128 (pieces of 1024 -> 8 deep,
    document pieces of any length) the same bound as above."""
    from easy_context.recurrent.delta_fla import SPAN_ENV
    from easy_context.recurrent.delta_kernels import FUSED_ENV
    monkeypatch.setenv(FUSED_ENV, "1")
    monkeypatch.setenv(SPAN_ENV, "128")
    L, W = 4096, 2
    layer = _layer(torch.float32)
    pos = _packed(L, 7) if packed else None
    idx, plan = simulated_plan("zigzag_ring_attn", L, W, positions=pos)
    one = _one(L, pos)
    if pos is not None:
        plan.resets = plan.resets.cuda()
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, L, 256, device="cuda", generator=g)
    dy = torch.randn(1, L, 256, device="cuda", generator=g)
    ref_o, ref_g = _run(layer, one, x, "torch", dy, monkeypatch)
    monkeypatch.setenv(SPAN_ENV, "0")  # fla's own error on one process, no cut: the bound's base
    base_o, base_g = _run(layer, one, x, "fla", dy, monkeypatch)
    monkeypatch.setenv(SPAN_ENV, "128")
    one_o, one_g = _run(layer, one, x, "fla", dy, monkeypatch)
    o, grads = _run(layer, plan, x[:, idx], "fla", dy[:, idx], monkeypatch)
    back = torch.argsort(idx)
    names = ["output", "input grad", *[n for n, _ in layer.named_parameters()]]
    for what, (ao, ag) in (("one process", (one_o, one_g)), ("W=2", (o[:, back], (grads[0][:, back], *grads[1:])))):
        for name, a, ref, base in zip(names, [ao, *ag], [ref_o, *ref_g], [base_o, *base_g]):
            err, bound = _rel(a, ref), FLA_FACTOR * _rel(base, ref) + 1e-5
            assert err <= bound, f"span 128 {what} {name}: {err:.2e} > {bound:.2e}"


@pytest.mark.gpu
@GPU
def test_fla_facade_matches_torch_on_varlen_rows():
    """summarize / adjoint / rule of the two backends on the same varlen row (3 sequences, multi-chunk)."""
    import transformers.models.qwen3_next.modeling_qwen3_next as mod

    from easy_context.recurrent.delta_kernels import FlaKernels, TorchKernels
    tk, fk = TorchKernels(mod), FlaKernels()
    assert fk.cp is not None, f"fla's CP summary kernels did not import: {fk.name}"
    g = torch.Generator(device="cuda").manual_seed(0)
    cu, H, Hk, dk, dv = [0, 200, 201, 520], 4, 2, 64, 64
    N = cu[-1]
    q, k = (torch.randn(N, Hk, dk, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(N, H, dv, device="cuda", generator=g)
    decay = -0.3 * torch.rand(N, H, device="cuda", generator=g)
    beta = torch.rand(N, H, device="cuda", generator=g)
    do = torch.randn(N, H, dv, device="cuda", generator=g)
    h0 = torch.randn(3, H, dk, dv, device="cuda", generator=g)
    qkv = fk.prepare(q, k, v, decay, beta)  # fla's passes take q, k normalised (by fla's l2norm)
    (Rt, Pt), (Rf, Pf) = tk.summarize(k, v, decay, beta, cu, [0, 1, 2]), fk.summarize(*qkv[1:], cu, [0, 1, 2])
    Dt, Df = tk.adjoint(q, k, v, decay, beta, do, cu, [0, 2]), fk.adjoint(*qkv, do, cu, [0, 2])
    (ot, ft), (of, ff) = tk.rule(q, k, v, decay, beta, cu, h0), fk.rule(*qkv, cu, h0)
    base = max(_rel(of, ot), _rel(ff, ft), 1e-6)  # the kernel pass itself: the bound of the state-only passes
    for name, a, b in [("R", Rf, Rt), ("P", Pf, Pt), ("D", Df, Dt)]:
        for j, (x, y) in enumerate(zip(a, b)):
            assert _rel(x, y) <= FLA_FACTOR * base + 1e-5, f"{name}[{j}]: {_rel(x, y):.2e} (kernel pass {base:.2e})"


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("fused", ["0", "1"], ids=["passes", "fused"])
def test_bf16_parallel_error_and_no_drift_over_8_pieces(fused, monkeypatch):
    """bf16 layer, zigzag W = 4 at 8192 tokens (7 pieces: the middle rank's two halves are adjacent and merge): the
    parallel path's error against the float32 torch reference is within FLA_FACTOR x fla's own one-process error
    (and < 2e-2); the float32 state chain composed from bf16 summaries does not drift over 8 pieces."""
    from easy_context.recurrent import delta_kernels
    monkeypatch.setenv(delta_kernels.FUSED_ENV, fused)
    L, W = 8192, 4
    ref_layer, layer = _layer(torch.float32), _layer(torch.bfloat16)
    idx, plan = simulated_plan("zigzag_ring_attn", L, W)
    one = _one(L, None)
    assert len(plan.pieces) == 7
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, L, 256, device="cuda", generator=g)
    dy = torch.randn(1, L, 256, device="cuda", generator=g)
    ref_o, ref_g = _run(ref_layer, one, x, "torch", dy, monkeypatch)
    base_o, base_g = _run(layer, one, x.bfloat16(), "fla", dy, monkeypatch)
    o, grads = _run(layer, plan, x[:, idx].bfloat16(), "fla", dy[:, idx], monkeypatch)
    back = torch.argsort(idx)
    for name, a, ref, base in [("output", o[:, back], ref_o, base_o), ("input grad", grads[0][:, back], ref_g[0],
                                                                         base_g[0])]:
        err, b = _rel(a, ref), _rel(base, ref)
        assert err <= min(2e-2, FLA_FACTOR * b + 1e-4), f"bf16 {name}: {err:.2e} (fla one process {b:.2e})"
    # the chain itself: states entering the 8 pieces from bf16-input summaries vs float32-input torch summaries
    N, H, Hk, dk, dv = L, 4, 2, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(2)
    k = torch.randn(N, Hk, dk, device="cuda", generator=gen)
    v = torch.randn(N, H, dv, device="cuda", generator=gen)
    # slow decay, small writes: P of a 1024-token piece stays far from 0, so the state carries across the 8 pieces
    decay = -0.001 * torch.rand(N, H, device="cuda", generator=gen)
    beta = 0.05 * torch.rand(N, H, device="cuda", generator=gen)
    cu = list(range(0, N + 1, N // 8))
    import transformers.models.qwen3_next.modeling_qwen3_next as mod
    tk, fk = delta_kernels.TorchKernels(mod), delta_kernels.FlaKernels()
    chains = []
    for kern, cast in ((tk, torch.float32), (fk, torch.bfloat16)):
        _, kk, vv, gg, bb = kern.prepare(k.to(cast), k.to(cast), v.to(cast), decay, beta.to(cast))
        R, P = kern.summarize(kk, vv, gg, bb, cu, list(range(8)))
        s, states = torch.zeros_like(R[0]), []
        for r, p in zip(R, P):
            s = r + p @ s
            states.append(s)
        chains.append(states)
    carry = min(float(torch.linalg.matrix_norm(p, ord=2).min()) for p in P)  # P of the bf16 run's pieces
    assert carry > 0.05, f"the test's pieces forget their incoming state (|P| {carry:.2e}): no chain to drift"
    errs = [_rel(b, a) for a, b in zip(*chains)]
    assert max(errs) < 2e-2 and errs[-1] <= FLA_FACTOR * max(errs[:2]) + 1e-3, f"state chain drift: {errs}"


@INTERPRETED
def test_fla_prepass_interpreted_on_cpu(monkeypatch):
    """fla's CP summary kernels (the pre-pass and the adjoint of FlaKernels) under Triton's CPU interpreter equal the
    torch pre-pass: (R, P) and D of multi-chunk varlen sequences. fla's chunk kernel pass itself does not run in the
    interpreter (fla 0.6 / triton 3.9: "'int' object has no attribute 'to'" in chunk_gated_delta_rule_fwd_h), and
    its CP kernels refuse a non-CUDA device (patched out here). Run:
        TRITON_INTERPRET=1 python -m pytest tests/test_delta_fla.py -k interpreted    # venv with triton + fla-core
    """
    import fla.ops.cp.chunk_bwd as cb
    import fla.ops.cp.chunk_fwd as cf
    import transformers.models.qwen3_next.modeling_qwen3_next as mod
    import triton.runtime.autotuner as at

    from easy_context.recurrent.delta_kernels import FlaKernels, TorchKernels
    monkeypatch.setattr(at.Autotuner, "_bench", lambda self, *a, config, **kw: [0.0, 0.0, 0.0])  # no GPU to time
    monkeypatch.setattr(cf, "_check_cp_device", lambda device: None)
    monkeypatch.setattr(cb, "_check_cp_device", lambda device: None)
    g = torch.Generator().manual_seed(0)
    cu, H, Hk, dk, dv = [0, 70, 71, 200], 2, 1, 16, 16
    N = cu[-1]
    q, k = torch.randn(N, Hk, dk, generator=g), torch.randn(N, Hk, dk, generator=g)
    v, do = torch.randn(N, H, dv, generator=g), torch.randn(N, H, dv, generator=g)
    decay, beta = -0.2 * torch.rand(N, H, generator=g), torch.rand(N, H, generator=g)
    tk, fk = TorchKernels(mod), FlaKernels()
    qkv = fk.prepare(q, k, v, decay, beta)
    (Rt, Pt), (Rf, Pf) = tk.summarize(k, v, decay, beta, cu, [0, 2]), fk.summarize(*qkv[1:], cu, [0, 2])
    Dt, Df = tk.adjoint(q, k, v, decay, beta, do, cu, [0, 2]), fk.adjoint(*qkv, do, cu, [0, 2])
    for name, a, b in [("R", Rf, Rt), ("P", Pf, Pt), ("D", Df, Dt)]:
        for j, (x, y) in enumerate(zip(a, b)):
            assert _rel(x, y) <= 1e-5, f"{name}[{j}]: {_rel(x, y):.2e}"
