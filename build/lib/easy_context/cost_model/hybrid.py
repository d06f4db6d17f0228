"""Hybrid models in the cost model (issue #49): the recurrent layer kinds a config's layer list names (gated
DeltaNet: qwen3_next, qwen3_5; the short convolution: lfm2; Mamba-2: nemotron_h), their parameters, FLOPs, the
state each exchanges between ranks, and one layer's backward working set.

Per token, forward, one layer (C = the chunk length; the projections are priced as matmuls by step_time.py):

* gated DeltaNet, heads H (value heads; q/k repeated to them), d_k, d_v, chunk C = 64 (fla and the model file):
  the chunked delta rule = H x [6 d_k d_v (w S, q S and the state update k^T v_new, per token) + 2 C (3 d_k + 2 d_v)
  (k_beta k^T, w = T k_beta, q k^T inside the chunk; u = T v_beta, attn v_new) + 2/3 C^2 (the triangular solve)],
  plus the depthwise conv 2 K x conv channels. Linear in L: at 128K a layer costs what it costs at 4K per token.
* short convolution (lfm2): the depthwise conv 2 K x channels.
* Mamba-2 (SSD), heads H, head dim P, state N, chunk Q: H x [2 Q (N + P) (C B^T and its product with x inside the
  chunk) + 4 N P (the chunk states B^T x, the output C S)] + the conv.
Backward = 2 x forward; recompute (checkpointing) = 1 x forward.

State exchange (the parallel paths, recurrent/exchange.py): every rank publishes each of its pieces' summaries to
every other rank, forward and backward (gradients of the same size), and again in a checkpointed layer's recompute:
* gated DeltaNet: (R, P) = H x d_k x (d_v + d_k) fp32 (zero-state final state and transition) + the conv tail
  (K - 1) x conv channels in the layer's dtype (bf16) + 4 B, per row and piece; two messages (tails, then states);
* short conv: the conv tail (K - 1) x channels bf16 + 4 B; Mamba-2: the conv tail + H x P x N + H fp32.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("gated_deltanet", "short_conv", "mamba2")
# a config's layer_types entry (or nemotron_h's block type) -> the kind priced here; "attention" = softmax
LAYER_TYPE_KIND = {"linear_attention": "gated_deltanet", "conv": "short_conv", "mamba": "mamba2", "M": "mamba2",
                   "full_attention": "attention", "attention": "attention", "*": "attention", "-": "mlp", "mlp": "mlp",
                   "E": "moe", "moe": "moe", "sliding_attention": "attention"}

_RECURRENT = re.compile(r"(linear|mamba|conv|recurrent|ssm|delta|rwkv|retention|lstm)", re.I)  # as recurrent/detect.py


@dataclass(frozen=True)
class RecurrentKind:
    kind: str                # one of KINDS
    count: int               # layers of this kind
    heads: int = 0           # gated DeltaNet: value heads; Mamba-2: SSM heads
    k_heads: int = 0         # gated DeltaNet: query/key heads; Mamba-2: B/C groups
    d_k: int = 0             # gated DeltaNet: key head dim; Mamba-2: state size N
    d_v: int = 0             # gated DeltaNet: value head dim; Mamba-2: head dim P
    conv_kernel: int = 4
    conv_channels: int = 0   # the depthwise conv's channels
    chunk: int = 64          # the chunked rule's / SSD's chunk length
    bias: bool = False       # projections / conv carry biases (lfm2 conv_bias, nemotron_h use_bias)

    @property
    def value_width(self) -> int:  # the width that reaches out_proj
        return self.heads * self.d_v if self.kind != "short_conv" else self.conv_channels

    def proj_params(self, hidden: int) -> int:
        """The weights every token multiplies (in_proj(s) + out_proj): priced as matmuls."""
        h, v = hidden, self.value_width
        if self.kind == "gated_deltanet":  # in_proj_qkv(z) + in_proj_b / a (or _ba) + out_proj
            return h * (self.conv_channels + v + 2 * self.heads) + v * h
        if self.kind == "short_conv":  # in_proj (B, C, x) + out_proj
            return h * 3 * v + v * h + (4 * v if self.bias else 0)
        return h * (2 * v + 2 * self.k_heads * self.d_k + self.heads) + v * h  # mamba2: in_proj (z, xBC, dt) + out

    def params(self, hidden: int) -> int:
        conv = self.conv_channels * (self.conv_kernel + (1 if self.bias else 0))
        own = {"gated_deltanet": 2 * self.heads + self.d_v,           # A_log, dt_bias, the gated norm (per head dim)
               "short_conv": 0,
               "mamba2": 3 * self.heads + self.value_width}[self.kind]  # A_log, dt_bias, D, the gated norm
        return self.proj_params(hidden) + conv + own

    def state_flops(self) -> float:
        """Forward FLOPs per token outside the projections (the chunked rule / SSD and the conv)."""
        H, dk, dv, C = self.heads, self.d_k, self.d_v, self.chunk
        conv = 2.0 * self.conv_kernel * self.conv_channels
        if self.kind == "gated_deltanet":
            return H * (6.0 * dk * dv + 2.0 * C * (3 * dk + 2 * dv) + 2.0 / 3.0 * C * C) + conv
        if self.kind == "mamba2":
            return H * (2.0 * C * (dk + dv) + 4.0 * dk * dv) + conv
        return conv

    def piece_bytes(self) -> tuple[int, ...]:
        """Bytes per row of one piece's summary, per message of one exchange (forward; backward sends as much)."""
        tail = 2 * (self.conv_kernel - 1) * self.conv_channels + 4  # bf16 window + the fp32 "passes" flag
        if self.kind == "gated_deltanet":
            return tail, 4 * self.heads * self.d_k * (self.d_v + self.d_k)
        if self.kind == "mamba2":
            return tail, 4 * self.heads * (self.d_v * self.d_k + 1)
        return (tail,)

    def working_set_per_token(self, hidden: int) -> float:
        """Bytes per token of one layer's backward (bf16 activations, fp32 where the kernels keep it): the layer
        input and its gradient, the projections' outputs and gradients, the conv output and gradient, the kernel's
        tensors (gated DeltaNet as fla 0.6's chunk_gated_delta_rule keeps them: q, k, v, w, u, v_new and their
        gradients, the chunk's C x C matrix in fp32, the per-chunk states and their gradients; Mamba-2 as the torch
        SSD scan: x, B, C per head, y in fp32, the chunk states) and the output / gated norm with gradients."""
        d, H, dk, dv, C = hidden, self.heads, self.d_k, self.d_v, self.chunk
        io = 4.0 * d
        if self.kind == "short_conv":
            return io + 4.0 * 3 * self.conv_channels + 8.0 * self.conv_channels
        proj_out = self.conv_channels + self.value_width + 2 * H
        base = io + 4.0 * proj_out + 4.0 * self.conv_channels + 8.0 * self.value_width
        if self.kind == "gated_deltanet":
            return base + 2.0 * 2 * H * (3 * dk + 3 * dv) + 4.0 * H * C + 4.0 * H * dk * dv / C
        return base + 4.0 * H * (2 * dk + 2 * dv) + 8.0 * H * dk * dv / C


