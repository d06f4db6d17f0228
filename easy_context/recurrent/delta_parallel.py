"""Gated DeltaNet (qwen3_next, qwen3_5) under sequence parallelism without the serial chain: every rank runs its
pieces at once, each from its true incoming state.

The rule (transformers' torch_recurrent_gated_delta_rule; state S (d_k x d_v) per value head, queries scaled by
d_k^-1/2 inside the rule):  S_t = (I - b_t k_t k_tᵀ) g_t S_{t-1} + b_t k_t v_tᵀ,  o_t = q_tᵀ S_t.
It is affine in the incoming state: a piece maps S_in to S_out = P S_in + R. Per layer:

1. Conv window: the in_proj of every local token runs once; each piece publishes its last K-1 conv inputs
   (exchange.conv_tail) and every rank composes its pieces' windows; the conv runs once over all local sequences.
2. State-only pre-pass (delta_kernels.summarize, no outputs, no autograd): each piece's (R, P) in float32, P = 0 in
   a row holding a document start (the state after it does not depend on S_in). Published to every rank:
   per row H x d_k x (d_v + d_k) floats, independent of the length.
3. Every rank composes S_{i+1} = P_i S_i + R_i over all pieces in sequence order, then runs ONE normal kernel pass
   over all its pieces (varlen: sequences cut at piece edges and document starts), each piece from its S_in; then
   the layer's own norm (gated by z) and out_proj once on all local tokens.

Backward (exact, no serial order; the design of fla's context parallelism, fla/ops/cp/): the loss depends on a
piece's tokens through its outputs and through S_out, so the kernel pass's own backward gives every gradient once it
is handed d(S_out). That is d(S_in) of the next piece, which is affine too: d(S_in_i) = D_i + P_iᵀ d(S_in_{i+1}),
D_i = the gradient of piece i's own outputs w.r.t. its incoming state (delta_kernels.adjoint, state only). So the
backend's ``parallel_rule`` takes two callbacks from here: ``state_in`` (publish every (R, P), compose the incoming
states) and ``grad_out`` (publish every local D_i, compose the d(S_in) in reverse order, hand each piece's final
state its d(S_out)); the incoming states are constants of the kernel pass. With fla both passes are one autograd
Function sharing the WY tensors (delta_fla.py). Nothing but (R, P), the incoming states and D_i is kept beyond the
layer's own tensors.

Cost per rank: the layer's own kernel pass plus the two state-only passes (forward and backward) and two small
exchanges per layer, forward and backward. The kernels sit behind delta_kernels.kernels_for (fla on CUDA where
installed, else the model file's torch reference, chosen and logged once).
"""
from __future__ import annotations

import sys

import torch

from .exchange import anchor, compose_windows, conv_tail, forward_matches, publish, serial_requested

_KNOWN: dict = {}


