"""FA4 backend: selection and fallback logic with the flash_attn.cute import faked (CPU), and FA4 itself vs the
float64 reference on a GPU (dense causal / non-causal unequal lengths / GQA come from test_kernels.py's
backend sweep, which includes fa4 where it is usable; varlen is checked here)."""
import sys
import types
import warnings

import pytest
import torch

from easy_context import kernels
from easy_context.kernels import fa4
from tests.tols import assert_close


@pytest.fixture
def fresh(monkeypatch):
    """Reset FA4's process-wide caches around each test."""
    def reset():
        fa4.module.cache_clear()
        fa4.usable.cache_clear()
        fa4._warned.clear()
        fa4._failed_shapes.clear()
    reset()
    monkeypatch.delenv(fa4.ENV, raising=False)
    yield monkeypatch
    reset()


def _fake_installed(monkeypatch, version="4.0.0b36", mod=None, import_error=None):
    import importlib.metadata as md
    real = md.version
    monkeypatch.setattr(md, "version", lambda name: version if name == "flash-attn-4" else real(name))
    if import_error is not None:
        def boom(name, *a, **k):
            if name == "flash_attn.cute.interface":
                raise import_error
            return real_import(name, *a, **k)
        real_import = fa4.importlib.import_module
        monkeypatch.setattr(fa4.importlib, "import_module", boom)
    elif mod is not None:
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", mod)
        monkeypatch.setattr(fa4.importlib, "import_module",
                            lambda name: mod if name == "flash_attn.cute.interface" else __import__(name))


def _fake_module(fwd=None, bwd=None):
    mod = types.ModuleType("flash_attn.cute.interface")
    mod.calls = []

    def _flash_attn_fwd(q, k, v, **kw):
        mod.calls.append(("fwd", kw))
        if fwd:
            return fwd(q, k, v, **kw)
        out, lse = kernels.attn_forward(q, k, v, kw["causal"], kw["softmax_scale"], backend="math")
        return out, lse, None, None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, **kw):
        mod.calls.append(("bwd", kw))
        if bwd:
            return bwd()
        got = kernels.attn_backward(dout, q, k, v, out, lse, kw["causal"], kw["softmax_scale"], backend="math")
        for buf, g in zip((kw.get("dq"), kw.get("dk"), kw.get("dv")), got):
            if buf is not None:  # FA4 writes into given (strided) outputs
                buf.copy_(g)
        return got
    mod._flash_attn_fwd, mod._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    return mod


def test_not_installed_is_silent(fresh):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)
    fresh.setattr(md, "version", missing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fa4.module() is None


def test_untested_version_warns_once_and_force_overrides(fresh):
    _fake_installed(fresh, version="5.0.0", mod=_fake_module())
    with pytest.warns(RuntimeWarning, match=r"outside the tested range .*EASY_CONTEXT_FA4=force"):
        assert fa4.module() is None
    fa4.module.cache_clear()
    fresh.setenv(fa4.ENV, "force")
    assert fa4.module() is not None


def test_broken_import_warns_and_disables(fresh):
    _fake_installed(fresh, import_error=OSError("libcuda.so.1: cannot open shared object file"))
    with pytest.warns(RuntimeWarning, match="installed but unusable .*libcuda.*using cuDNN"):
        assert fa4.module() is None


def test_env_off(fresh):
    _fake_installed(fresh, mod=_fake_module())
    fresh.setenv(fa4.ENV, "0")
    assert fa4.module() is None


def test_disk_cache_enabled_by_default_and_user_setting_wins(fresh, tmp_path):
    for var in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        fresh.delenv(var, raising=False)
    fresh.setenv(fa4.CACHE_ENV, str(tmp_path))
    _fake_installed(fresh, mod=_fake_module())
    assert fa4.module() is not None
    import os
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path)
    fresh.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/elsewhere")
    fa4._enable_disk_cache()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == "/elsewhere"


