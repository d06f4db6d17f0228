"""The real train.py (accelerate + DeepSpeed, one GPU) beside the bare fwd+bwd step of the same model, one run.

    python bench/bench_train_py.py [--shape llama3.2-3b] [--seq-length 65536] [--ga 1 4] [--steps 3]
                                   [--configs offload opt-offload gpu]

A random-init model of the given shape is saved once (safetensors), with a dataset of packed random tokens;
then `accelerate launch ... train.py` runs `--steps` optimizer steps per (config, GA) with the bench step's
memory options (selective checkpointing, chunked loss, fused ops); the first step (JIT, allocator warm-up) is
not counted. Configs (accelerate_configs/):
  offload      single_node.yaml, 1 process: ZeRO-3, parameters + optimizer offloaded to CPU (the shipped recipe)
  opt-offload  single_gpu.yaml: ZeRO-2, parameters/gradients on the GPU, optimizer (CPU Adam) on the host
  gpu          single_gpu.yaml + zero2_gpu.json: everything on the GPU (torch AdamW), when it fits
The bare step is bench_train_step's "ours" (fwd+bwd only) on the same shape and length. MFU as in
bench_train_step (6N + 6 n_layers L d FLOPs per token).
`--tiny` runs the whole pipeline on CPU with a tiny shape and the CPU config (code-path check, no timings).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # name -> LlamaConfig kwargs
    "llama3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=5e5),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, rope_theta=1e7),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, rope_theta=1e4),
}
CONFIGS = {
    "offload": ["--config_file", "accelerate_configs/single_node.yaml", "--num_processes", "1"],
    "opt-offload": ["--config_file", "accelerate_configs/single_gpu.yaml"],
    "gpu": ["--config_file", "accelerate_configs/single_gpu.yaml",
            "--deepspeed_config_file", "accelerate_configs/zero2_gpu.json"],
    "cpu": ["--config_file", "accelerate_configs/cpu.yaml", "--num_processes", "1"],
}


def make_assets(shape: str, seq_len: int, rows: int, out: str, device: str):
    """Random-init model (bf16 on GPU machines) + packed random-token dataset; returns (model_dir, data_dir)."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=max(seq_len, 4096), **SHAPES[shape])
    model_dir, data_dir = os.path.join(out, "model"), os.path.join(out, "data")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq_len + 1), generator=g)
    Dataset.from_dict({"input_ids": ids.tolist()}).save_to_disk(data_dir)
    return model_dir, data_dir, cfg, n_params


