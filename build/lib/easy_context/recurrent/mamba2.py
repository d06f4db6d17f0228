"""Mamba-2 mixers run on one chunk of the sequence from a given state, with document resets.

The layers: ``NemotronHMamba2Mixer`` (nemotron_h), ``BambaMixer`` (bamba), ``GraniteMoeHybridMambaLayer``
(granitemoehybrid) — one forward, the same code in these three modeling files of transformers 5.24 — and
``FalconH1Mixer`` (falcon_h1), the same math plus µP multipliers on the input projection and an optional
gated norm. ``run_chunk`` is their torch path (no cache) with two additions a sequence-parallel chain needs:

* an initial state: the conv window (the last ``K - 1`` conv inputs before the chunk) and the SSM state;
* document resets: at a reset offset the SSM state is zeroed and the conv does not see earlier tokens,
  exactly what per-document calls of the layer compute.

It reads the layer's own parameters and settings (``chunk_size``, ``time_step_limit``, ``n_groups`` ...) and
calls the layer's own ``norm`` and ``out_proj``, so it equals the model's forward; the dtype steps follow
``mamba2_chunk_scan`` (scan in fp32, dt in the model dtype until the discretisation).

Shapes (legend): b batch, L tokens in the chunk, K conv kernel, Cd conv channels (x, B, C), h heads,
p head_dim, g groups, n d_state, c SSD chunks of ``chunk_size`` (l, s positions inside one).
State: ``(conv (b, K-1, Cd) in the input dtype, ssm (b, h, p, n) float32)``.

Resets enter as segment ids: ``seg[t]`` counts resets at offsets <= t, and the incoming state is segment 0.
A contribution from position j (or from the incoming state) reaches position t only when both have the same
segment id. Masks multiply finite decays (never -inf inside an exp that is subtracted), so gradients stay finite.
The SSD block decomposition follows Dao & Gu, "Transformers are SSMs" (2024), and the minimal reference
``ssd_minimal.py`` in state-spaces/mamba; the per-segment masks are this file's addition.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# HF layer classes whose forward is the Mamba-2 mixer handled here (checked by name: no import of every model).
# Mamba2Mixer (the pure mamba2 model) computes the same, but Mamba2Model takes no position_ids, which the chain
# needs to place each rank's tokens: it stays refused.
MAMBA2_CLASSES = ("NemotronHMamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "FalconH1Mixer")


def zero_state(layer: nn.Module, batch: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The state before a sequence: an empty conv window and a zero SSM state."""
    conv = torch.zeros(batch, layer.conv_kernel_size - 1, layer.conv_dim, dtype=dtype, device=device)
    ssm = torch.zeros(batch, layer.num_heads, layer.head_dim, layer.ssm_state_size, dtype=torch.float32,
                      device=device)
    return conv, ssm


def run_chunk(layer: nn.Module, hidden_states: torch.Tensor, state: tuple, resets=None):
    """``layer``'s output on ``hidden_states`` (b, L, d) starting from ``state``; returns (out, final_state).

    ``resets``: None, a 1-D LongTensor of offsets in [0, L) where a document starts (every row), or a bool
    (b, L) / (1, L) tensor marking document starts per row. Differentiable in the input, the state and
    every parameter of the layer.
    """
    conv_state, ssm_state = state
    b, L, _ = hidden_states.shape
    if L == 0:
        raise ValueError("run_chunk needs at least one token (got a chunk of length 0)")
    dtype = hidden_states.dtype
    seg = segment_ids(resets, b, L, hidden_states.device)

    zxbcdt = _in_proj(layer, hidden_states)
    gate, xBC, dt = zxbcdt.split([layer.intermediate_size, layer.conv_dim, layer.num_heads], dim=-1)
    xBC, conv_final = causal_conv(xBC, conv_state.to(xBC.dtype), layer.conv1d.weight.squeeze(1),
                                  layer.conv1d.bias, layer.activation, seg)
    gn = layer.n_groups * layer.ssm_state_size
    x, B, C = xBC.split([layer.intermediate_size, gn, gn], dim=-1)

    A = -torch.exp(layer.A_log.float())
    dt = F.softplus(dt + layer.dt_bias.to(dt.dtype))
    lo, hi = layer.time_step_limit
    dt = torch.clamp(dt, min=lo, max=hi)
    rep = layer.num_heads // layer.n_groups
    B = B.reshape(b, L, layer.n_groups, -1).float().repeat_interleave(rep, dim=2)
    C = C.reshape(b, L, layer.n_groups, -1).float().repeat_interleave(rep, dim=2)
    y, ssm_final = ssd_scan(x.reshape(b, L, layer.num_heads, layer.head_dim).float(), dt, A, B, C, layer.D,
                            layer.chunk_size, ssm_state.float(), seg)
    y = _gated_norm(layer, y.reshape(b, L, -1), gate)
    return layer.out_proj(y.to(dtype)), (conv_final.contiguous(), ssm_final.contiguous())  # sent as they are


