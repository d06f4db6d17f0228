"""train.py's MoE router load-balancing term: its coefficient (--router-aux-loss-coef) and the term each rank adds.
The loss itself, equal to one process under sequence parallelism, is library code (easy_context/moe.py)."""
from __future__ import annotations

from easy_context.moe import num_experts, router_aux_loss


def aux_coef(config, args) -> float:
    """--router-aux-loss-coef, or the config's coefficient when it asks for router logits; checked up front."""
    from .errors import UsageError
    if args.router_aux_loss_coef is not None:
        if args.router_aux_loss_coef > 0:
            try:
                num_experts(config)
            except ValueError as e:
                raise UsageError(f"--router-aux-loss-coef: {e}") from None
        return args.router_aux_loss_coef
    return float(getattr(config, "router_aux_loss_coef", 0.0)) if getattr(config, "output_router_logits", False) else 0.0


def aux_term(router, config, coef: float, world: int):
    """(term to add to the backward loss, global value for the log): DeepSpeed/DDP average gradients over the
    ``world`` ranks, so each rank's share is scaled by world; the 1/GA of accumulation matches HF's per-batch mean."""
    if not router:
        return 0.0, 0.0
    share, value = router_aux_loss(router[0], config)
    return coef * world * share, value


__all__ = ["router_aux_loss", "num_experts", "aux_coef", "aux_term"]
