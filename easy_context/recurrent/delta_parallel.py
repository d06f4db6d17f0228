"""Gated DeltaNet (qwen3_next, qwen3_5) under sequence parallelism without the serial chain: every rank runs its
pieces at once, then corrects them with the true incoming state.

The rule (transformers' torch_recurrent_gated_delta_rule; state S (d_k x d_v) per value head, queries scaled by
d_k^-1/2 inside the rule):  S_t = (I - b_t k_t k_tᵀ) g_t S_{t-1} + b_t k_t v_tᵀ,  o_t = q_tᵀ S_t.
It is affine in the incoming state S_0, and every column of S evolves on its own. So one call of the layer's own
chunk rule with values [v | 0] (d_v + d_k columns) and initial state [0 | I] gives, per piece,

    o_t = o0_t + e_t S_0        (o0: the run from zero; e_t = q_tᵀ M_t, the identity columns' outputs)
    S_end = R + P S_0           (R: final state from zero; P = M_end, the identity columns' final state)

1. Conv window: the in_proj of every local token runs once; each piece publishes its last K-1 conv inputs
   (exchange.conv_tail) and every rank composes its pieces' windows (the conv then equals the layer's).
2. Each piece runs the rule as above (from its first document start on, state and window start from zero: there
   e = 0 and P = 0) and publishes (R, P): per row H x d_k x (d_v + d_k) floats, independent of the length.
3. Every rank composes S_{i+1} = P_i S_i + R_i over all pieces in sequence order, adds e S_i to o0, then the
   layer's own norm (gated by z) and out_proj run once on all local tokens.

Cost per rank: the chunk rule on d_v + d_k value columns instead of d_v (its inter-chunk scan and value solve
about double; in_proj, conv, norm, out_proj unchanged) plus two small exchanges per layer, forward and backward.
Plain autograd gives the gradients (exchange.publish sends those of others' pieces back to their owners).
The rule is called in float32 (the torch rule computes in float32 anyway; e and o0 are then added before the one
rounding to the layer dtype, as the layer rounds q·S once).
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
    if serial_requested(layer) or not supports(layer):
        return None
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


__all__ = ["run_plan", "supports"]