def segment_ids(resets, batch: int, length: int, device) -> torch.Tensor | None:
    """(1 or b, L) long: number of document starts at or before each offset (None: no reset)."""
    if resets is None:
        return None
    resets = torch.as_tensor(resets, device=device)
    if resets.dtype == torch.bool:
        if resets.dim() != 2 or resets.shape[-1] != length or resets.shape[0] not in (1, batch):
            raise ValueError(f"resets as a mask must be (1 or {batch}, {length}); got {tuple(resets.shape)}")
        starts = resets
    else:
        if resets.dim() != 1:
            raise ValueError(f"resets as offsets must be 1-D; got shape {tuple(resets.shape)}")
        if resets.numel() == 0:
            return None
        if int(resets.min()) < 0 or int(resets.max()) >= length:
            raise ValueError(f"reset offsets must lie in [0, {length}); got {resets.tolist()}")
        starts = torch.zeros(1, length, dtype=torch.bool, device=device)
        starts[0, resets.long()] = True
    return starts.long().cumsum(-1)


def _in_proj(layer, h):
    if type(layer).__name__ == "FalconH1Mixer":  # µP: input and per-slice output multipliers
        return layer.in_proj(h * layer.ssm_in_multiplier) * layer.mup_vector
    return layer.in_proj(h)


def _gated_norm(layer, y, gate):
    if type(layer).__name__ == "FalconH1Mixer" and not layer.mamba_rms_norm:
        return y * F.silu(gate)
    return layer.norm(y, gate)


def causal_conv(xBC, conv_state, weight, bias, activation, seg):
    """Depthwise causal conv over (b, L, Cd) with the previous ``K - 1`` inputs in ``conv_state`` (b, K-1, Cd).

    Returns the activated output (b, L, Cd) and the next window (b, K-1, Cd). With resets, a tap whose source
    lies in another document reads zero (per-document calls pad with zeros), and the next window keeps only
    the last document's tokens.
    """
    from transformers.activations import ACT2FN
    b, L, Cd = xBC.shape
    K = weight.shape[-1]
    xp = torch.cat([conv_state, xBC], dim=1)  # (b, K-1+L, Cd)
    # conv1d is cross-correlation: out[t] = sum_k w[:, k] * xp[t + k] (tap k reads K-1-k tokens back)
    out = F.conv1d(xp.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, groups=Cd).transpose(1, 2)
    window = xp[:, L:]
    if seg is not None:
        seg_p = F.pad(seg, (K - 1, 0)).expand(b, -1)  # the incoming window is segment 0
        same = seg_p.unfold(1, K, 1) == seg.expand(b, -1).unsqueeze(-1)  # (b, L, K): tap in this document
        bi, ti = (~same.all(-1)).nonzero(as_tuple=True)  # the K-1 tokens after each start: recomputed
        if bi.numel():
            taps = xp.unfold(1, K, 1)[bi, ti].float()  # (n, Cd, K)
            # fp32 sum rounded once, like conv1d's own accumulation (bf16 equals the per-document call)
            fixed = (taps * weight.float() * same[bi, ti].unsqueeze(1)).sum(-1)
            if bias is not None:
                fixed = fixed + bias.float()
            out = out.index_put((bi, ti), fixed.to(out.dtype))
        window = window * (seg_p[:, L:] == seg_p[:, -1:]).unsqueeze(-1).to(xp.dtype)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(xBC.dtype), window


