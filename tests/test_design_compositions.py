"""DESIGN §2's compositions, as written there (issue #61): a model patched with a ``ParallelLayout`` and inputs cut by
the plain ``prepare_seq_parallel_inputs(mode, ..., ring_degree=)`` call, packed rows, ``model(local_input_ids,
position_ids=local_position_ids)`` with no other argument — exact against each document run alone."""
from __future__ import annotations

import torch

from tests.harness import run_ranks

PACKED = torch.cat([torch.arange(13), torch.arange(30), torch.arange(21)]).unsqueeze(0)


def _usp_layout_plain_cut(rank, world_size):
    from easy_context import ParallelLayout
    from tests.model_equiv import check_model_equivalence
    layout = ParallelLayout.build("usp_attn", sp_size=4, ring_degree=2)
    for family in ("llama", "gpt_oss"):
        check_model_equivalence(rank, world_size, "usp_attn", family, seq_len=64, layout_kw={"ring_degree": 2},
                                groups={"layout": layout}, sp_group=layout.sp_group, position_ids=PACKED,
                                dispatch=None)


def test_usp_layout_patch_with_plain_cut_of_packed_rows_4_ranks():
    run_ranks(_usp_layout_plain_cut, 4, timeout=300)
