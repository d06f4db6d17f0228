"""The parallel paths of gated DeltaNet (recurrent/delta_parallel.py) and the short conv (conv_parallel.py) on one
process: a plan of many pieces, all held here, equals the layer run on the whole chunk — output, input gradient
and every parameter gradient (fp32, 1e-5) — with pieces shorter than the conv window, document starts on piece
edges and inside pieces, and rows with different starts. (Nothing crosses ranks here: the multi-rank exactness
and the dropped-exchange mutation are in tests/test_hybrid.py.)"""
from __future__ import annotations

import pytest
import torch

from easy_context.recurrent.adapter import get_adapter
from easy_context.recurrent.detect import recurrent_layers
from easy_context.recurrent.pieces import Piece, Plan
from tests.hybrid_models import build_hybrid
from tests.tols import assert_close

CUTS = (0, 5, 6, 7, 20, 30, 37)  # pieces of 5, 1, 1, 13, 10, 7 tokens (conv windows of 3 and 2)


def _resets(kind, batch, length):
    if kind is None:
        return None
    r = torch.zeros(batch, length, dtype=torch.bool)
    r[:, [0, 6, 12]] = True  # 6: a piece edge; 12: inside a piece
    if kind == "rows":
        r[1, 12], r[1, 25], r[0, 31] = False, True, True
    return r


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "lfm2"])
def test_pieces_equal_the_layer(family):
    model = build_hybrid(family)
    layer = recurrent_layers(model)[0][1]
    adapter = get_adapter(layer)
    params = [p for p in layer.parameters()]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, CUTS[-1], model.config.hidden_size, generator=g).requires_grad_()
    pieces = tuple(Piece(0, a, b - a, a) for a, b in zip(CUTS, CUTS[1:]))
    for kind in (None, "same", "rows"):
        r = _resets(kind, 2, CUTS[-1])
        want = adapter.run_chunk(layer, x, adapter.zero_state(layer, 2, x.dtype, x.device), r)[0]
        got = adapter.run_plan(Plan(0, pieces, r), layer, x)
        assert got is not None, f"{family}: the parallel path did not run"
        dy = torch.randn(want.shape, generator=g)
        tag = f"{family} resets={kind}"
        assert_close(got, want, 1e-5, f"{tag} output")
        for name, a, b in zip(["input", *[n for n, _ in layer.named_parameters()]],
                              torch.autograd.grad(got, [x, *params], dy), torch.autograd.grad(want, [x, *params], dy)):
            assert_close(a, b, 1e-5, f"{tag} grad {name}")


def test_serial_env_selects_the_chain(monkeypatch):
    from easy_context.recurrent.exchange import SERIAL_ENV
    layer = recurrent_layers(build_hybrid("qwen3_next"))[0][1]
    plan = Plan(0, (Piece(0, 0, 4, 0), Piece(0, 4, 4, 4)), None)
    monkeypatch.setenv(SERIAL_ENV, "1")
    assert get_adapter(layer).run_plan(plan, layer, torch.randn(1, 8, 64)) is None
