"""The machinery of head-chunked attention blocks (memory/head_chunks.py): a block's forward over one group of heads
(the projections sliced to the group's rows / columns) and the ``autograd.Function`` that runs the groups.

How (one ``autograd.Function`` per attention block call, reentrant-style like memory/offload.py):

* forward: the groups run without autograd, the attention's (out, lse) of each group are kept (the lean
  attention cache of attention_cache.py: a mode's attention stores them) and saved for backward with the block
  input: 8 KB/token + LSE, what the attention would keep anyway, nothing more;
* backward: group by group, the q/k/v product is recomputed (a leaf), RoPE and q/k norms with autograd, the
  attention gets its kept (out, lse) back without running again, and ``torch.autograd.grad`` takes the group's
  share of the output gradient (``dy @ W_o[:, group]``) back to the q/k/v product; the projections' own backward
  is done by hand (input gradient summed over the groups in place). The block's parameter gradients are summed
  over the groups and returned once (one AccumulateGrad per parameter: DDP / ZeRO-2 hooks fire once, as without
  groups).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..attention_cache import _ACTIVE

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class _ChunkCache:
    """The attention results of one block call, one entry per head group (attention_cache's ``resolve`` protocol).

    Recording: each attention call asks the enclosing cache (a selective / nested layer's, or none) for its result,
    as the whole block's call would (in grad mode: the block runs in a Function's forward, whose own grad mode is
    off), and keeps a detached copy here. Replaying group g: the call gets entry g back."""

    keep_forward = False  # the generic (non-lean) path of memory/selective.py must not use this cache

    def __init__(self, parent, entries=None):
        self.parent = parent
        self.entries = list(entries or [])
        self.replaying, self.pos = entries is not None, 0

    def resolve(self, compute, grad=None):
        if self.replaying:
            if self.pos >= len(self.entries):
                raise RuntimeError("head-chunked attention: a group called attention more often in its backward "
                                   "than in its forward")
            self.pos += 1
            return tuple(t.detach() for t in self.entries[self.pos - 1])
        token = _ACTIVE.set(self.parent)
        try:
            res = tuple(compute() if self.parent is None else self.parent.resolve(compute, grad=True))
        finally:
            _ACTIVE.reset(token)
        self.entries.append(tuple(t.detach() for t in res))
        return res


class _GroupQKV:
    """The group's q, k and v rows as ONE matmul of the block input (split after): in the backward the input's
    gradient is one hidden-sized product per group, not three summed. Each projection's module asks for its part;
    another input (not the one q was computed from) gets its own product."""

    def __init__(self, saved, lo_q, hi_q, lo_kv, hi_kv, record=None):
        self.lins = [saved["q_proj"], saved["k_proj"], saved["v_proj"]]
        self.rows = [(lo_q, hi_q), (lo_kv, hi_kv), (lo_kv, hi_kv)]
        self.x = self.parts = None
        self.record = record  # backward rebuild: the product is a leaf; its gradient is taken, not pushed further

    def part(self, i, x):
        if self.x is x and self.parts[i] is None:  # asked twice for one input: its own product
            return _linear_rows(self.lins[i], *self.rows[i], x)
        if self.x is not x:
            w = torch.cat([lin.weight[lo:hi] for lin, (lo, hi) in zip(self.lins, self.rows)])
            b = None if self.lins[0].bias is None else \
                torch.cat([lin.bias[lo:hi] for lin, (lo, hi) in zip(self.lins, self.rows)])  # all or none (_check)
            if self.record is None:
                qkv = F.linear(x, w, b)
            else:  # the block's backward does the projections' own backward by hand (module doc)
                with torch.no_grad():
                    qkv = F.linear(x, w, b).requires_grad_(True)
                self.record.update(qkv=qkv, w=w)
            self.x, self.parts = x, list(qkv.split([hi - lo for lo, hi in self.rows], dim=-1))
        out, self.parts[i] = self.parts[i], None  # handed out once: the group holds no extra reference
        if all(p is None for p in self.parts):
            self.x = self.parts = None
        return out


def _linear_rows(lin, lo, hi, x):
    return F.linear(x, lin.weight[lo:hi], None if lin.bias is None else lin.bias[lo:hi])


class _Rows(torch.nn.Module):
    """q/k/v_proj of a head group (part ``i`` of a ``_GroupQKV``); calls the Linear's forward hooks when asked
    (memory/offload.py's prefetch marker watches q_proj)."""

    def __init__(self, lin, qkv: _GroupQKV, i: int, hooks: bool):
        super().__init__()
        self.__dict__.update(lin_=lin, qkv=qkv, i=i, hooks=hooks)

    def forward(self, x):
        out = self.qkv.part(self.i, x)
        if self.hooks:  # not DeepSpeed's own (ZeRO-3 would release the parameters the block gathered)
            for hook in list(self.lin_._forward_hooks.values()):
                if not getattr(hook, "__module__", "").startswith("deepspeed"):
                    hook(self.lin_, (x,), out)
        return out


class _Cols(torch.nn.Module):
    """Columns [lo, hi) of o_proj: the group's partial product; the bias is added by the first group only."""

    def __init__(self, lin, lo, hi, bias: bool, record=None):
        super().__init__()
        self.__dict__.update(lin_=lin, lo=lo, hi=hi, bias=bias, record=record)

    def forward(self, x):
        if self.record is not None:  # backward rebuild: the attention output is where the gradient goes in
            self.record["a"] = x
            return x
        lin = self.lin_
        return F.linear(x, lin.weight[:, self.lo:self.hi], lin.bias if self.bias else None)


@contextlib.contextmanager
def _group_view(attn, g: int, n: int, hooks: bool, record=None):
    """``attn`` computes only head group ``g`` of ``n`` while inside (its projections swapped for slices).
    ``record`` (a dict; backward rebuild): the q/k/v product is a leaf (``qkv``, with the weight rows ``w``) and
    o_proj returns its input (``a``, the attention output) instead of projecting it."""
    mods = attn._modules
    saved = {p: mods[p] for p in PROJECTIONS}
    q, kv = saved["q_proj"].out_features // n, saved["k_proj"].out_features // n
    try:
        qkv = _GroupQKV(saved, g * q, (g + 1) * q, g * kv, (g + 1) * kv, record)
        mods["q_proj"] = _Rows(saved["q_proj"], qkv, 0, hooks)
        mods["k_proj"] = _Rows(saved["k_proj"], qkv, 1, False)
        mods["v_proj"] = _Rows(saved["v_proj"], qkv, 2, False)
        mods["o_proj"] = _Cols(saved["o_proj"], g * q, (g + 1) * q, g == 0, record)
        yield
    finally:
        mods.update(saved)


def _gathered(params):
    """Under DeepSpeed ZeRO-3 (partitioned parameters carry ``ds_id``): ``params`` whole while inside (the groups slice
    the projections directly, so the modules' gather hooks never run); a no-op for none."""
    params = [p for p in params if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _projection_params(attn):
    return [p for name in PROJECTIONS for p in getattr(attn, name).parameters()]


def _full_shape(p) -> torch.Size:
    """A parameter's shape, also while ZeRO-3 holds it partitioned (``ds_shape``)."""
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


_PENDING = "_easy_context_head_chunks_pending"  # on the attention module: its release, while it waits


def _release_when_accumulated(attn, gathers, params) -> None:
    """Leave the ``gathers`` once every one of ``params`` has accumulated its gradient (post-accumulate hooks, removed
    as they fire; ZeRO-3's own reduce hooks were registered first and run before). A backward that accumulates
    nothing (``torch.autograd.grad`` of the input only) never fires them: the block's next call releases first."""
    handles, left = [], [len(params)]

    def leave():
        for h in handles:
            h.remove()
        attn.__dict__.pop(_PENDING, None)
        for g in reversed(gathers):
            g.__exit__(None, None, None)
    if not params:
        leave()
        return

    def done(_):
        left[0] -= 1
        if left[0] == 0:
            leave()
    handles.extend(p.register_post_accumulate_grad_hook(done) for p in params)
    attn.__dict__[_PENDING] = leave


def _release_pending(attn) -> None:
    leave = attn.__dict__.get(_PENDING)
    if leave is not None:
        leave()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class _HeadChunked(torch.autograd.Function):
    """apply((run, attn, names), n, hidden, *params): ``run(g, h, hooks, record)`` is the block's forward over head
    group ``g``; ``params`` (named ``names`` in ``attn``) its trainable parameters. Their gradients are summed over
    the groups (fp32) and returned once, so each gets one AccumulateGrad per backward (what DDP's and ZeRO-2's
    gradient hooks expect).

    Backward per group: the rebuild stops at the q/k/v product (a leaf) and at o_proj's input ``a``; autograd runs
    only between them (RoPE, q/k norms, the attention's backward). The projections' own backward is done here: the
    output gradient enters as ``dy @ W_o[:, group]`` (no hidden-sized partial output is built) and the input
    gradient of all groups is summed in place (``addmm_``), so the peak holds one hidden-sized gradient, not one
    per group plus their sum."""

    @staticmethod
    def forward(ctx, block, n, hidden, *params):
        run = block[0]
        cache = _ChunkCache(_ACTIVE.get())
        y = None
        token = _ACTIVE.set(cache)
        try:
            with torch.no_grad():
                for g in range(n):
                    yg = _first(run(g, hidden, False))
                    if len(cache.entries) != g + 1:
                        raise ValueError(
                            "head-chunked attention needs a sequence-parallel mode's attention (it keeps each "
                            "group's output + LSE): call apply_seq_parallel_monkey_patch(mode, model) first (any "
                            "mode, sp = 1 included), or configure_memory(..., head_chunks=1)")
                    y = yg if y is None else y.add_(yg)
        finally:
            _ACTIVE.reset(token)
        ctx.block, ctx.n, ctx.sizes, ctx.params = block, n, [len(e) for e in cache.entries], params
        ctx.save_for_backward(hidden, *(t for e in cache.entries for t in e))
        return y

    @staticmethod
    def backward(ctx, dy):
        attn = ctx.block[1]
        if not any(hasattr(p, "ds_id") for p in attn.parameters()):
            return _HeadChunked._backward(ctx, dy)
        # ZeRO-3: the projections whole for the groups' slices. The q/k norms run as modules (ZeRO-3's hooks gather
        # and release them); those are gathered again at the end, so that every parameter is whole when autograd
        # accumulates the gradient returned here (AccumulateGrad lays it out like the parameter: a partitioned one has
        # no elements), and all go back once the gradients are in
        _release_pending(attn)
        gathers = [_gathered(_projection_params(attn))]
        gathers[0].__enter__()
        try:
            out = _HeadChunked._backward(ctx, dy)
            with_grad = [p for p, g in zip(ctx.params, out[3:]) if g is not None]
            proj = {id(p) for p in _projection_params(attn)}
            gathers.append(_gathered([p for p in with_grad if id(p) not in proj]))
            gathers[1].__enter__()
        except BaseException:
            for g in reversed(gathers):
                g.__exit__(None, None, None)
            raise
        _release_when_accumulated(attn, gathers, with_grad)
        return out

    @staticmethod
    def _backward(ctx, dy):
        run, attn, names = ctx.block
        hidden, *flat = ctx.saved_tensors
        entries, i = [], 0
        for s in ctx.sizes:
            entries.append(tuple(flat[i:i + s]))
            i += s
        del flat
        n, d = ctx.n, hidden.shape[-1]
        need_h = ctx.needs_input_grad[2]
        want = {nm: p for k, (nm, p) in enumerate(zip(names, ctx.params)) if ctx.needs_input_grad[3 + k]}
        others = [nm for nm in want if nm.split(".")[0] not in PROJECTIONS]  # q/k norms: through autograd
        acc: dict = {}

        def add(name, rows, cols, g):  # fp32 sum of one parameter's gradient (a slice of it per group)
            if name in want:
                if name not in acc:
                    acc[name] = torch.zeros(_full_shape(want[name]), dtype=torch.float32, device=g.device)
                acc[name][(rows, cols)[:acc[name].dim()]] += g

        x2, dy2 = hidden.detach().reshape(-1, d), dy.reshape(-1, d)
        dh = torch.zeros_like(hidden) if need_h else None
        q_rows, kv_rows = attn.q_proj.out_features // n, attn.k_proj.out_features // n
        full = slice(None)
        cache = _ChunkCache(None, entries)
        token = _ACTIVE.set(cache)
        try:
            for g in range(n):
                rec: dict = {}
                with torch.enable_grad():
                    run(g, hidden.detach(), g == n - 1, rec)
                cache.entries[g] = None  # the attention's backward holds its own reference; drop ours with it
                a, qkv, w = rec["a"], rec["qkv"], rec["w"]
                cols = slice(g * q_rows, (g + 1) * q_rows)
                a2 = a.detach().reshape(-1, a.shape[-1])
                da = (dy2 @ attn.o_proj.weight[:, cols]).view_as(a)
                got = torch.autograd.grad(a, [qkv] + [want[nm] for nm in others], da, allow_unused=True)
                del a, da
                dqkv2 = got[0].reshape(-1, qkv.shape[-1])
                for nm, gp in zip(others, got[1:]):
                    if gp is not None:
                        add(nm, full, full, gp)
                if need_h:
                    dh.view(-1, d).addmm_(dqkv2, w)
                add("o_proj.weight", full, cols, dy2.t() @ a2)
                if g == 0:
                    add("o_proj.bias", full, full, dy2.sum(0))
                gw, gb = dqkv2.t() @ x2, dqkv2.sum(0)
                lo = 0
                for p, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                    own = slice(g * rows, (g + 1) * rows)
                    add(f"{p}.weight", own, full, gw[lo:lo + rows])
                    add(f"{p}.bias", own, full, gb[lo:lo + rows])
                    lo += rows
                del qkv, w, dqkv2, gw, gb, got, rec
        finally:
            _ACTIVE.reset(token)
        pgrads = [None if nm not in acc else acc[nm].to(p.dtype) for nm, p in zip(names, ctx.params)]
        return (None, None, dh, *pgrads)


__all__ = ["PROJECTIONS"]
