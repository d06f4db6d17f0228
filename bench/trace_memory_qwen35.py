"""What is alive at the memory peak of one training step of the Qwen3.5-9B-shape stack (bench_hybrid --model), on
CPU: bench/trace_memory.py's storage census on the stack at 1/8 of the widths (head dim 256 kept), grouped by the
module that made each tensor and scaled back to 9B widths in KB/token.

    python bench/trace_memory_qwen35.py                       # the attention-only twin, 2048 tokens, lean norms
    python bench/trace_memory_qwen35.py --no-lean-norm        # HF's (1 + w) RMSNorms (fp32 upcasts kept)
    python bench/trace_memory_qwen35.py --stack hybrid --checkpointing offload

Kernel workspaces that never become tensors are invisible and CPU attention is PyTorch's CPU flash kernel, so
the GPU peak (bench_hybrid.py --model) is the truth; this says where it goes. ``B`` rows were made in backward
(the recompute and the gradients), ``F`` rows in the forward.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import table  # noqa: E402
from bench.trace_memory import StorageCensus, _module_hooks  # noqa: E402

SCALE = 8  # widths / SCALE of Qwen3.5-9B


class ModuleCensus(StorageCensus):
    def _origin(self, func) -> str:
        node = torch._C._current_autograd_node()
        where = ".".join(self.where[-2:]) if self.where else "-"
        return f"{'B' if node is not None else 'F'} {where}:{func.__name__.split('.')[0]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stack", choices=["twin", "hybrid"], default="twin")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--checkpointing", default="layer")
    ap.add_argument("--lean-norm", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args(argv)
    import transformers as tf

    from bench.llama7b import build_model, one_rank_group
    from easy_context import apply_seq_parallel_monkey_patch
    from easy_context import loss as loss_mod
    from easy_context.loss import causal_lm_loss
    from easy_context.memory import configure_memory
    one_rank_group()
    twin, L = args.stack == "twin", args.length
    kw = dict(hidden_size=4096 // SCALE, intermediate_size=12288 // SCALE, num_attention_heads=2, num_key_value_heads=1,
              head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
              linear_value_head_dim=128, vocab_size=4096)
    types = ["full_attention" if twin or i % 4 == 3 else "linear_attention" for i in range(4)]
    cfg = tf.Qwen3_5TextConfig(num_hidden_layers=4, layer_types=types, linear_conv_kernel_dim=4,
                               max_position_embeddings=1 << 20, **kw)
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu")).to(torch.bfloat16)
    if twin:
        model.config.model_type = "qwen3"  # as bench_hybrid: the twin has no recurrent layer
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    configure_memory(model, checkpointing=args.checkpointing, tiled_mlp=args.checkpointing == "offload",
                     lean_norm=args.lean_norm, recurrent_tiles=1 if twin else 4)
    loss_mod.default_chunk_size = lambda vocab: 256  # the loss chunk is a constant: keep it out of the peak
    ids = torch.randint(0, cfg.vocab_size, (1, L + 1))
    census = ModuleCensus(known=[t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())])
    hooks = _module_hooks(model, census)
    with census:
        causal_lm_loss(model, ids[:, :-1], torch.arange(L)[None], ids[:, 1:]).backward()
    for h in hooks:
        h.remove()
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    working = [(b, o) for k, b, o in census.at_peak if k not in grads]
    total = sum(b for b, _ in working)
    print(f"{args.stack}, L={L}, checkpointing {args.checkpointing}, {'lean' if args.lean_norm else 'HF'} norms: "
          f"live at the peak {total / 2**20:.1f} MiB = {total / L * SCALE / 1024:.1f} KB/token at 9B widths")
    groups = collections.Counter()
    for nbytes, origin in working:
        groups[origin] += nbytes
    print(table([dict(origin=o, MiB=f"{b / 2**20:.1f}", KB_per_token_9B=f"{b / L * SCALE / 1024:.1f}")
                 for o, b in groups.most_common(args.top)], ["origin", "MiB", "KB_per_token_9B"]))


if __name__ == "__main__":
    main()
