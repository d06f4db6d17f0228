"""Peak GPU memory of an eval_ppl-style forward: chunked LM head + NLL (ours) vs ``model(..., labels=)``.

    python bench/bench_eval_memory.py                       # 7B shape (Llama-2), 128K tokens, bf16, one GPU
    python bench/bench_eval_memory.py --seq-len 32768 --layers 4     # quick look

Random bf16 weights (no download), one sequence of random token ids, ``torch.inference_mode``. Three runs in
one process, peak memory reset before each:
  decoder   the decoder alone (final hidden states): the floor any perplexity path needs
  ours      ``SeqParallelLM(model, "data_parallel").nll`` — exactly eval_ppl's path: decoder, then LM head +
            cross-entropy on chunks of scored tokens (never a tokens x vocab tensor)
  labels=   ``model(input_ids, labels=labels)`` — full-vocabulary logits (+ fp32 upcast) as HF computes them
Needs only torch + transformers (no deepspeed/datasets/wandb). Prints one JSON line per run and a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-tokens", type=int, default=None, help="LM-head chunk (default ~256 MiB of fp32 logits)")
    p.add_argument("--skip-baseline", action="store_true")
    return p.parse_args()


def gib(x: int) -> float:
    return round(x / 2**30, 2)


def measure(name, fn, device):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            value = fn()
        torch.cuda.current_stream(device).synchronize()  # timing only, outside any hot loop
        status = "ok"
    except torch.OutOfMemoryError:
        value, status = None, "out of memory"
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device)
    rec = {"run": name, "status": status, "peak_gib": gib(peak), "above_weights_gib": gib(peak - before),
           "seconds": round(dt, 2), "value": value}
    print(json.dumps(rec), flush=True)
    return rec


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_eval_memory.py needs a CUDA GPU (peak memory is measured with torch.cuda); none found")
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from easy_context.inference import SeqParallelLM

    device = torch.device("cuda", 0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=args.seq_len, rope_theta=1e7)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly (no fp32 copy of 7B weights)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(args.vocab, (1, args.seq_len), device=device)
    labels = ids.clone()
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # what labels= shifts to
    print(json.dumps({"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                      "transformers": transformers.__version__, "params_b": round(n_params / 1e9, 2),
                      "seq_len": args.seq_len, "layers": args.layers, "vocab": args.vocab,
                      "weights_gib": gib(torch.cuda.memory_allocated(device)),
                      "date": time.strftime("%Y-%m-%d")}), flush=True)

    recs = [measure("decoder", lambda: tuple(model.model(input_ids=ids, use_cache=False).last_hidden_state.shape),
                    device)]
    engine = SeqParallelLM(model, "data_parallel", chunk_tokens=args.chunk_tokens)

    def ours():
        s, c = engine.nll(ids, targets)
        return s / c
    recs.append(measure("ours", ours, device))
    engine.close()  # back to sdpa for the baseline
    if not args.skip_baseline:
        recs.append(measure("labels=", lambda: model(input_ids=ids, labels=labels, use_cache=False).loss.item(),
                            device))
    by = {r["run"]: r for r in recs}
    summary = {"summary": True, **{f"peak_gib_{k}": v["peak_gib"] for k, v in by.items()}}
    if "labels=" in by and by["labels="]["status"] == "ok" and by["ours"]["status"] == "ok":
        summary["saved_gib"] = round(by["labels="]["peak_gib"] - by["ours"]["peak_gib"], 2)
        summary["nll_ours"], summary["nll_labels"] = by["ours"]["value"], by["labels="]["value"]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