def supports(layer) -> bool:
    """Does this class's installed forward compute what ``_project`` / ``_finish`` assume (transformers 5.24's
    Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet)? If not, the serial chain (which calls the forward) runs."""
    cls = type(layer)
    mod = sys.modules.get(cls.__module__)

    def check(src):
        proj = ("self.fix_query_key_value_ordering(" in src) or ("self.in_proj_qkv(" in src and
                                                                    "self.in_proj_z(" in src)
        return proj and all(n in src for n in ("torch_chunk_gated_delta_rule(", "causal_conv1d_fn(", "self.norm(",
                                               "self.out_proj(", "use_qk_l2norm_in_kernel=True")) \
            and all(hasattr(mod, n) for n in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"))
    return forward_matches(cls, _KNOWN, check)


def _project(layer, x):
    """The layer's input projections: conv inputs (B, C, T) channels first, z (B, T, H, d_v), b, a (B, T, H)."""
    B, T, _ = x.shape
    if hasattr(layer, "in_proj_qkvz"):  # qwen3_next: interleaved per key head
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        mixed = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
    else:  # qwen3_5
        mixed = layer.in_proj_qkv(x)
        z = layer.in_proj_z(x).reshape(B, T, -1, layer.head_v_dim)
        b, a = layer.in_proj_b(x), layer.in_proj_a(x)
    return mixed.transpose(1, 2), z, b, a


def _segments(plan, mine, B, S):
    """The rank's local tokens flattened row-major (row r, local t -> r * S + t), cut at piece edges and document
    starts: sequences [(start, end, piece, row, first)] in token order; ``first``: starts at its piece's first
    token, no document start there (it runs from the piece's incoming state and window). Cached on the plan: one
    host copy of the resets per plan, not one per layer."""
    hit = getattr(plan, "_delta_segments", None)
    if hit is not None and hit[0] == (tuple(mine), B, S):
        return hit[1]
    resets = None if plan.resets is None else plan.resets.cpu()
    seqs = []
    for r in range(B):
        for i in mine:
            p = plan.pieces[i]
            cuts = [] if resets is None else (resets[r, p.offset:p.offset + p.length].nonzero().flatten() + p.offset
                                              ).tolist()
            bounds = sorted({p.offset, *cuts, p.offset + p.length})
            for a, b in zip(bounds, bounds[1:]):
                seqs.append((r * S + a, r * S + b, i, r, a == p.offset and a not in cuts))
    plan._delta_segments = ((tuple(mine), B, S), sorted(seqs))
    return plan._delta_segments[1]


def _conv(layer, kern, mixed, windows, seqs, cu):
    """The depthwise causal conv of every sequence after its window (the piece's composed window for a ``first``
    sequence, zeros after a document start); ``mixed`` (N, C) tokens first -> q, k, v. fla: its varlen kernel, each
    sequence's window as its initial state (the gradient of the windows from its dh0). Torch: the model file's conv
    in one call over [w_0, x_0, w_1, x_1, ...], tokens kept by index_select (the backward of conv[:, idx], a sorted
    index_put_, was the path's slowest GPU kernel)."""
    K1 = layer.conv_kernel_size - 1
    weight, bias = layer.conv1d.weight.squeeze(1), layer.conv1d.bias
    win = [(windows[i][r] if first else torch.zeros_like(windows[i][r])).to(mixed.dtype) for _, _, i, r, first in seqs]
    if getattr(kern, "conv1d", None) is not None:
        init = torch.nn.functional.pad(torch.stack(win), (1, 0))  # fla's state: K inputs, the newest last
        conv, _ = kern.conv1d(mixed[None], weight, bias, initial_state=init, activation=layer.activation,
                              cu_seqlens=torch.tensor(cu, device=mixed.device), cu_seqlens_cpu=torch.tensor(cu))
        conv = conv[0]
    else:
        parts, keep, at = [], [], 0
        for (a, b, *_), w in zip(seqs, win):
            parts += [w, mixed[a:b].T]
            keep.append(torch.arange(at + K1, at + K1 + b - a))
            at += K1 + b - a
        conv = sys.modules[type(layer).__module__].causal_conv1d_fn(torch.cat(parts, -1)[None], weight, bias,
                                                                   activation=layer.activation)[0]
        conv = (conv[:, K1:] if len(seqs) == 1 else conv.index_select(1, torch.cat(keep).to(conv.device))).T
    q, k, v = conv.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    return (q.reshape(q.shape[0], -1, layer.head_k_dim), k.reshape(k.shape[0], -1, layer.head_k_dim),
            v.reshape(v.shape[0], -1, layer.head_v_dim))


def _last(seqs):
    """{(piece, row): index of its last sequence}: the one whose final state is the piece's S_out."""
    return {(s[2], s[3]): j for j, s in enumerate(seqs)}


def run_plan(plan, layer, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's output for this rank's tokens (B, S_local, D), exact for the global sequence; None (the caller
    runs the serial chain) when ``serial_requested`` or the installed layer is not the one written for."""
    if serial_requested(layer) or not supports(layer):
        return None
    from .delta_kernels import kernels_for
    pieces, me = plan.pieces, plan.me
    mine = [i for i, p in enumerate(pieces) if p.owner == me]
    Bn, S = x.shape[:2]
    K = layer.conv_kernel_size
    mixed, z, b, a = _project(layer, x)  # once for all local tokens: one call per submodule

    def resets(i):
        p = pieces[i]
        return None if plan.resets is None else plan.resets[:, p.offset:p.offset + p.length]

    tails = publish(plan, (torch.empty(Bn, mixed.shape[1], K - 1, dtype=mixed.dtype, device=x.device),
                           torch.empty(Bn, dtype=torch.float32, device=x.device)),
                    {i: conv_tail(mixed.narrow(2, pieces[i].offset, pieces[i].length), resets(i), K - 1)
                     for i in mine})
    windows = compose_windows(plan, tails, K - 1)
    seqs = _segments(plan, mine, Bn, S)
    cu = [s[0] for s in seqs] + [Bn * S]
    kern = kernels_for(layer, x.device)
    q, k, v = _conv(layer, kern, mixed.transpose(1, 2).reshape(Bn * S, mixed.shape[1]), windows, seqs, cu)
    beta = b.sigmoid().reshape(Bn * S, -1)
    g = (-layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias)).reshape(Bn * S, -1)
    q, k, v, g, beta = kern.prepare(q, k, v, g, beta)
    H, dk, dv = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    like = (torch.zeros(Bn, H, dk, dv, dtype=torch.float32, device=x.device),
            torch.zeros(Bn, H, dk, dk, dtype=torch.float32, device=x.device))
    last = _last(seqs)
    order = sorted(last.items())
    summary = {}

    def state_in(R, P):  # 2.-3. every piece's (R, P) published; the state entering each sequence (no grad)
        local = {i: tuple(t.clone() for t in like) for i in mine}
        for ((i, r), _), Rj, Pj in zip(order, R, P):
            local[i][0][r] = Rj
            if not (plan.resets is not None and bool(resets(i)[r].any())):
                local[i][1][r] = Pj
        summary.update(publish(plan, like, local))
        state, starts = like[0], []
        for i in range(len(pieces)):  # in sequence order
            starts.append(state)
            state = summary[i][0] + summary[i][1] @ state
        h0 = like[0].new_zeros(len(seqs), H, dk, dv)
        for j, s in enumerate(seqs):
            if s[4]:
                h0[j] = starts[s[2]][s[3]]
        return h0

    firsts = [j for j, s in enumerate(seqs) if s[4]]

    def grad_out(D_firsts):  # backward: d(S_in_i) = D_i + P_iᵀ d(S_in_{i+1}), in reverse order -> d(final states)
        D = {i: like[0].new_zeros(like[0].shape) for i in mine}
        for j, d in zip(firsts, D_firsts):
            D[seqs[j][2]][seqs[j][3]] = d
        D = publish(plan, (like[0],), {i: (D[i],) for i in mine})
        d_out, nxt = {}, torch.zeros_like(like[0])
        for i in range(len(pieces) - 1, -1, -1):
            d_out[i] = nxt
            nxt = D[i][0] + summary[i][1].transpose(-1, -2) @ nxt
        d_finals = like[0].new_zeros(len(seqs), *like[0].shape[1:])
        for (i, r), j in last.items():
            d_finals[j] = d_out[i][r]
        return d_finals

    core = kern.parallel_rule(q, k, v, g, beta, cu, [j for _, j in order], firsts, state_in, grad_out)
    out = layer.norm(core.reshape(-1, dv).to(x.dtype), z.reshape(-1, dv)).reshape(Bn, S, -1)
    return anchor(layer.out_proj(out), plan, tails)


__all__ = ["run_plan", "supports"]