def _faked_inputs(fresh, hq, hkv):
    """A fake FA4 installed, float64 q/dout (1, 16, hq, 8) and k/v (1, 16, hkv, 8), a fallback that fails."""
    mod = _fake_module()
    _fake_installed(fresh, mod=mod)
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 16, hq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 16, hkv, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return mod, q, k, v, do, lambda *a: pytest.fail("fallback used")


def test_forward_backward_through_fake_fa4_are_exact(fresh):
    mod, q, k, v, do, never = _faked_inputs(fresh, 4, 2)
    out, lse = fa4.forward(q, k, v, True, 0.3, fallback=never)
    dq, dk, dv = fa4.backward(do, q, k, v, out, lse, True, 0.3, fallback=never)
    ro, rl = kernels.attn_forward(q, k, v, True, 0.3, backend="math")
    rg = kernels.attn_backward(do, q, k, v, ro, rl, True, 0.3, backend="math")
    for a, b, n in zip((out, lse, dq, dk, dv), (ro, rl, *rg), ("out", "lse", "dq", "dk", "dv")):
        assert_close(a, b, 1e-12, n)
    assert mod.calls[0] == ("fwd", dict(softmax_scale=0.3, causal=True, return_lse=True))
    assert mod.calls[1][1]["causal"] is True and mod.calls[1][1]["softmax_scale"] == 0.3


def test_long_backward_runs_in_head_groups_writing_slices_in_place(fresh):
    """Past the accumulator limit the heads go in groups (GQA: kv heads with their q heads): same result."""
    mod, q, k, v, do, never = _faked_inputs(fresh, 8, 4)
    out, lse = fa4.forward(q, k, v, True, 0.3, fallback=never)
    whole = fa4.backward(do, q, k, v, out, lse, True, 0.3, fallback=never)
    fresh.setenv(fa4.ACCUM_ENV, str(16 * 8 * 8 * 4 / 4 / 2**20))  # a quarter of this accumulator
    assert fa4.head_groups(q, k) == 4
    mod.calls.clear()
    grouped = fa4.backward(do, q, k, v, out, lse, True, 0.3, fallback=never)
    assert len(mod.calls) == 4 and all(c[1]["dq"].shape == (1, 16, 2, 8) for c in mod.calls)
    for a, b, n in zip(grouped, whole, ("dq", "dk", "dv")):
        assert_close(a, b, 1e-12, n)
    fresh.setenv(fa4.ACCUM_ENV, "0")
    assert fa4.head_groups(q, k) == 4  # at most as many groups as kv heads
    assert fa4.head_groups(q, k[:, :, :3]) == 1  # 3 kv heads: no even split


def test_failing_shape_falls_back_once_with_one_warning(fresh):
    def refuse(q, k, v, **kw):
        raise AssertionError("head_dim 96 not supported")
    mod = _fake_module(fwd=refuse)
    _fake_installed(fresh, mod=mod)
    q = torch.randn(1, 8, 2, 96)
    used = []

    def fallback(*a):
        used.append(1)
        return "cudnn-result"
    with pytest.warns(RuntimeWarning, match=r"forward failed for q \(1, 8, 2, 96\).*head_dim 96.*using cuDNN"):
        assert fa4.forward(q, q, q, True, 0.1, fallback) == "cudnn-result"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and FA4 is not tried again for this shape
        assert fa4.forward(q, q, q, True, 0.1, fallback) == "cudnn-result"
    assert len(used) == 2 and len(mod.calls) == 1


