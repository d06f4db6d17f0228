"""Mode name -> (layout, attention). Adding a sequence-parallel mode is one entry here.

layout: a module with ``shard(x, rank, world_size, dim, **kw)``, ``unshard(shards, dim, **kw)`` and
``seq_multiple(world_size, **kw)``. attention: ``"package.module:function"`` taking
``(q, k, v, dropout_p, softmax_scale, causal, **groups)`` in the (B, S_local, H, D) layout, imported on
first use (no import-time side effects, no CUDA touched at import).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class SeqAlgo:
    name: str
    layout: str                  # module path of the layout
    attention: str | None        # "module:function", None = plain (unpatched) attention
    group_kwargs: tuple[str, ...] = ("group",)
    degree_kwargs: tuple[str, ...] = ()  # layout kwargs besides the sp size (usp: ring_degree)

    def layout_kw(self, **degrees) -> dict:
        """The layout kwargs of this mode from the degrees given (``ring_degree=``); others are dropped."""
        return {k: degrees[k] for k in self.degree_kwargs if degrees.get(k) is not None}

    def layout_module(self) -> ModuleType:
        return importlib.import_module(self.layout)

    def attention_fn(self):
        if self.attention is None:
            return None
        mod, fn = self.attention.split(":")
        return getattr(importlib.import_module(mod), fn)


_P = "easy_context"
REGISTRY: dict[str, SeqAlgo] = {
    "data_parallel": SeqAlgo("data_parallel", f"{_P}.data_parallel.layout", None, ()),
    "zigzag_ring_attn": SeqAlgo("zigzag_ring_attn", f"{_P}.zigzag_ring_attn.layout",
                                f"{_P}.zigzag_ring_attn:zigzag_ring_attn_func"),
    "dist_flash_attn": SeqAlgo("dist_flash_attn", f"{_P}.dist_flash_attn.layout",
                               f"{_P}.dist_flash_attn:dist_flash_attn_func"),
    "ulysses_attn": SeqAlgo("ulysses_attn", f"{_P}.ulysses_attn.layout",
                            f"{_P}.ulysses_attn:ulysses_attn_func"),
    "usp_attn": SeqAlgo("usp_attn", f"{_P}.usp.layout", f"{_P}.usp:usp_attn_func",
                        ("ring_group", "ulysses_group"), ("ring_degree",)),
}
SEQ_ALGOS: tuple[str, ...] = tuple(REGISTRY)


def get_algo(seq_algo: str) -> SeqAlgo:
    try:
        return REGISTRY[seq_algo]
    except KeyError:
        raise ValueError(f"unknown sequence-parallel mode {seq_algo!r}; valid modes: {', '.join(SEQ_ALGOS)}") from None
