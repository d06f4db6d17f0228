"""EasyContext: sequence-parallel long-context training for Hugging Face causal LMs.

    from easy_context import prepare_seq_parallel_inputs, apply_seq_parallel_monkey_patch
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
    prepared = prepare_seq_parallel_inputs("zigzag_ring_attn", input_ids, position_ids, target_ids,
                                           rank, world_size, device)

Modes (``SEQ_ALGOS``): data_parallel, zigzag_ring_attn, dist_flash_attn, ulysses_attn, usp_attn; each is a ``Mode``
(easy_context/mode.py) named in registry.py, and ``register_mode("package.module:Class")`` adds one at run time.
The object form: ``layout = ParallelLayout.build(mode, sp_size=..., ring_degree=...)`` then
``apply_seq_parallel_monkey_patch(model, layout)``, ``layout.prepare_inputs(...)``, ``prepare_dataloader(dl, layout)``.
Every name is imported on first use: ``import easy_context`` (and ``easy_context_train.args``, which
train.py parses flags with) loads neither torch nor transformers, so a bad flag fails in milliseconds, and
no CUDA or optional package is touched at import.
"""
from .registry import SEQ_ALGOS

_LAZY = {
    "prepare_seq_parallel_inputs": "easy_context.api",
    "seq_multiple": "easy_context.api",
    "shard_sequence": "easy_context.api",
    "unshard_sequence": "easy_context.api",
    "apply_seq_parallel_monkey_patch": "easy_context.hf",
    "zigzag_ring_attn_func": "easy_context.zigzag_ring_attn",
    "dist_flash_attn_func": "easy_context.dist_flash_attn",
    "ulysses_attn_func": "easy_context.ulysses_attn",
    "usp_attn_func": "easy_context.usp",
    "prepare_dataloader": "easy_context.data",
    "ParallelLayout": "easy_context.parallel_layout",
    "Mode": "easy_context.mode",
    "register_mode": "easy_context.registry",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'easy_context' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["SEQ_ALGOS", "apply_seq_parallel_monkey_patch", "prepare_seq_parallel_inputs", "shard_sequence",
           "unshard_sequence", "seq_multiple", "prepare_dataloader", "zigzag_ring_attn_func",
           "dist_flash_attn_func", "ulysses_attn_func", "usp_attn_func", "ParallelLayout", "Mode", "register_mode"]
