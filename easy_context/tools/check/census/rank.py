"""What each census rank runs: one family's tiny model under one mode against one process (``check``'s comparison:
logits, token-mean loss, every parameter gradient summed over the ranks; packed rows against each document alone).

A case that raises on every rank at the same point (a refusal) leaves the ranks in step, and the next case runs. A
collective that failed (one rank raised, its peer waited) leaves the group unusable: the rank reports and stops, and
the parent starts fresh ranks for the cases left (``run.py``).
"""
from __future__ import annotations

import copy
import traceback

from ....loss import global_count, global_sum, token_nll_sum

BATCH = 2
GRAD_FLOOR = 1e-5  # of the largest gradient entry: a tensor whose gradient and difference both stay below is noise
BROKEN = ("timed out", "timeout", "connection", "Connection", "gloo", "Gloo", "broken pipe", "Broken pipe")


def rank_entry(rank: int, world: int, port: int, cases: list, results, collective_timeout: float, env) -> None:
    """Process target: ``(rank, case_index, "ok"|"error", payload)`` per case, then ``(rank, None, "done", None)``;
    stops after an error that broke the process group (``BROKEN``)."""
    from ...gloo import gloo_process
    try:
        with gloo_process(rank, world, port, collective_timeout, {"TRANSFORMERS_VERBOSITY": "error", **env}):
            for i, case in enumerate(cases):
                try:
                    results.put((rank, case["index"], "ok", run_case(case)))
                except Exception as e:  # noqa: BLE001 - every failure is a census result
                    results.put((rank, case["index"], "error", traceback.format_exc()))
                    if any(b in str(e) for b in BROKEN) or "distributed" in type(e).__module__:
                        break
            results.put((rank, None, "done", None))
    except BaseException:
        results.put((rank, None, "error", traceback.format_exc()))


def run_case(case: dict) -> dict | None:
    """One family x mode on this rank; rank 0 returns the relative errors against one process, others None."""
    import torch
    import torch.distributed as dist

    from easy_context import apply_seq_parallel_monkey_patch, unshard_sequence
    from easy_context.parallel_layout import ParallelLayout

    from ..rank import _grads, diff, make_batch, reference_step
    from .tiny import build, tiny_config
    config = tiny_config(case["family"])[0]
    model, _ = build(case["family"], config, case["seed"])
    model = model.to(getattr(torch, case.get("dtype", "float32")))  # float64: tells numerics from a bug
    if case.get("dtype") == "float64":  # the model file's own float32 casts (DiffLlama's lambdas) made float64 too
        _float64_casts(type(model))
    root = dist.get_rank() == 0
    ref = copy.deepcopy(model) if root else None
    layout = ParallelLayout.build(case["mode"])
    apply_seq_parallel_monkey_patch(case["mode"], model, layout=layout)
    input_ids, position_ids, target_ids = make_batch(BATCH, case["seq_len"], case["vocab"], case["seed"] + 1,
                                                     case["packed"])
    prepared = layout.prepare_inputs(input_ids, position_ids, target_ids, torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    logits = model(prepared["local_input_ids"], position_ids=prepared["local_position_ids"], use_cache=False,
                   **prepared.model_kwargs).logits
    local_sum, local_n = token_nll_sum(logits, prepared["local_target_ids"])
    loss = local_sum / global_count(local_n, None)
    loss.backward()
    total = global_sum(loss, None)
    gathered = [torch.empty_like(logits) for _ in range(layout.sp)]
    dist.all_gather(gathered, logits.detach().contiguous())
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g)
    if not root:
        return None
    full = unshard_sequence(case["mode"], gathered, dim=1, layout=prepared.layout)
    ref_logits, ref_loss, ref_grads = reference_step(ref, input_ids, position_ids, target_ids, case["packed"])
    scale = max([float(g.abs().max()) for g in ref_grads.values()] + [1e-30])
    floor = GRAD_FLOOR * scale  # below it a gradient is rounding (a key bias's, a top-1 router's: zero in exact math)
    gd = {n: diff(grads[n], ref_grads[n]) for n in ref_grads}
    real = {n: d for n, d in gd.items() if d["max_abs"] > floor or d.get("ref_max", 1.0) > floor}
    worst = max(real, key=lambda n: real[n]["rel"]) if real else ""
    return {"logits": diff(full, ref_logits)["rel"], "loss": diff(total, ref_loss)["rel"],
            "grads": real[worst]["rel"] if real else 0.0, "worst_grad": worst,
            "missing_grads": sorted(n for n in ref_grads if float(ref_grads[n].abs().max()) > floor
                                    and float(grads[n].abs().max()) == 0)}


def _float64_casts(cls) -> None:
    """Make ``torch.float32`` mean float64 inside the modeling modules of ``cls`` and its bases (this rank process
    only runs float64 reruns after it): exact math end to end, so what is left is a bug, not rounding."""
    import sys
    import types

    import torch
    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    shim.float32 = torch.float64
    for base in cls.__mro__:
        mod = sys.modules.get(base.__module__)
        if mod is not None and getattr(mod, "torch", None) is torch and ".models." in base.__module__:
            mod.torch = shim


__all__ = ["rank_entry", "run_case", "BATCH"]
