"""Every loss of EasyContext: token NLL sums (full logits, or the LM head chunk by chunk) and the token-weighted
mean over a dp x sp batch, equal to the single-process mean over all valid tokens.

* ``IGNORE_INDEX``        — the target of a token that is not scored (-100, as HF and ``F.cross_entropy``).
* ``token_nll_sum``       — (NLL sum, valid count) from full logits.
* ``chunked_lm_loss``     — (NLL sum, valid count) from hidden states and the LM head weight, one token chunk
  at a time in forward *and* backward (``ChunkedLMLoss``); ``default_chunk_size`` is the one chunk rule.
* ``head_as_loss`` / ``lm_head_loss`` — the chunked loss run *as* the lm_head module's forward (ZeRO-3 / FSDP).
* ``chunked_nll_sum``     — no-grad (NLL sum, count) through any head callable, scored rows only (evaluation).
* ``global_sum``          — the one all-reduce (sum over a group; identity without a process group);
  ``global_count`` / ``global_token_count`` are its names for valid-token counts.
* ``sp_token_mean_loss`` (from logits) and ``causal_lm_loss`` (from the model, chunked head): this rank's share
  of the global token mean.
* ``nll_sum``             — a model call's summed NLL of this rank's tokens (train.py's loss and the Trainer
  integration's; the chunked head runs as the head's forward inside the wrapped model's).

Token-weighted mean. Each rank holds a slice of the tokens (its sp shard of its dp group's samples). The
single-process loss is  sum_all(CE) / n_valid_all.  Each rank computes  local_sum(CE) / n_valid_all  with
n_valid_all all-reduced over ``group`` (default: the world = every dp x sp rank); the per-rank losses then *sum*
to the global mean and so do their gradients. A rank with no valid label contributes 0, never NaN (the original
per-rank mean gave NaN and weighted ranks equally whatever their token counts). DDP / DeepSpeed *average*
gradients over their N data-parallel ranks (all dp x sp ranks of the world): pass ``grads_averaged_over=N`` so
the average of the scaled losses is the exact sum.

Chunked LM head. A plain HF step materialises full-vocabulary logits (and their fp32 upcast and gradient): for
Llama-2 (32K vocab) that is ~128-384 KB per token, more than all checkpointed hidden states together. Here the
head's matmul, the fp32 log-softmax and its gradient run one token chunk at a time; backward recomputes a chunk's
logits from the saved hidden states (one extra head matmul per step). The same idea as
Liger-Kernel's fused linear cross-entropy and DeepSpeed ALST's TiledFusedLogitsLoss; written here as one
autograd.Function. Layout legend: hidden ``(N, d)`` (tokens flattened), weight ``(V, d)`` (nn.Linear layout),
targets ``(N,)``.

ZeRO-3 / FSDP: the head's weight may be a partitioned parameter that is only whole inside the module's own
forward (and again when its backward runs). ``lm_head_loss`` therefore runs the chunked function *as* the
lm_head module's forward (temporarily swapped in on the instance), so the framework's module hooks gather the
weight before the call and again before backward, exactly as for an ordinary ``nn.Linear`` call, and the weight
gradient reaches the framework's gradient hooks through the normal AccumulateGrad path.
(``deepspeed.zero.GatheredParameters`` would only cover the forward: our backward recomputes logits and needs the
whole weight again.)
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk of any chunked head: ~2^27 logits, 512 MB of fp32 (4096 tokens for a 32K vocab)."""
    return max(256, (1 << 27) // max(1, vocab_size))


# ---------------------------------------------------------------------------------------------- reductions
def global_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group`` (None = the world), detached; identity without a process group."""
    import torch.distributed as dist

    from .phase import phase
    x = x.detach().clone()
    if dist.is_available() and dist.is_initialized():
        with phase("loss all-reduce"):
            dist.all_reduce(x, group=group)
    return x


def global_count(count: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) a valid-token count over ``group``; identity without a process group."""
    return global_sum(count, group)


def global_token_count(count: torch.Tensor, group=None) -> torch.Tensor:
    """Valid-target count summed over ``group`` as float32 (no grad)."""
    return global_sum(count.to(torch.float32), group)


# ---------------------------------------------------------------------------------------------- full logits
def token_nll_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """(sum of cross-entropy over valid targets (fp32, 0 if none), number of valid targets (int64))."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: logits "
                         "must be targets' shape plus the vocab dim (shard both with the same layout)")
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    return total, (targets != ignore_index).sum()


def sp_token_mean_loss(logits: torch.Tensor, targets: torch.Tensor, group=None, *,
                       ignore_index: int = IGNORE_INDEX, grads_averaged_over: int = 1) -> torch.Tensor:
    """This rank's share of the global token-mean loss: local CE sum / global valid count.

    ``group``: the ranks whose tokens form one optimizer batch (None = the world: every dp x sp rank).
    Summed over ``group`` the returned values give the global mean loss (all-reduce it for logging).
    """
    total, count = token_nll_sum(logits, targets, ignore_index)
    n = global_count(count, group).clamp_min(1).to(total.dtype)
    return total * (grads_averaged_over / n)


# ---------------------------------------------------------------------------------------------- chunked head
def chunked_nll_sum(head, hidden: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                    chunk_size: int | None = None, ignore_index: int = IGNORE_INDEX):
    """Sum of token NLL and count of scored tokens, logits of ``chunk_size`` scored rows at a time (no backward:
    for evaluation; training uses ``chunked_lm_loss``).

    ``head``: rows ``(n, H)`` -> logits ``(n, vocab_size)`` (cross-entropy in fp32, chunks summed in fp64).
    hidden ``(..., H)``, targets ``(...)``; only scored rows go through the head. Returns ``(nll_sum float64
    scalar, count int64 scalar)``.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    keep = (t != ignore_index).nonzero().squeeze(-1)
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    if keep.numel() == 0:
        return total, torch.zeros((), dtype=torch.int64, device=h.device)
    step = chunk_size or default_chunk_size(vocab_size)
    for s in range(0, keep.numel(), step):
        rows = keep[s:s + step]
        total += token_nll_sum(head(h.index_select(0, rows)), t.index_select(0, rows), ignore_index)[0].double()
    return total, torch.tensor(keep.numel(), dtype=torch.int64, device=h.device)
class ChunkedLMLoss(torch.autograd.Function):
    """(hidden, weight, targets) -> (nll_sum scalar, fp32 or wider; valid count int64 scalar)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, ignore_index):
        n = hidden.shape[0]
        valid = targets != ignore_index
        safe_t = torch.where(valid, targets, torch.zeros_like(targets))  # ignore_index may be -100
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 math (fp64 stays fp64)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        nll = torch.zeros((), dtype=acc, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            # matmul in the model dtype (as nn.Linear would), softmax math in fp32 (as HF's loss does)
            logits = (hidden[s:e] @ weight.t()).to(acc)
            lse_c = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, safe_t[s:e, None]).squeeze(1)
            lse[s:e] = lse_c
            nll += ((lse_c - tgt) * valid[s:e]).sum()
            del logits
        count = valid.sum()
        ctx.mark_non_differentiable(count)
        ctx.save_for_backward(hidden, weight, safe_t, valid, lse)
        ctx.chunk_size = chunk_size
        return nll, count

    @staticmethod
    def backward(ctx, grad_nll, grad_count):
        hidden, weight, safe_t, valid, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, cs = hidden.shape[0], ctx.chunk_size
        dh = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator for the weight gradient: per-chunk products are summed outside the matmul
        dw = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        scale = grad_nll.to(lse.dtype)
        for s in range(0, n, cs):
            e = min(n, s + cs)
            h = hidden[s:e]
            # d nll / d logits = softmax - onehot(target), zero on ignored rows; recomputed per chunk
            g = (h @ weight.t()).to(lse.dtype)
            g.sub_(lse[s:e, None]).exp_()
            rows = torch.arange(e - s, device=g.device)
            g[rows, safe_t[s:e]] -= 1.0
            g.mul_((valid[s:e].to(g.dtype) * scale)[:, None])
            g = g.to(hidden.dtype)
            if need_h:
                dh[s:e] = g @ weight
            if need_w:
                if dw.dtype == g.dtype:
                    dw.addmm_(g.t(), h)
                else:
                    dw += (g.t() @ h).float()
            del g
        return dh, (dw.to(weight.dtype) if need_w else None), None, None, None


def chunked_lm_loss(hidden, lm_head_weight, targets, chunk_size=None, ignore_index=IGNORE_INDEX):
    """Sum of token NLLs and number of valid targets, computed chunk by chunk.

    hidden ``(..., d)``, lm_head_weight ``(V, d)``, targets ``(...)`` (same leading shape; ``ignore_index``
    marks tokens without a target). Returns ``(nll_sum, count)``: fp32 scalar (differentiable w.r.t.
    hidden and weight) and int64 scalar. Peak extra memory is one ``(chunk_size, V)`` fp32 block.
    """
    d = hidden.shape[-1]
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != d:
        raise ValueError(f"lm_head_weight must be (vocab, {d}); got {tuple(lm_head_weight.shape)} "
                         "(under ZeRO-3 call lm_head_loss(model.lm_head, ...) so the weight is gathered)")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    chunk_size = int(chunk_size or default_chunk_size(lm_head_weight.shape[0]))
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return ChunkedLMLoss.apply(hidden.reshape(-1, d), lm_head_weight, targets.reshape(-1).long(),
                               chunk_size, ignore_index)


@contextlib.contextmanager
def head_as_loss(lm_head: torch.nn.Module, targets, chunk_size=None, ignore_index=IGNORE_INDEX, nll_only=False):
    """Inside the block, ``lm_head(hidden)`` returns ``chunked_lm_loss(hidden, weight, targets)`` — (NLL sum,
    count), or the NLL sum alone with ``nll_only`` — instead of logits. It runs as the head's own forward, so
    ZeRO-3 / FSDP module hooks gather the (partitioned) weight for forward and backward, also when the call comes
    from inside a wrapped model's forward. ``lm_head`` must be a bias-free Linear-like module, weight (V, d)."""
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("chunked loss supports a bias-free lm_head only (Llama/Mistral/Qwen have none)")

    def forward(h):
        out = chunked_lm_loss(h, lm_head.weight, targets, chunk_size, ignore_index)
        return out[0] if nll_only else out

    had = "forward" in lm_head.__dict__
    prev = lm_head.__dict__.get("forward")
    lm_head.forward = forward
    try:
        yield lm_head
    finally:
        if had:
            lm_head.forward = prev
        else:
            del lm_head.forward


def lm_head_loss(lm_head: torch.nn.Module, hidden, targets, chunk_size=None, ignore_index=IGNORE_INDEX):
    """(NLL sum, count) of ``targets`` from ``hidden`` through ``lm_head`` in chunks (``head_as_loss``)."""
    with head_as_loss(lm_head, targets, chunk_size, ignore_index):
        return lm_head(hidden)


def _decoder(model):
    if hasattr(model, "get_decoder"):
        dec = model.get_decoder()
        if dec is not None and dec is not model:
            return dec
    if hasattr(model, "model"):
        return model.model
    raise ValueError(f"cannot find the base model of {type(model).__name__} (no get_decoder()/.model)")


def causal_lm_loss(model, input_ids, position_ids, targets, group=None, chunk_size=None, ignore_index=IGNORE_INDEX,
                   **model_kwargs):
    """Token-weighted causal-LM loss of this rank's shard, without full logits.

    Runs the base model (``model.get_decoder()``) for hidden states and the chunked head on them. The loss is
    ``local NLL sum / valid tokens summed over group``, so summing it over the ranks of ``group`` gives the
    exact mean over the whole (sharded) sequence, and gradients summed over ranks are the full-sequence
    gradients. Frameworks that *average* gradients over N ranks (DDP, DeepSpeed) need ``loss * N``. A
    sequence with no valid target gives 0 (not NaN). ``targets`` are already shifted (EasyContext's
    ``local_target_ids``), ``ignore_index`` marks tokens without one.
    """
    out = _decoder(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False, **model_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
    nll, count = lm_head_loss(head, hidden, targets, chunk_size, ignore_index)
    return nll / global_token_count(count, group).clamp_min(1.0)


def nll_sum(model, unwrapped, input_ids, position_ids, targets, chunked: bool, router: list | None = None,
            model_kwargs: dict | None = None):
    """Forward + summed next-token NLL (fp32) of this rank's tokens; -100 targets are skipped.

    ``chunked``: the LM head computes the loss chunk by chunk (``easy_context.loss.chunked_lm_loss``)
    and never the (tokens x vocab) logits. It runs *as the head's forward inside the wrapped model's
    forward*, so DeepSpeed's engine forward and ZeRO-3's module hooks (weight gather for forward and
    backward) see an ordinary call; the model then returns the NLL sum in place of its logits.
    ``router``: a list that receives the MoE router logits of this forward (for the load-balancing loss).
    ``model_kwargs``: what the cut inputs' ``prepared.model_kwargs`` say the model call must carry (packed rows'
    dispatch table).
    """
    kw = dict(model_kwargs or {}, **({"output_router_logits": True} if router is not None else {}))
    if chunked:
        with head_as_loss(unwrapped.get_output_embeddings(), targets, nll_only=True):
            out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kw)
        if router is not None:
            router.append(out.router_logits)
        return out.logits
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kw)
    if router is not None:
        router.append(out.router_logits)
    return token_nll_sum(out.logits, targets)[0]


__all__ = ["IGNORE_INDEX", "default_chunk_size", "global_sum", "global_count", "global_token_count", "token_nll_sum",
           "nll_sum", "sp_token_mean_loss", "chunked_nll_sum", "ChunkedLMLoss", "chunked_lm_loss", "head_as_loss",
           "lm_head_loss", "causal_lm_loss"]