def run_train(config: str, ga: int, steps: int, model_dir, data_dir, seq_len, out_dir):
    cmd = ["accelerate", "launch", *CONFIGS[config], "--main_process_port", str(_free_port()),
           os.path.join(ROOT, "train.py"), "--model", model_dir, "--dataset", data_dir, "--seq-length", str(seq_len),
           "--gradient-accumulate-every", str(ga), "--max-train-steps", str(steps), "--batch-size", "1",
           "--parallel_mode", "zigzag_ring_attn", "--checkpointing", "selective", "--chunked-loss",
           "--learning-rate", "1e-5", "--no-save-model", "--output-dir", out_dir, "--seed", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    log = os.path.join(out_dir, "metrics.jsonl")
    if p.returncode != 0 or not os.path.exists(log):
        tail = (p.stdout + p.stderr)[-3000:]
        return None, f"train.py failed (exit {p.returncode}):\n{tail}"
    with open(log) as f:
        return [json.loads(x) for x in f if x.strip()], None


def _free_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def bare_step(cfg, seq_len):
    """bench_train_step's "ours" on this shape: (seconds, MFU, peak GiB)."""
    import torch
    from bench.bench_train_step import measure
    from bench.llama7b import build_model, one_rank_group
    one_rank_group()
    model = build_model(cfg, torch.device("cuda"))
    r = measure(model, "ours", seq_len, steps=1, device=torch.device("cuda"), warmup=1)
    del model
    torch.cuda.empty_cache()
    return r


def summarize(rows, skip_first=True):
    use = rows[1:] if skip_first and len(rows) > 1 else rows
    t = statistics.median(r["step_time_s"] for r in use)
    mfu = statistics.median(r["mfu"] for r in use)
    mem = max(next(v for k, v in r.items() if k.startswith("peak_mem")) for r in rows)
    return t, mfu, mem, [round(r["loss"], 4) for r in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3.2-3b", choices=sorted(SHAPES))
    ap.add_argument("--seq-length", type=int, default=65536)
    ap.add_argument("--ga", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not counted)")
    ap.add_argument("--configs", nargs="+", default=["offload", "opt-offload", "gpu"], choices=sorted(CONFIGS))
    ap.add_argument("--skip-bare", action="store_true")
    ap.add_argument("--work", default=None, help="assets directory, reused when it already holds them (split a long "
                    "bench over several device calls)")
    ap.add_argument("--tiny", action="store_true", help="CPU code-path check: tiny shape, cpu config")
    args = ap.parse_args()
    import torch
    from bench.common import env_line, table
    if args.tiny:
        args.shape, args.seq_length, args.configs, args.skip_bare = "tiny", 64, ["cpu"], True
        args.ga, args.steps = [1, 2], 2
    elif not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (or --tiny for the CPU code-path check)")
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    print(env_line(), flush=True)
    work = args.work or tempfile.mkdtemp(prefix="bench_train_py_")
    rows_needed = args.steps * max(args.ga)
    stamp = os.path.join(work, f"assets_{args.shape}_{args.seq_length}_{rows_needed}.json")
    if os.path.exists(stamp):
        from transformers import LlamaConfig
        with open(stamp) as f:
            n_params = json.load(f)["n_params"]
        model_dir, data_dir = os.path.join(work, "model"), os.path.join(work, "data")
        cfg = LlamaConfig.from_pretrained(model_dir)
    else:
        model_dir, data_dir, cfg, n_params = make_assets(args.shape, args.seq_length, rows_needed, work, device)
        with open(stamp, "w") as f:
            json.dump({"n_params": n_params}, f)
    if device == "cuda":
        torch.cuda.empty_cache()
    print(f"{args.shape}: {n_params / 1e9:.2f}B params, L={args.seq_length}", flush=True)
    bare_file = os.path.join(work, f"bare_{args.shape}_{args.seq_length}.json")
    if args.skip_bare:
        bare = None
    elif os.path.exists(bare_file):  # measured by an earlier call on the same assets
        with open(bare_file) as f:
            bare = json.load(f)
    else:
        bare = bare_step(cfg, args.seq_length)
        with open(bare_file, "w") as f:
            json.dump({k: v for k, v in bare.items() if not k.startswith("_")}, f)
    bare_mfu = None
    rows = []
    if bare and "MFU" in bare:
        bare_mfu = float(bare["MFU"].rstrip("%")) / 100
        rows.append(dict(run="bare fwd+bwd (bench_train_step ours)", GA="-", step_s=bare["step_s"],
                         tok_s=bare["tok_s"], MFU=bare["MFU"], gpu_peak_GiB=bare["peak_GiB"], vs_bare="1.00"))
        print(rows[-1], flush=True)
    for config in args.configs:
        for ga in args.ga:
            metrics, err = run_train(config, ga, args.steps, model_dir, data_dir, args.seq_length,
                                     os.path.join(work, f"run_{config}_{ga}"))
            if err:
                rows.append(dict(run=f"train.py {config}", GA=ga, step_s="error", tok_s=err.splitlines()[-1][:80]))
                print(err, flush=True)
                continue
            t, mfu, mem, losses = summarize(metrics)
            rows.append(dict(run=f"train.py {config}", GA=ga, step_s=f"{t:.2f}", tok_s=f"{ga * args.seq_length / t:.0f}",
                             MFU=f"{100 * mfu:.1f}%", gpu_peak_GiB=f"{mem:.1f}",
                             vs_bare=f"{mfu / bare_mfu:.2f}" if bare_mfu else "", losses=losses))
            print(rows[-1], flush=True)
            assert all(x == x and abs(x) < 1e4 for x in losses), f"non-finite loss in {config} GA {ga}: {losses}"
    print(f"\n## train.py vs the bare step, {args.shape}, L={args.seq_length}, one GPU\n")
    print(table(rows, ["run", "GA", "step_s", "tok_s", "MFU", "gpu_peak_GiB", "vs_bare"]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_train_py.json"), "w") as f:
            json.dump(dict(env=env_line(), shape=args.shape, L=args.seq_length, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
