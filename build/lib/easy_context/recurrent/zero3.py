"""DeepSpeed ZeRO-3 and the recurrent layers under sequence parallelism.

ZeRO-3 keeps every parameter partitioned and all-gathers a module's own parameters in its forward / backward
hooks; the gradient hooks reduce-scatter them. Those collectives must be issued in one order on every rank.

* Parallel paths (delta_parallel, conv_parallel, mamba2_parallel): every rank calls each submodule of the layer
  (in_proj, norm, out_proj) exactly once per forward, on all its local tokens, whatever pieces and document starts
  it holds, so the hooks' gathers pair up; the conv weights read directly (not through the conv's forward) are
  registered as the layer's external parameters (``gather_direct``), gathered with the layer. Backward: the
  CPU/GPU autograd engine runs the ready node of highest sequence number first, so the nodes that talk (the
  submodules' backward hooks, the exchanges, the first use of each parameter whose gradient hook may flush a
  reduce bucket) run in the reverse of their forward order, the same on every rank.
* The serial chain (``EASY_CONTEXT_RECURRENT_SERIAL=1``, or a layer its parallel path does not know): only the
  owner of a piece runs the layer there, once per piece (and once per document inside it), so the submodules'
  hooks would fire a different number of times on each rank. ``whole_layer`` instead gathers every parameter of
  the layer once, on every rank at the same point (one ``GatheredParameters`` around the forward chain, another
  around backward's recomputing chain: one layer's parameters live at a time), and silences DeepSpeed's hooks on
  the layer's submodules meanwhile (a hook would re-partition a parameter after its first call, and ZeRO-3's
  trace / prefetch would record a different module order per rank). The layer's own hooks still run, once per
  call on every rank. The chain's backward returns a gradient (zeros where this rank's pieces did not use one)
  for every parameter, so every rank fires every gradient hook, in one order. (Gathering only in forward fails in
  backward, "size of tensor a (0) must match the size of tensor b (64)": the recompute met re-partitioned
  parameters.) One-piece plans (data_parallel's resets, one rank) run plain autograd.
Tested: tests/test_hybrid_zero3.py (CPU, gloo, W = 2, stage3_param_persistence_threshold 0: both routes)."""
from __future__ import annotations

import contextlib

import torch


def is_partitioned(layer) -> bool:
    return any(hasattr(p, "ds_id") for p in layer.parameters())


def gather_direct(layer) -> None:
    """Under ZeRO-3: the Conv1d children's parameters (the paths read ``conv.weight`` / ``bias`` directly, outside
    the conv's forward, where ZeRO-3 would leave them partitioned, size 0) become the layer's external
    parameters, gathered and released with the layer from then on; the first call gathers them now (every rank
    at the same point of the same layer)."""
    params = [p for m in layer.children() if isinstance(m, torch.nn.Conv1d) for p in m.parameters()
              if hasattr(p, "ds_id")]
    if not params:
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, register_external_parameter
    known = getattr(layer, "_external_params", {})
    for p in params:
        if id(p) not in known:
            register_external_parameter(layer, p)
    for p in params:  # in one order on every rank
        if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            p.all_gather()


def _is_deepspeed_hook(fn) -> bool:
    fn = getattr(fn, "__wrapped__", fn)  # torch.compiler.disable wraps DeepSpeed's module hooks
    return (getattr(fn, "__module__", None) or "").startswith("deepspeed.")


@contextlib.contextmanager
def _silenced(layer):
    """DeepSpeed's forward hooks (fetch / release / backward-hook installers) removed from the layer's submodules,
    put back (in their order) on exit; every other hook stays."""
    saved = []
    for m in layer.modules():
        if m is layer:
            continue
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(m, attr)
            if any(_is_deepspeed_hook(h) for h in hooks.values()):
                saved.append((m, attr, hooks))
                setattr(m, attr, type(hooks)((k, h) for k, h in hooks.items() if not _is_deepspeed_hook(h)))
    try:
        yield
    finally:
        for m, attr, hooks in saved:
            setattr(m, attr, hooks)


@contextlib.contextmanager
def whole_layer(layer):
    """Every parameter of ``layer`` gathered, DeepSpeed's submodule hooks silenced (see the module docstring); a
    no-op without ZeRO-3. Every rank must enter it at the same point (the gather is a collective)."""
    if not is_partitioned(layer):
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    # the layer's own (and external) parameters are already gathered by its hook: leave them to it
    params = [p for p in layer.parameters() if hasattr(p, "ds_id") and p.ds_status != ZeroParamStatus.AVAILABLE]
    with GatheredParameters(params, enabled=bool(params)), _silenced(layer):
        yield


@contextlib.contextmanager
def whole_layer_for_grads(layer, trainable: list):
    """``whole_layer`` for the chain's backward: the parameters stay gathered past the block, until their
    gradient is accumulated (torch's AccumulateGrad copies a gradient into the parameter's own shape, 0 once
    partitioned; it runs right after the chain's backward, before anything else). ``trainable``: the parameters
    the backward returns a gradient for (all of them, under ZeRO-3); the others are partitioned on exit."""
    if not is_partitioned(layer):
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    todo = [p for p in layer.parameters() if hasattr(p, "ds_id") and p.ds_status != ZeroParamStatus.AVAILABLE]
    if todo:
        todo[0].all_gather(param_list=todo)
    try:
        with _silenced(layer):
            yield
    finally:
        later = {id(p) for p in trainable}
        for p in todo:
            if id(p) in later:
                _release_after_grad(p)
            else:
                p.partition()


def _release_after_grad(p) -> None:
    if not getattr(p, "_easy_context_release_hook", False):  # one hook per parameter, armed per backward
        p.register_post_accumulate_grad_hook(_release_hook)
        p._easy_context_release_hook = True
    p._easy_context_release_pending = True


def _release_hook(p) -> None:
    if getattr(p, "_easy_context_release_pending", False):
        p._easy_context_release_pending = False
        p.partition()


def full_zeros(p: torch.Tensor) -> torch.Tensor:
    """A zero gradient of ``p``'s full shape (ZeRO-3: ``ds_shape``, the tensor itself may be partitioned)."""
    return torch.zeros(getattr(p, "ds_shape", p.shape), dtype=p.dtype, device=p.device)
