"""DeepSpeed ZeRO-3 and the chain: refused for now, with a clear error (never a hang or a wrong result).

Only the rank running a piece executes the layer, so nothing inside a piece may be collective; ZeRO-3 gathers a
module's partitioned parameters in forward hooks (an all-gather over the data-parallel group) and hands the
gradients back to partitioned parameters. Tried on CPU (DeepSpeed 0.19.8): gathering the layer once around the
chain (GatheredParameters, submodule hooks set aside) gets the forward right but the gradients returned to the
then re-partitioned parameters fail ("size of tensor a (0) must match the size of tensor b (64)"); marking the layer
a ZeRO-3 leaf module (``_z3_leaf``) fails the same way even on one process. Plain autograd through the layer (one
piece: data_parallel's document resets, an sp mode on one rank) is unaffected and works under ZeRO-3
(train.py, 1 process, cpu.yaml: the same losses as without DeepSpeed)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def gathered(layer):
    if any(hasattr(p, "ds_id") for p in layer.parameters()):
        raise RuntimeError(f"{type(layer).__name__}: DeepSpeed ZeRO-3 is not supported yet for the sequence-parallel "
                           "recurrent layers across ranks (issue #30, easy_context/recurrent/zero3.py); use ZeRO-2 "
                           "(accelerate_configs/zero2_*.json) or no DeepSpeed (plain DDP)")
    yield
