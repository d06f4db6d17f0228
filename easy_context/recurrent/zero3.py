"""DeepSpeed ZeRO-3 and the recurrent layers under sequence parallelism.

ZeRO-3 keeps every parameter partitioned and all-gathers a module's own parameters in its forward / backward
hooks; the gradient hooks reduce-scatter them. Those collectives must be issued in one order on every rank.

* Parallel paths (delta_parallel, conv_parallel, mamba2_parallel): supported. Every rank calls each submodule of
  the layer (in_proj, norm, out_proj) exactly once per forward, on all its local tokens, whatever pieces and
  document starts it holds, so the hooks' gathers pair up; the conv weights read directly (not through the
  conv's forward) are registered as the layer's external parameters (``gather_direct``), gathered with the
  layer. Backward: the CPU/GPU autograd engine runs the ready node of highest sequence number first, so the
  nodes that talk (the submodules' backward hooks, the exchanges, the first use of each parameter whose
  gradient hook may flush a reduce bucket) run in the reverse of their forward order, the same on every rank.
  Tested: tests/test_hybrid_zero3.py (CPU, gloo, W = 2, stage3_param_persistence_threshold 0).
* The serial chain (``EASY_CONTEXT_RECURRENT_SERIAL=1``, or a layer its parallel path does not know): refused
  across ranks (``gathered``). Only the owner of a piece runs the layer there, so ranks would gather different
  modules; gathering the layer once around the chain (GatheredParameters) fails in backward ("size of tensor a
  (0) must match the size of tensor b (64)": the recompute meets re-partitioned parameters), and so does marking
  it a ZeRO-3 leaf module. One-piece plans (data_parallel's resets, one rank) run plain autograd and work."""
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


@contextlib.contextmanager
def gathered(layer):
    if is_partitioned(layer):
        raise RuntimeError(f"{type(layer).__name__}: the serial recurrent chain does not support DeepSpeed ZeRO-3 "
                           "across ranks (easy_context/recurrent/zero3.py); the parallel path does: unset "
                           "EASY_CONTEXT_RECURRENT_SERIAL / EASY_CONTEXT_MAMBA2_SERIAL, or use ZeRO-2 "
                           "(accelerate_configs/zero2_*.json) or no DeepSpeed (plain DDP)")
    yield
