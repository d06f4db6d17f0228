"""The gated DeltaNet parallel path before the state-only pre-pass (2026-12-04 .. 12-06), kept for comparison in
bench/bench_hybrid.py only (the library runs easy_context/recurrent/delta_parallel.py).

Each piece ran the layer's chunk rule ONCE from a zero state on values [v | 0] (d_v + d_k columns) with initial
state [0 | I]: the first d_v columns give the zero-state output o0 and final state R, the identity columns give
e_t = q_tᵀ M_t and the transition P; every rank composed S_{i+1} = P_i S_i + R_i and output o0 + e S_i. Plain
autograd through it all. Measured on the H200 (docs/hybrid.md): 1.23-1.29x the layer's own per-rank time, 1.47x
its memory (the widened rule and the float32 e tensor kept for backward)."""
from __future__ import annotations

import sys

import torch

from easy_context.recurrent.delta_parallel import _project
from easy_context.recurrent.exchange import anchor, compose_windows, conv_tail, publish


def _rule(layer, mixed, window, b, a, augmented: bool):
    """Conv (with ``window``, the K-1 inputs before) and the chunk rule on one document-free run, from a zero
    state. Returns o0 (B, T, H, d_v) float32, final R (B, H, d_k, d_v) and, when ``augmented``, e (B, T, H, d_k)
    and P (B, H, d_k, d_k)."""
    mod = sys.modules[type(layer).__module__]
    K = window.shape[-1] + 1
    conv = mod.causal_conv1d_fn(torch.cat([window.to(mixed.dtype), mixed], dim=-1), layer.conv1d.weight.squeeze(1),
                                layer.conv1d.bias, activation=layer.activation)[..., K - 1:]
    Bn, T = mixed.shape[0], mixed.shape[-1]
    q, k, v = conv.transpose(1, 2).split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q, k = (t.reshape(Bn, T, -1, layer.head_k_dim).float() for t in (q, k))
    v = v.reshape(Bn, T, -1, layer.head_v_dim).float()
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias)
    H, dk, dv = v.shape[2], layer.head_k_dim, layer.head_v_dim
    init = None
    if augmented:
        v = torch.cat([v, v.new_zeros(Bn, T, H, dk)], dim=-1)
        eye = torch.eye(dk, dtype=v.dtype, device=v.device).expand(Bn, H, dk, dk)
        init = torch.cat([v.new_zeros(Bn, H, dk, dv), eye], dim=-1)
    out, final = mod.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=init,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    if not augmented:
        return out.float(), final.float(), None, None
    return out[..., :dv].float(), final[..., :dv].float(), out[..., dv:].float(), final[..., dv:].float()


def _piece(layer, mixed, window, b, a, resets):
    """One piece: (o0, e, R, P); e covers the piece's first tokens up to its first document start (zero beyond a
    row's own start); P = 0 in a row holding a start. Rows with different starts run one by one."""
    if resets is not None and bool(resets.any()) and not bool((resets == resets[:1]).all()):
        rows = [_piece(layer, mixed[r:r + 1], window[r:r + 1], b[r:r + 1], a[r:r + 1], resets[r:r + 1])
                for r in range(mixed.shape[0])]
        n = max(r[1].shape[1] for r in rows)  # e up to each row's own first start, zero after it
        pad = torch.nn.functional.pad
        return (torch.cat([r[0] for r in rows]), torch.cat([pad(r[1], (0, 0, 0, 0, 0, n - r[1].shape[1]))
                                                            for r in rows]),
                torch.cat([r[2] for r in rows]), torch.cat([r[3] for r in rows]))
    cuts = [] if resets is None else resets[0].nonzero().flatten().tolist()
    T = mixed.shape[-1]
    first = cuts[0] if cuts else T
    if first > 0:
        o0, R, e, P = _rule(layer, mixed[..., :first], window, b[:, :first], a[:, :first], True)
    else:
        o0, R, e, P = None, None, None, None
    outs = [] if o0 is None else [o0]
    for s, t in zip(cuts, cuts[1:] + [T]):  # after a start: zero window, zero state; independent of S_0
        o, R, _, _ = _rule(layer, mixed[..., s:t], torch.zeros_like(window), b[:, s:t], a[:, s:t], False)
        outs.append(o)
    Bn, H, dk = mixed.shape[0], layer.num_v_heads, layer.head_k_dim
    if e is None:
        e = outs[0].new_zeros(Bn, 0, H, dk)
    if cuts:
        P = outs[0].new_zeros(Bn, H, dk, dk)
    return torch.cat(outs, dim=1), e, R, P


def run_plan(plan, layer, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's output for this rank's tokens (B, S_local, D), exact for the global sequence; None (the caller
    runs the serial chain) when ``serial_requested`` or the installed layer is not the one written for."""
    pieces, me = plan.pieces, plan.me
    mine = [i for i, p in enumerate(pieces) if p.owner == me]
    K = layer.conv_kernel_size
    mixed, z, b, a = _project(layer, x)  # once for all local tokens: one call per submodule

    def local(i, t, dim):
        p = pieces[i]
        return t.narrow(dim, p.offset, p.length)

    def resets(i):
        return None if plan.resets is None else local(i, plan.resets, 1)

    tails = publish(plan, (torch.empty(x.shape[0], mixed.shape[1], K - 1, dtype=mixed.dtype, device=x.device),
                           torch.empty(x.shape[0], dtype=torch.float32, device=x.device)),
                    {i: conv_tail(local(i, mixed, 2), resets(i), K - 1) for i in mine})
    windows = compose_windows(plan, tails, K - 1)
    runs = {i: _piece(layer, local(i, mixed, 2), windows[i], local(i, b, 1), local(i, a, 1), resets(i))
            for i in mine}
    Bn, H, dk, dv = x.shape[0], layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    like = (torch.empty(Bn, H, dk, dv, dtype=torch.float32, device=x.device),
            torch.empty(Bn, H, dk, dk, dtype=torch.float32, device=x.device))
    summary = publish(plan, like, {i: runs[i][2:] for i in mine})
    state, starts = torch.zeros_like(like[0]), []
    for i in range(len(pieces)):  # the state entering every piece, in sequence order
        starts.append(state)
        R, P = summary[i]
        state = R + P @ state
    cores = []
    for i in sorted(mine, key=lambda j: pieces[j].offset):
        o0, e, _, _ = runs[i]
        n = e.shape[1]
        fix = torch.einsum("bthk,bhkv->bthv", e, starts[i])
        cores.append(torch.cat([o0[:, :n] + fix, o0[:, n:]], dim=1).to(x.dtype))
    core = torch.cat(cores, dim=1)
    out = layer.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(Bn, x.shape[1], -1)
    return anchor(layer.out_proj(out), plan, tails, summary)
