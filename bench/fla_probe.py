"""First calls of fla's chunk_gated_delta_rule (bf16 and fp32, fwd and bwd) with stage timings, and a faulthandler
stack every 40 s: where a GPU machine's first fla call spends its time (issue #49). Run with /tmp/fla-site on
PYTHONPATH (bench/gpu_hybrid_fla.sh unpacks it there)."""
import faulthandler, sys, time
faulthandler.dump_traceback_later(40, repeat=True, file=sys.stderr)
t0 = time.time()
def say(m): print(f"[{time.time()-t0:7.1f}s] {m}", flush=True)
import torch
say("torch")
import fla
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
say("fla import")
T, H, K = 1024, 4, 64
q, k, v = (torch.randn(1, T, H, K, device="cuda", requires_grad=True) for _ in range(3))
g = (-0.1 * torch.rand(1, T, H, device="cuda")).requires_grad_()
b = torch.rand(1, T, H, device="cuda").requires_grad_()
for dt in (torch.bfloat16, torch.float32):
    o, s = chunk_gated_delta_rule(q.to(dt), k.to(dt), v.to(dt), g, b.to(dt), output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize(); say(f"fwd {dt}")
    o.float().sum().backward(); torch.cuda.synchronize(); say(f"bwd {dt}")