def _segsum(a, cut=None):
    """(..., T) -> (..., T, T): sum of a[j+1..i] at [i, j] for i >= j, -inf above the diagonal and where
    ``cut`` (bool, broadcastable to the result) is True — exp() of it is then the decay from j to i, 0 across
    a document start.

    Masked cumsum rather than cumsum differences (no cancellation), as in ssd_minimal.py."""
    T = a.shape[-1]
    x = a[..., None].expand(*a.shape, T)
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~below, 0).cumsum(dim=-2)
    off = ~torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device))
    return x.masked_fill(off if cut is None else off | cut, -torch.inf)


def ssd_scan(x, dt, A, B, C, D, chunk_size: int, init, seg):
    """SSD (Mamba-2 scan) with an initial state and segment resets.

    x (b, L, h, p) fp32; dt (b, L, h) after softplus/clamp; A (h,) fp32; B, C (b, L, h, n) fp32;
    D (h,); init (b, h, p, n) fp32; seg (1 or b, L) long or None. Returns y (b, L, h, p) fp32 and the state
    after the last token (b, h, p, n).
    """
    b, L, h, p = x.shape
    pad = (-L) % chunk_size
    y_skip = D[:, None] * x
    xd = x * dt[..., None].float()
    a = A.to(x.dtype) * dt.float()  # log decay per token, (b, L, h)

    def chunks(t):  # pad the token dim to whole chunks: (b, L, ...) -> (b, c, l, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])

    xd, a, B, C = chunks(xd), chunks(a), chunks(B), chunks(C)
    a = a.permute(0, 3, 1, 2)  # (b, h, c, l)
    acum = a.cumsum(-1)

    # Chunk-end states from the chunk's own tokens, and per-token decay from the chunk start.
    decay_end = torch.exp(acum[..., -1:] - acum)  # (b, h, c, l)
    decay_start = torch.exp(acum)  # (b, h, c, l)
    tot = F.pad(acum[..., -1], (1, 0))  # (b, h, c+1): log decay of each chunk, after the incoming state
    cut_ls = cut_cc = None
    if seg is not None:
        # Padded tokens stay in the last document, so the final state passes through them unchanged.
        seg_c = torch.cat([seg, seg[:, -1:].expand(-1, pad)], dim=1).reshape(seg.shape[0], -1, chunk_size)
        seg_edge = F.pad(seg_c[..., -1], (1, 0))  # (bs, c+1): segment of the state entering each chunk, and after
        f = x.dtype
        cut_ls = (seg_c[..., :, None] != seg_c[..., None, :])[:, None]  # (bs, 1, c, l, s)
        cut_cc = (seg_edge[:, :, None] != seg_edge[:, None, :])[:, None]  # (bs, 1, c+1, c+1)
        decay_end = decay_end * (seg_c == seg_c[..., -1:]).to(f)[:, None]
        decay_start = decay_start * (seg_c == seg_edge[:, :-1, None]).to(f)[:, None]
    # Intra-chunk (diagonal blocks): a decayed causal "attention" C_l·B_s over the chunk.
    decay_ls = torch.exp(_segsum(a, cut_ls))  # (b, h, c, l, s)
    decay_cc = torch.exp(_segsum(tot, cut_cc))  # (b, h, c+1 target, c+1 source)

    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay_ls.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, xd)

    B_end = B * decay_end.permute(0, 2, 3, 1)[..., None]
    local = torch.einsum("bclhn,bclhp->bchpn", B_end, xd)  # (b, c, h, p, n)
    states = torch.cat([init[:, None].to(local.dtype), local], dim=1)
    # Inter-chunk recurrence: the state entering every chunk (and after the last one) in one contraction.
    edges = torch.einsum("bhij,bjhpn->bihpn", decay_cc, states)
    start, final = edges[:, :-1], edges[:, -1]

    y_off = torch.einsum("bclhn,bchpn->bclhp", C, start) * decay_start.permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :L]
    return y + y_skip, final


__all__ = ["MAMBA2_CLASSES", "causal_conv", "run_chunk", "segment_ids", "ssd_scan", "zero_state"]