def kinds_from_config(d: dict) -> tuple[tuple[str, ...], tuple[RecurrentKind, ...]]:
    """(each layer's kind: "attention" / "mlp" / "moe" / a recurrent kind, the recurrent kinds with their counts)
    from a config dict; ((), ()) for a model without recurrent layers. Raises ValueError for a layer type named
    recurrent that is not priced here."""
    g = d.get
    mt = g("model_type") or ""
    types = g("layer_types")
    if mt == "nemotron_h" or (not types and g("hybrid_override_pattern")):
        types = g("layers_block_type") or list(g("hybrid_override_pattern") or "")
    if not types:
        return (), ()
    unknown = sorted({t for t in types if t not in LAYER_TYPE_KIND and _RECURRENT.search(str(t))})
    if unknown:
        raise ValueError(f"recurrent layer types {unknown} are not priced (known: {sorted(LAYER_TYPE_KIND)})")
    names = dict(LAYER_TYPE_KIND, linear_attention="mamba2") if mt == "nemotron_h" else LAYER_TYPE_KIND
    names = {t: names.get(t, "attention") for t in types}  # other types (chunked / local attention): softmax
    per_layer = tuple(names[t] for t in types)  # nemotron_h calls its Mamba-2 blocks linear_attention
    rec = []
    for kind in KINDS:
        n = per_layer.count(kind)
        if n:
            rec.append(_kind(kind, n, d))
    return per_layer, tuple(rec)


def _kind(kind: str, n: int, d: dict) -> RecurrentKind:
    g = d.get
    if kind == "gated_deltanet":
        hk, hv = int(g("linear_num_key_heads")), int(g("linear_num_value_heads"))
        dk, dv = int(g("linear_key_head_dim")), int(g("linear_value_head_dim"))
        return RecurrentKind(kind, n, heads=hv, k_heads=hk, d_k=dk, d_v=dv, conv_kernel=int(g("linear_conv_kernel_dim")),
                             conv_channels=2 * hk * dk + hv * dv, chunk=64)
    if kind == "short_conv":
        return RecurrentKind(kind, n, conv_kernel=int(g("conv_L_cache")), conv_channels=int(g("hidden_size")),
                             bias=bool(g("conv_bias", False)), chunk=1)
    heads = int(g("mamba_num_heads") or g("mamba_n_heads"))
    p = int(g("mamba_head_dim") or g("mamba_d_head"))
    groups, N = int(g("n_groups") or g("mamba_n_groups") or 1), int(g("ssm_state_size") or g("mamba_d_state"))
    return RecurrentKind(kind, n, heads=heads, k_heads=groups, d_k=N, d_v=p,
                         conv_kernel=int(g("conv_kernel") or g("mamba_d_conv") or 4),
                         conv_channels=heads * p + 2 * groups * N, chunk=int(g("chunk_size") or g("mamba_chunk_size")),
                         bias=bool(g("use_conv_bias", True)))


def describe(recurrent: tuple[RecurrentKind, ...], n_attn: int, hidden: int) -> str:
    """One line per recurrent kind for plan's header: count, state math, what a piece exchanges, working set."""
    names = {"gated_deltanet": "gated DeltaNet", "short_conv": "short conv", "mamba2": "Mamba-2"}
    lines = [f"hybrid: {' + '.join(f'{r.count} {names[r.kind]}' for r in recurrent)} + {n_attn} softmax attention "
             "layers (priced per kind: cost_model/hybrid.py)"]
    for r in recurrent:
        msg = " + ".join(f"{b / 2**10:.1f} KiB" for b in r.piece_bytes())
        lines.append(f"  {names[r.kind]}: state math {r.state_flops() / 1e6:.2f} MFLOP/token fwd per layer (no L term); "
                     f"exchange per piece and row {msg} (tail{', (R, P)' if r.kind == 'gated_deltanet' else ''}"
                     f"{', (state, decay)' if r.kind == 'mamba2' else ''}); backward working set "
                     f"{r.working_set_per_token(hidden) / 1e3:.0f} KB/token")
    return "\n".join(lines)


__all__ = ["KINDS", "LAYER_TYPE_KIND", "RecurrentKind", "describe", "kinds_from_config"]
