"""Assertion helper with max/mean differences in the message."""
import torch

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def assert_close(actual, expected, rel=None, name="tensor"):
    """Relative error ||a - e|| / ||e|| within ``rel`` (per-dtype default); message has max/mean diff."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    rel = TOL.get(actual.dtype, 1e-5) if rel is None else rel
    diff = (a - e).abs()
    err = diff.norm() / e.norm().clamp_min(1e-30)
    assert err <= rel, (f"{name}: relative error {err:.3e} > {rel:.1e} "
                        f"(max diff {diff.max():.3e}, mean diff {diff.mean():.3e}, |ref| max {e.abs().max():.3e})")