def test_auto_choice_prefers_fa4_on_hopper_only():
    yes, no = (lambda: True), (lambda: False)
    assert kernels.auto_cuda_backend(torch.bfloat16, 128, True, yes) == "fa4"
    assert kernels.auto_cuda_backend(torch.bfloat16, 128, True, no) == "cudnn"
    assert kernels.auto_cuda_backend(torch.bfloat16, 128, False, yes) == "flash"
    assert kernels.auto_cuda_backend(torch.bfloat16, 256, True, yes) == "cudnn"
    assert kernels.auto_cuda_backend(torch.bfloat16, 256, False, yes) == "flash"
    assert kernels.auto_cuda_backend(torch.bfloat16, 512, True, yes) == "efficient"
    assert kernels.auto_cuda_backend(torch.float32, 128, True, yes) == "efficient"
    assert kernels.auto_cuda_backend(torch.float64, 128, True, yes) == "math"
    assert "fa4" not in kernels.available_backends("cpu")


def _varlen_case(lens, seed):
    """float64 (q, k, v, dout) of packed sequences ``lens`` (8 q / 2 kv heads x 128), their cu_seqlens and bf16
    copies on the GPU, and the softmax scale."""
    g = torch.Generator().manual_seed(seed)
    tot, hq, hkv, d = sum(lens), 8, 2, 128
    q, do = (torch.randn(tot, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(tot, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    return (q, k, v, do), cu, tuple(t.cuda().bfloat16() for t in (q, k, v, do)), d ** -0.5


@pytest.mark.gpu
@pytest.mark.skipif(not fa4.usable(0), reason="needs flash-attn-4 (pip install -e .[fa4]) on a Hopper/Blackwell GPU")
def test_fa4_varlen_matches_reference():
    lens = [1, 37, 128, 300, 6]
    (q, k, v, do), cu, (qb, kb, vb, dob), scale = _varlen_case(lens, 1)
    fail = lambda *a: pytest.fail("fa4 varlen fell back")  # noqa: E731
    out, lse = fa4.varlen_forward(qb, kb, vb, cu, cu, max(lens), max(lens), True, scale, fail)
    dq, dk, dv = fa4.varlen_backward(dob, qb, kb, vb, out, lse, cu, cu, max(lens), max(lens), True, scale, fail)
    s = 0
    for n in lens:
        sl = slice(s, s + n)
        qr, kr, vr = (t[sl].unsqueeze(0).requires_grad_() for t in (q, k, v))
        ro, rl = kernels.attention_reference(qr, kr, vr, True, scale)
        ro.backward(do[sl].unsqueeze(0))
        assert_close(out[sl].double().cpu(), ro[0], 2e-2, f"out doc {n}")
        assert_close(lse[:, sl].double().cpu(), rl[0], 2e-2, f"lse doc {n}")
        for a, b, name in ((dq, qr, "dq"), (dk, kr, "dk"), (dv, vr, "dv")):
            if n == 1 and name in ("dq", "dk"):  # one key: softmax is constant, these grads are exactly 0
                assert a[sl].abs().max() < 1e-3, f"{name} doc 1 should be ~0, max {a[sl].abs().max()}"
                continue
            assert_close(a[sl].double().cpu(), b.grad[0], 2e-2, f"{name} doc {n}")
        s += n


@pytest.mark.gpu
@pytest.mark.skipif(not fa4.usable(0), reason="needs flash-attn-4 (pip install -e .[fa4]) on a Hopper/Blackwell GPU")
def test_fa4_varlen_window_matches_reference():
    """A diagonal run of documents, causal and windowed within each (kernels/documents.VARLEN_WINDOW): documents
    shorter and longer than the window in one call, against float64 attention with the explicit mask."""
    from tests.test_packed import _masked_reference
    lens, left = [1, 37, 128, 300, 6, 700], 63
    (q, k, v, do), cu, (qb, kb, vb, dob), scale = _varlen_case(lens, 6)
    fail = lambda *a: pytest.fail("fa4 windowed varlen fell back")  # noqa: E731
    out, lse = fa4.varlen_window_forward(qb, kb, vb, cu, max(lens), left, scale, fail)
    dq, dk, dv = fa4.varlen_window_backward(dob, qb, kb, vb, out, lse, cu, max(lens), left, scale, fail)
    s = 0
    for n in lens:
        sl = slice(s, s + n)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        ref = _masked_reference(*(t[sl].unsqueeze(0) for t in (q, k, v, do)), (j <= i) & (j >= i - left), scale)
        got_all = (out[sl], lse[:, sl], dq[sl], dk[sl], dv[sl])
        for got, want, name in zip(got_all, ref, ("out", "lse", "dq", "dk", "dv")):
            if n == 1 and name in ("dq", "dk"):
                assert got.abs().max() < 1e-3, f"{name} doc 1 should be ~0"
                continue
            assert_close(got.double().cpu(), want[0], 2e-2, f"{name} doc {n}")
        s += n


@pytest.mark.gpu
@pytest.mark.skipif(not fa4.usable(0), reason="needs flash-attn-4 (pip install -e .[fa4]) on a Hopper/Blackwell GPU")
def test_fa4_varlen_rectangles_match_reference():
    """Non-causal varlen with different q and kv lengths per sequence (kernels/documents' rectangles of a block)."""
    g = torch.Generator().manual_seed(4)
    lq, lk = [5, 300, 64, 1], [200, 17, 128, 700]
    hq, hkv, d = 8, 2, 128
    q, do = (torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0] + list(torch.tensor(x).cumsum(0)), dtype=torch.int32, device="cuda") for x in (lq, lk))
    qb, kb, vb, dob = (t.cuda().bfloat16() for t in (q, k, v, do))
    scale = d ** -0.5
    fail = lambda *a: pytest.fail("fa4 varlen fell back")  # noqa: E731
    out, lse = fa4.varlen_forward(qb, kb, vb, cu_q, cu_k, max(lq), max(lk), False, scale, fail)
    dq, dk, dv = fa4.varlen_backward(dob, qb, kb, vb, out, lse, cu_q, cu_k, max(lq), max(lk), False, scale, fail)
    a = b = 0
    for n, m in zip(lq, lk):
        qs, ks = slice(a, a + n), slice(b, b + m)
        qr, kr, vr = (t[s].unsqueeze(0).requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        ro, rl = kernels.attention_reference(qr, kr, vr, False, scale)
        ro.backward(do[qs].unsqueeze(0))
        assert_close(out[qs].double().cpu(), ro[0], 2e-2, f"out {n}x{m}")
        assert_close(lse[:, qs].double().cpu(), rl[0], 2e-2, f"lse {n}x{m}")
        for got, ref, name in ((dq[qs], qr, "dq"), (dk[ks], kr, "dk"), (dv[ks], vr, "dv")):
            assert_close(got.double().cpu(), ref.grad[0], 2e-2, f"{name} {n}x{m}")
        a, b = a + n, b + m


@pytest.mark.gpu
@pytest.mark.skipif(not fa4.usable(0), reason="needs flash-attn-4 (pip install -e .[fa4]) on a Hopper/Blackwell GPU")
def test_fa4_backward_in_head_groups_matches_whole(monkeypatch):
    """The real kernel writing head slices of dq/dk/dv in place (strided outputs) gives the one-call result."""
    g = torch.Generator(device="cuda").manual_seed(2)
    q, do = (torch.randn(1, 2048, 16, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2048, 4, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fail = lambda *a: pytest.fail("fa4 fell back")  # noqa: E731
    out, lse = fa4.forward(q, k, v, True, 0.09, fail)
    whole = fa4.backward(do, q, k, v, out, lse, True, 0.09, fail)
    monkeypatch.setenv(fa4.ACCUM_ENV, "1")
    assert fa4.head_groups(q, k) == 4
    grouped = fa4.backward(do, q, k, v, out, lse, True, 0.09, fail)
    for a, b, n in zip(grouped, whole, ("dq", "dk", "dv")):
        assert_close(a.double(), b.double(), 1e-2, n)
