"""Random weights for equivalence checks of hybrids (``check``, tests): a decay that keeps the state alive.

With transformers' default init (gated DeltaNet: A uniform in [0.01, 16]) most heads forget within a token, so a
check would barely see whether the state crossed ranks, and the decay parameters' gradients (A_log, dt_bias) are
sums that cancel below float32 resolution: one process in fp32 is 1e-4 (relative) away from fp64 there, so no
other summation order can match it to 1e-5. A in [0.05, 0.5] keeps the state for tens of tokens and those
gradients resolvable (fp32 vs fp64 on one process: 2e-6)."""
from __future__ import annotations

import torch


def slow_decay_(model, seed: int = 0, low: float = 0.05, high: float = 0.5) -> int:
    """Set every ``A_log`` parameter to log(U(low, high)) in place (same values on every rank for one seed);
    returns how many tensors were set."""
    g = torch.Generator().manual_seed(seed + 5)
    n = 0
    for m in model.modules():
        a = m._parameters.get("A_log") if hasattr(m, "_parameters") else None
        if a is not None:
            with torch.no_grad():
                a.copy_(torch.empty(a.shape).uniform_(low, high, generator=g).log())
            n += 1
    return n
