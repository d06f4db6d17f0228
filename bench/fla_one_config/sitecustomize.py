"""Put this folder on PYTHONPATH to give every Triton autotuner one config (the first): no autotuning, one compile
per kernel. A first call of fla's gated delta rule otherwise spends about 40-70 s autotuning each kernel key (H100,
Triton 3.7.1), which a 10-minute device call cannot afford across a test matrix. Correctness does not depend on the
config; speed measured with it is a lower bound on fla's."""
import triton.runtime.autotuner as _at

_init = _at.Autotuner.__init__


def _one(self, fn, arg_names, configs, *a, **kw):
    _init(self, fn, arg_names, configs[:1], *a, **kw)


_at.Autotuner.__init__ = _one
