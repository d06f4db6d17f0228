"""Hugging Face integration: route a model's attention through a sequence-parallel mode.

    patch.py      apply_seq_parallel_monkey_patch (a family string or a model instance), the transformers
                  version guard, the mask builders that refuse padding
    attention.py  the function registered with transformers' AttentionInterface (groups bound, packed documents,
                  layout check)
    config.py     model config facts shared by training and evaluation (RoPE theta)

``from easy_context.hf import apply_seq_parallel_monkey_patch`` is the public path.
"""
from .._lazy import lazy_attrs
from .config import get_rope_theta, set_rope_theta

# patch.py and attention.py import transformers: loaded on first use, so config.py stays light (train.py, evals)
__getattr__ = lazy_attrs(__name__, {
    "make_attention_fn": ".attention",
    **dict.fromkeys(("FAMILIES", "SEQ_ALGOS", "_check_mask", "apply_seq_parallel_monkey_patch",
                     "check_transformers_compat"), ".patch")})

__all__ = ["apply_seq_parallel_monkey_patch", "make_attention_fn", "check_transformers_compat", "FAMILIES",
           "SEQ_ALGOS", "get_rope_theta", "set_rope_theta"]
