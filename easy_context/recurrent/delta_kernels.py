"""The gated delta rule behind ONE facade (delta_parallel.py's only entry to the kernels): flash-linear-attention's
chunk kernels where fla is importable and the tensors are on CUDA, else the model file's torch reference.

Every call takes the rank's tokens flattened into one varlen row, like fla's ``cu_seqlens`` API (legend:
N = tokens, H = value heads, Hk = key heads, dk / dv = key / value head dims, n = sequences):
  q_NHk, k_NHk (N, Hk, dk), v (N, H, dv), g (N, H) log decay, beta (N, H), cu = [0, e_1, ..., N] (python ints).

  prepare(q, k, v, g, beta)             -> the same five as both passes take them (fla: q, k l2-normalised by
                                           fla's autograd l2norm, all contiguous, so the kernel pass and the adjoint
                                           keep the very same tensors: nothing saved twice)
  rule(q, k, v, g, beta, cu, h0)        -> o (N, H, dv), final (n, H, dk, dv)   autograd; the normal kernel pass
  summarize(k, v, g, beta, cu, seqs)    -> (R, P) per sequence in ``seqs``     no grad; the state-only pre-pass
  adjoint(q, k, v, g, beta, do, cu, seqs) -> dh0 per sequence in ``seqs``        no grad; its backward twin
  parallel_rule(q, k, v, g, beta, cu, lasts, firsts, state_in, grad_out) -> o    autograd; the three above around
                                           the caller's exchanges (fla: one Function sharing w, u, delta_fla.py)

The rule, per value head (transformers' torch_recurrent_gated_delta_rule; q, k l2-normalised, q scaled by dk^-1/2):
    S_t = (I - b_t k_t k_tᵀ) g_t S_{t-1} + b_t k_t v_tᵀ,   o_t = q_tᵀ S_t
is affine in the incoming state: S_end = P S_0 + R, o = o_0 + (terms linear in S_0). ``summarize`` gives (R, P)
without computing any output; ``adjoint`` gives d(loss)/d(S_0) of a sequence's own outputs (zero gradient on its
final state) without computing any parameter gradient.

Torch pre-pass (WY / UT form, Yang et al., "Gated Delta Networks", 2024; the chunk form of transformers'
torch_chunk_gated_delta_rule). Per chunk of C tokens with cumulative log decay γ, T = I + strictly-lower(diag(b) K Kᵀ
⊙ e^{γ_i-γ_j}), U = T⁻¹ diag(b) V, W = T⁻¹ diag(b e^γ) K, K_e = diag(e^{γ_C - γ}) K:
    S' = A S + B,   A = e^{γ_C} I - K_eᵀ W,   B = K_eᵀ U          (forward: [R | P] <- A [R | P] + [B | 0])
    o  = (Q_e - M W) S + M U,   Q_e = diag(e^γ) Q,  M = lower(Q Kᵀ ⊙ e^{γ_i-γ_j})
    dS = Aᵀ dS' + (Q_e - M W)ᵀ dO                                   (backward, from dS' = 0 after the last chunk)
fla: the same two summaries from fla's context-parallel kernels (fla/ops/cp/: ``chunk_cp_fwd_h`` writes [h_local | M]
per sequence, ``chunk_cp_bwd_dh`` [dh_local | dM]) on fla's own WY tensors; with ``EASY_CONTEXT_DELTA_FUSED=1`` all
inside one autograd Function (delta_fla.py: D from fla's state-gradient scan with a zero final-state gradient). fla's
CP composes over contiguous / zigzag ranks, we over any pieces (delta_parallel.py). Without the CP kernels (another
fla layout) the torch pre-pass and adjoint run on fla's pieces.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# "torch" / "fla": force one backend (tests, benches); unset: fla on CUDA where importable, else torch
KERNEL_ENV = "EASY_CONTEXT_DELTA_KERNEL"
FUSED_ENV = "EASY_CONTEXT_DELTA_FUSED"  # "0": fla's three passes instead of the one Function (delta_fla.py)
CHUNK = 64  # the chunk of both backends (fla's default; transformers' torch rule uses 64 as well)


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # eps as transformers' / fla's l2norm


def _heads_first(t, heads):
    """(N, h, d) -> (H, N, d) float32, key heads repeated for grouped value heads (as the torch rule does)."""
    t = t.float()
    if t.shape[1] != heads:
        t = t.repeat_interleave(heads // t.shape[1], dim=1)
    return t.transpose(0, 1)


def _chunked(x, n):
    """(H, T, ...) -> (H, n, C, ...) zero-padded: a padded token has k = v = b = g = 0, an identity step."""
    pad = n * CHUNK - x.shape[1]
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], n, CHUNK, *x.shape[2:])


def _wy(k, v, g, beta):
    """Per chunk: W, U (or None), K_e, e^{γ_C}, γ for one sequence; k (H, T, dk) normalised, g / beta (H, T)."""
    n = max(1, -(-k.shape[1] // CHUNK))
    k, g, beta = _chunked(k, n), _chunked(g[..., None], n)[..., 0], _chunked(beta[..., None], n)[..., 0]
    gam = g.cumsum(-1)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device).tril(-1)
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    system = torch.eye(CHUNK, dtype=k.dtype, device=k.device) + (beta[..., None] * k) @ k.transpose(-1, -2) * decay
    rhs = [beta[..., None] * gam.exp()[..., None] * k] + ([] if v is None else [beta[..., None] * _chunked(v, n)])
    sol = torch.linalg.solve_triangular(system, torch.cat(rhs, -1), upper=False, unitriangular=True)
    W, U = sol[..., :k.shape[-1]], (None if v is None else sol[..., k.shape[-1]:])
    end = gam[..., -1:]
    return W, U, k * (end - gam).exp()[..., None], end.exp(), gam, k


def torch_summarize(k, v, g, beta):
    """(R (H, dk, dv), P (H, dk, dk)) of one sequence run from a zero state; k normalised, heads first, fp32."""
    W, U, Ke, e_end, _, _ = _wy(k, v, g, beta)
    A = torch.diag_embed(e_end.expand(*e_end.shape[:-1], k.shape[-1])) - Ke.transpose(-1, -2) @ W  # (H, n, dk, dk)
    B = Ke.transpose(-1, -2) @ U  # (H, n, dk, dv)
    H, dk, dv = k.shape[0], k.shape[-1], v.shape[-1]
    R = k.new_zeros(H, dk, dv)
    P = torch.eye(dk, dtype=k.dtype, device=k.device).expand(H, dk, dk)
    for c in range(A.shape[1]):  # the inter-chunk scan, state only
        R, P = A[:, c] @ R + B[:, c], A[:, c] @ P
    return R, P


def torch_adjoint(q, k, g, beta, do):
    """d(loss)/d(S_0) (H, dk, dv) from one sequence's output gradient ``do`` (H, T, dv); q, k normalised, q scaled."""
    W, _, Ke, e_end, gam, kc = _wy(k, None, g, beta)
    n = W.shape[1]
    qc, doc = _chunked(q, n), _chunked(do.float(), n)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    M = (qc @ kc.transpose(-1, -2)) * (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    G = (qc * gam.exp()[..., None] - M @ W).transpose(-1, -2) @ doc  # (H, n, dk, dv)
    At = e_end[..., None] * torch.eye(k.shape[-1], dtype=k.dtype, device=k.device) - W.transpose(-1, -2) @ Ke
    D = torch.zeros_like(G[:, 0])
    for c in range(n - 1, -1, -1):
        D = At[:, c] @ D + G[:, c]
    return D


def _by_length(seqs, cu):
    groups: dict = {}
    for j, s in enumerate(seqs):
        groups.setdefault(cu[s + 1] - cu[s], []).append(j)
    return groups


class TorchKernels:
    """The model file's torch reference (``torch_chunk_gated_delta_rule``, unwrapped from transformers' fla
    dispatch) for the kernel pass; the torch pre-pass above. Computes in float32 (as the reference does)."""
    name = "torch reference path (install .[fla])"

    def __init__(self, module):
        self.ref = inspect.unwrap(module.torch_chunk_gated_delta_rule)

    normalized = False  # True: q, k come l2-normalised (FlaKernels' fallback pre-pass)
    conv1d = None  # the short conv: the model file's (delta_parallel._conv)

    def prepare(self, q, k, v, g, beta):  # the reference normalises q, k itself
        return q, k, v, g, beta

    def _norm(self, x):
        return x if self.normalized else _l2norm(x)

    def parallel_rule(self, *args):
        return parallel_rule(self, *args)

    def rule(self, q, k, v, g, beta, cu, h0):
        outs, finals = [], []
        for s in range(len(cu) - 1):  # sequence by sequence (equal lengths could batch; CPU / fallback path)
            a, b = cu[s], cu[s + 1]
            o, f = self.ref(q[None, a:b].float(), k[None, a:b].float(), v[None, a:b].float(), g=g[None, a:b],
                            beta=beta[None, a:b], initial_state=None if h0 is None else h0[s:s + 1],
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(o[0])
            finals.append(f[0])
        return torch.cat(outs), torch.stack(finals)

    def _heads(self, seqs, cu, H, *ts):
        for length, js in _by_length(seqs, cu).items():  # equal-length sequences in one batched call
            yield js, [torch.stack([_heads_first(t[cu[seqs[j]]:cu[seqs[j] + 1]], H) for j in js]).flatten(0, 1)
                       if t is not None else None for t in ts]

    @torch.no_grad()
    def summarize(self, k, v, g, beta, cu, seqs):
        H = v.shape[1]
        R, P = [None] * len(seqs), [None] * len(seqs)
        for js, (kk, vv, gg, bb) in self._heads(seqs, cu, H, k, v, g[..., None], beta[..., None]):
            r, p = torch_summarize(self._norm(kk), vv, gg[..., 0], bb[..., 0])
            for i, j in enumerate(js):
                R[j], P[j] = r[i * H:(i + 1) * H], p[i * H:(i + 1) * H]
        return R, P

    @torch.no_grad()
    def adjoint(self, q, k, v, g, beta, do, cu, seqs):
        H, dk = v.shape[1], k.shape[-1]
        D = [None] * len(seqs)
        for js, (qq, kk, gg, bb, dd) in self._heads(seqs, cu, H, q, k, g[..., None], beta[..., None], do):
            d = torch_adjoint(self._norm(qq) * dk ** -0.5, self._norm(kk), gg[..., 0], bb[..., 0], dd)
            for i, j in enumerate(js):
                D[j] = d[i * H:(i + 1) * H]
        return D


class FlaKernels:
    """flash-linear-attention 0.6: ``chunk_gated_delta_rule`` (varlen, initial and final states) for the kernel
    pass; its CP summary kernels for the pre-pass (internal API of fla 0.6; the torch pre-pass if they move)."""

    chunk_size = CHUNK

    def __init__(self):
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        self.version = getattr(fla, "__version__", "?")
        self.name = f"fla {self.version} chunk kernel"
        self.chunk = chunk_gated_delta_rule
        from fla.modules.norm.l2norm import l2norm
        self.l2norm = l2norm
        try:
            from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
            from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
            from fla.ops.cp.chunk_bwd import chunk_cp_bwd_dh
            from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
            from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
            from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
            from fla.ops.utils import chunk_local_cumsum
            from fla.ops.utils.constant import RCP_LN2
            from fla.ops.utils.index import prepare_chunk_indices
            self.cp = dict(dv_local=chunk_bwd_dv_local, fwd_h=chunk_cp_fwd_h, bwd_dh=chunk_cp_bwd_dh,
                           intra=chunk_gated_delta_rule_fwd_intra, cumsum=chunk_local_cumsum,
                           rcp_ln2=RCP_LN2, indices=prepare_chunk_indices, fwd_h_full=chunk_gated_delta_rule_fwd_h,
                           fwd_o=chunk_fwd_o, recompute=recompute_w_u_fwd, bwd_dhu=chunk_gated_delta_rule_bwd_dhu,
                           dqkwg=chunk_bwd_dqkwg, wy_bwd=prepare_wy_repr_bwd)
            self.name += " + fla CP state pre-pass"
        except ImportError:  # another fla layout: the torch pre-pass (fp32) on fla's pieces
            self.cp = None
            self.name += " + torch state pre-pass"
        self.torch = TorchKernels.__new__(TorchKernels)
        self.torch.normalized = True
        try:  # the short conv: fla's varlen kernel, windows as initial states (delta_parallel._conv)
            from fla.modules.causal_conv1d import causal_conv1d
            self.conv1d = causal_conv1d
            self.name += " + fla conv"
        except ImportError:
            self.conv1d = None

    def prepare(self, q, k, v, g, beta):
        return (self.l2norm(q.contiguous()), self.l2norm(k.contiguous()), v.contiguous(), g.contiguous(),
                beta.contiguous())

    def rule(self, q, k, v, g, beta, cu, h0):  # q, k from prepare: normalised
        cu_t = torch.tensor(cu, dtype=torch.long, device=q.device)
        o, final = self.chunk(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=h0,
                              output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_t,
                              cu_seqlens_cpu=torch.tensor(cu, dtype=torch.long))
        return o[0], final

    def geometry(self, cu, device):
        """cu_seqlens on the device and fla's chunk index of the varlen row."""
        cu_t = torch.tensor(cu, dtype=torch.long, device=device)
        return cu_t, self.cp["indices"](cu_t, CHUNK, cu_seqlens_cpu=torch.tensor(cu, dtype=torch.long))

    def wy(self, k4, v4, g4, b4, cu_t, idx):
        """(cumulative log2 decay, w, u, A): fla's gate cumsum and WY solve; tensors (1, N, heads, ...)."""
        c = self.cp
        gc = c["cumsum"](g4.float().contiguous(), chunk_size=CHUNK, scale=c["rcp_ln2"], cu_seqlens=cu_t,
                         chunk_indices=idx)
        w, u, A = c["intra"](k=k4, v=v4.contiguous(), g=gc, beta=b4.contiguous(), cu_seqlens=cu_t, chunk_indices=idx)
        return gc, w, u, A

    def summaries(self, k4, w, u, gc, cu_t):
        """[R | P] (n, H, dk, dv + dk) float32 of every sequence of the row, in one launch."""
        H, dk, dv = u.shape[2], k4.shape[-1], u.shape[-1]
        hm = k4.new_zeros(len(cu_t) - 1, H, dk, dv + dk, dtype=torch.float32)
        self.cp["fwd_h"](k=k4, w=w, u=u, hm=hm, g=gc, cu_seqlens=cu_t, chunk_size=CHUNK, multi_seqs=True)
        return hm

    @torch.no_grad()
    def summarize(self, k, v, g, beta, cu, seqs):
        if self.cp is None:
            return TorchKernels.summarize(self.torch, k, v, g, beta, cu, seqs)
        cu_t, idx = self.geometry(cu, k.device)
        gc, w, u, _ = self.wy(k[None], v[None], g[None], beta[None], cu_t, idx)
        hm, dv = self.summaries(k[None], w, u, gc, cu_t)[torch.tensor(seqs, device=k.device)], v.shape[-1]
        return list(hm[..., :dv]), list(hm[..., dv:])

    @torch.no_grad()
    def adjoint(self, q, k, v, g, beta, do, cu, seqs):
        if self.cp is None:  # torch on fla's pieces
            return TorchKernels.adjoint(self.torch, q, k, v, g, beta, do, cu, seqs)
        cu_t, idx = self.geometry(cu, k.device)
        gc, w, _, _ = self.wy(k[None], v[None], g[None], beta[None], cu_t, idx)
        H, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
        do = do[None].to(q.dtype).contiguous()
        dvl = self.cp["dv_local"](q=q[None], k=k[None], do=do, g=gc, scale=dk ** -0.5, cu_seqlens=cu_t,
                                  chunk_size=CHUNK, chunk_indices=idx)
        out = []
        for s in seqs:
            dhm = k.new_zeros(H, dk, dv + dk, dtype=torch.float32)
            self.cp["bwd_dh"](q=q[None], k=k[None], w=w, do=do, dv=dvl, dhm=dhm, g=gc, scale=dk ** -0.5,
                              cu_seqlens=cu_t[s:s + 2], chunk_size=CHUNK)
            out.append(dhm[..., :dv])
        return out

    def parallel_rule(self, q, k, v, g, beta, cu, lasts, firsts, state_in, grad_out):
        """fla's building blocks in one autograd Function (delta_fla.py: w, u made once for both passes, every
        sequence's state scan in one launch: the faster path, docs/hybrid.md). With
        ``EASY_CONTEXT_DELTA_FUSED=0`` the three passes above, each making its own w, u."""
        if self.cp is None or os.environ.get(FUSED_ENV) == "0":
            return parallel_rule(self, q, k, v, g, beta, cu, lasts, firsts, state_in, grad_out)
        from .delta_fla import FlaPieces
        return FlaPieces.apply(q, k, v, g, beta, (self, cu, lasts, firsts, state_in, grad_out))


class _Adjoint(torch.autograd.Function):
    """``core`` unchanged; backward hands the kernel pass d(final state) of every sequence: grad_out of the
    adjoints D of the sequences ``firsts`` (every rank calls it: it exchanges)."""

    @staticmethod
    def forward(ctx, info, core, finals, *qkvgb):
        ctx.info = info
        ctx.save_for_backward(*qkvgb)
        return core.view_as(core)

    @staticmethod
    def backward(ctx, d_core):
        kern, cu, firsts, grad_out = ctx.info
        q, k, v, g, beta = ctx.saved_tensors
        D = kern.adjoint(q, k, v, g, beta, d_core, cu, firsts) if firsts else []
        return None, d_core, grad_out(D), None, None, None, None, None


def parallel_rule(kern, q, k, v, g, beta, cu, lasts, firsts, state_in, grad_out):
    """Any backend's parallel pass from its three parts: summarize the sequences ``lasts`` (no grad), state_in ->
    incoming states, the kernel pass (autograd), and in backward the adjoints of ``firsts`` -> grad_out -> d(final
    state) of each sequence (delta_parallel.py composes both across pieces)."""
    with torch.no_grad():
        h0 = state_in(*kern.summarize(k, v, g, beta, cu, lasts))
    core, finals = kern.rule(q, k, v, g, beta, cu, h0)
    return _Adjoint.apply((kern, cu, firsts, grad_out), core, finals, *(t.detach() for t in (q, k, v, g, beta)))


_CHOSEN: dict = {}


def kernels_for(layer, device: torch.device):
    """The backend for this layer class's module on ``device``, chosen once per (module, device type) and logged
    once: fla on CUDA where it imports (``EASY_CONTEXT_DELTA_KERNEL=torch|fla`` forces one), else torch."""
    module = sys.modules[type(layer).__module__]
    force = os.environ.get(KERNEL_ENV, "")
    key = (module.__name__, device.type, force)
    if key not in _CHOSEN:
        kern = None
        if force == "fla" or (force != "torch" and device.type == "cuda"):
            try:
                kern = FlaKernels()
            except Exception as e:  # not installed, or its Triton does not start here
                if force == "fla":
                    raise ImportError(f"{KERNEL_ENV}=fla but flash-linear-attention does not import ({e}): "
                                      "pip install 'easy_context[fla]'") from e
                if not isinstance(e, ImportError):
                    log.warning("gated DeltaNet: flash-linear-attention failed to load (%s)", e)
        if kern is None:
            kern = TorchKernels(module)
        _CHOSEN[key] = kern
        log.warning("gated DeltaNet: %s", kern.name)
    return _CHOSEN[key]


__all__ = ["CHUNK", "FUSED_ENV", "FlaKernels", "KERNEL_ENV", "TorchKernels", "kernels_for", "parallel_rule",
           "torch_adjoint", "torch_summarize"]
