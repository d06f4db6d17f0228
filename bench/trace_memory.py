"""What is alive at the memory peak of one training step: a device-free census of tensor storages.

    python bench/trace_memory.py                       # CPU, Llama-7B proportions at d=512, L=8192 and 16384
    python bench/trace_memory.py --config ours-off --hidden 1024

A ``TorchDispatchMode`` records every storage an op creates (forward, recomputation and backward), with the
op and the autograd node or module that made it, and tracks the live total after each op. The peak's live
set minus what is proportional to the weights (parameter grads) is the per-token working set; it is
printed grouped by origin in bytes/token, scaled to d=4096 (7B) by ``4096 / hidden``. Kernel workspaces
that never become tensors (cuDNN's) are invisible here: the GPU number (bench_memory.py) is the truth,
this says where it goes. Host (offload) chunks are excluded. Two lengths give the slope directly.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.common import table  # noqa: E402


class StorageCensus(TorchDispatchMode):
    """Live bytes of storages created under the mode; the live set at the highest point."""

    def __init__(self, known=()):
        super().__init__()
        self.live: dict[int, tuple] = {}
        self.known = set(known)  # storages that existed before (weights, buffers): views of them are free
        self.peak, self.at_peak = 0, []
        self.where: list[str] = []  # module path stack (forward / recomputation)

    def _origin(self, func) -> str:
        node = torch._C._current_autograd_node()
        where = node.name() if node is not None else (self.where[-1] if self.where else "-")
        return f"{where}:{func.__name__.split('.')[0]}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                old = self.live.get(ptr)
                if st.nbytes() and ptr not in self.known and (old is None or old[0].expired()):
                    self.live[ptr] = (StorageWeakRef(st), st.nbytes(), self._origin(func))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        sizes = {k: _nbytes(v[0]) for k, v in self.live.items()}  # now: a storage may have been resized
        total = sum(sizes.values())
        if total > self.peak:
            self.peak, self.at_peak = total, [(k, sizes[k], v[2]) for k, v in self.live.items() if sizes[k]]
        return out


def _nbytes(ref: StorageWeakRef) -> int:
    st = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return st.nbytes()


def _module_hooks(model, census: StorageCensus):
    names = {m: n or "model" for n, m in model.named_modules()}

    def pre(m, *_):
        census.where.append(names.get(m, type(m).__name__).split(".")[-1] if m in names else type(m).__name__)

    def post(m, *_):
        if census.where:
            census.where.pop()
    return [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]


def run(args, L):
    from bench.bench_memory import configure, fwd_bwd  # the same configurations as the GPU benchmark
    from bench.llama7b import build_model, one_rank_group
    from transformers import LlamaConfig
    from easy_context import loss as loss_mod
    from easy_context.memory import offload as offload_mod
    from easy_context.ops import rms_norm
    one_rank_group()
    d = args.hidden
    cfg = LlamaConfig(hidden_size=d, intermediate_size=int(d * 11008 / 4096), num_hidden_layers=args.layers,
                      num_attention_heads=d // 128, num_key_value_heads=d // 128, vocab_size=32000,
                      max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    model.to(torch.bfloat16)
    # offload keeps one input per k layers on the host: a host budget of 1/k of all inputs makes bench_memory pick k
    host_gib = args.layers * L * d * 2 / 2**30 / args.every_k * 1.001 if args.every_k > 1 else 1e9
    ns = argparse.Namespace(checkpointing=args.checkpointing, every_k=args.every_k,
                            selective_layers=args.selective_layers, host_gib=host_gib,
                            probe_host_gib=1e9,
                            tiles="auto", selective=args.selective, no_lean_norm=args.no_lean_norm,
                            no_fused_rope=args.no_fused_rope, head_chunks=args.head_chunks)
    configure(model, args.config, L, ns)
    host = set()
    orig_new = offload_mod.HostPool._new

    def new(self):
        t = orig_new(self)
        host.add(t.untyped_storage().data_ptr())
        return t
    offload_mod.HostPool._new = new
    # the loss chunk is a constant (~0.5 GB at any length on the GPU); shrink it so that, as at 7B scale,
    # the decoder's per-token working set and not the loss chunk makes the peak
    orig_chunk = loss_mod.default_chunk_size
    loss_mod.default_chunk_size = lambda vocab: args.loss_chunk
    # likewise eager row chunks: 16K rows of a 128K sequence at 7B -> the same fraction of L here
    orig_rows = rms_norm.row_chunks
    rms_norm.row_chunks = lambda n, d: orig_rows(n, d, max(1, L * 16384 // 131072) * d)
    census = StorageCensus(known=[t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())])
    hooks = _module_hooks(model, census)
    try:
        with census:
            fwd_bwd(model, args.config, L, torch.device("cpu"))
    finally:
        offload_mod.HostPool._new = orig_new
        loss_mod.default_chunk_size = orig_chunk
        rms_norm.row_chunks = orig_rows
        for h in hooks:
            h.remove()
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    # the live set at the peak without host (offload) chunks and parameter grads (per weight, not per token)
    working = [(b, o) for k, b, o in census.at_peak if k not in host and k not in grads]
    return working


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="ours", choices=["ours", "ours-off", "hf"])
    ap.add_argument("--checkpointing", default="offload", choices=["offload", "nested", "layer", "selective"])
    ap.add_argument("--selective", action="store_true")
    ap.add_argument("--no-lean-norm", action="store_true")
    ap.add_argument("--no-fused-rope", action="store_true")
    ap.add_argument("--head-chunks", type=int, default=1, help="attention blocks in head groups (memory/head_chunks)")
    ap.add_argument("--every-k", type=int, default=1, help="offload/nested: one kept input per k layers")
    ap.add_argument("--selective-layers", type=int, default=None, help="layers keeping their attention output")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs=2, default=[8192, 16384])
    ap.add_argument("--loss-chunk", type=int, default=256, help="tokens per LM-head/loss chunk")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    scale = 4096 / args.hidden
    peaks = []
    for L in args.lengths:
        working = run(args, L)
        peaks.append((L, sum(b for b, _ in working)))
    L1, p1 = peaks[0]
    L2, p2 = peaks[1]
    slope = (p2 - p1) / (L2 - L1) * scale / 1024
    print(f"{args.config}: live at the peak (grads, host chunks excluded) {p1 / 2**20:.1f} MiB at L={L1}, "
          f"{p2 / 2**20:.1f} MiB at L={L2}; {p2 / L2 * scale / 1024:.1f} KB/token at L={L2}, slope {slope:.1f} "
          f"KB/token at d=4096 (x{scale:g} from d={args.hidden}; the slope only means something when both peaks "
          "are in the same place)")
    groups = collections.Counter()
    for nbytes, origin in working:
        groups[origin] += nbytes
    rows = [dict(origin=o, MiB=f"{b / 2**20:.1f}", KB_per_token_7B=f"{b / L2 * scale / 1024:.1f}")
            for o, b in groups.most_common(args.top)]
    print(f"\n## Live at the peak, L={L2}, by origin (scaled to d=4096)\n")
    print(table(rows, ["origin", "MiB", "KB_per_token_7B"]))


if __name__ == "__main__":
    main()
