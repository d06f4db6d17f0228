"""Probe the aten SDPA ops' Python signatures on this GPU (dev tool for the kernel facade)."""
import traceback

import torch

aten = torch.ops.aten
B, L, H, D = 1, 256, 4, 64
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
do = torch.randn_like(q)


def show(name, res):
    print(name, [(type(r).__name__, tuple(r.shape) if isinstance(r, torch.Tensor) else r,
                  str(r.dtype) if isinstance(r, torch.Tensor) else "") for r in res])


def ref():
    qq, kk, vv = (t.float().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    o.backward(do.float())
    return o, qq.grad


ro, rdq = ref()
for name, qq, kk, vv in (("contig", q, k, v), ("bshd-view", *(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)))):
    try:
        res = aten._scaled_dot_product_cudnn_attention(qq, kk, vv, None, True, 0.0, True, False, scale=None)
        show(f"cudnn fwd {name}", res)
        o, lse, csq, csk, mq, mk, seed, off, dbg = res
        for variant in ("same", "empty"):
            try:
                if variant == "same":
                    g = aten._scaled_dot_product_cudnn_attention_backward(do, qq, kk, vv, o, lse, seed, off, None, csq, csk, mq, mk, 0.0, True, scale=None)
                else:
                    e = torch.empty(0, device="cuda")
                    g = aten._scaled_dot_product_cudnn_attention_backward(do, qq, kk, vv, o, lse, seed, off, e, e, e, L, L, 0.0, True, scale=None)
                print(f"cudnn bwd {name} {variant} OK dq err", ((g[0].float() - rdq).norm() / rdq.norm()).item())
            except Exception:
                print(f"cudnn bwd {name} {variant} FAIL", traceback.format_exc()[-600:])
    except Exception:
        print(f"cudnn fwd {name} FAIL", traceback.format_exc()[-1200:])
    try:
        res = aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, True, False, scale=None)
        show(f"flash fwd {name}", res)
        o, lse, csq, csk, mq, mk, rng, unused, dbg = res
        g = aten._scaled_dot_product_flash_attention_backward(do, qq, kk, vv, o, lse, csq, csk, mq, mk, 0.0, True, rng, unused, scale=None)
        print(f"flash bwd {name} same OK dq err", ((g[0].float() - rdq).norm() / rdq.norm()).item())
        e32 = torch.empty(0, dtype=torch.int32, device="cuda")
        g = aten._scaled_dot_product_flash_attention_backward(do, qq, kk, vv, o, lse, e32, e32, L, L, 0.0, True, rng, unused, scale=None)
        print(f"flash bwd {name} e32 OK dq err", ((g[0].float() - rdq).norm() / rdq.norm()).item())
    except Exception:
        print(f"flash {name} FAIL", traceback.format_exc()[-800:])
