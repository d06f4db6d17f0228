"""On a GPU: a real CUDA out-of-memory in train.py ends with one line (exit 3) naming the length, the options and
what ``python -m easy_context plan`` suggests, not a CUDA traceback (docs/faults.md; CPU tests inject the error).

    python bench/fault_oom_gpu.py [--shape llama3.2-3b] [--seq-length 262144]

A random-init model of the shape (bench_train_py's assets), then plain ``python train.py`` (one process, torch
AdamW, no DeepSpeed) in data_parallel mode without activation checkpointing: far beyond one H200's memory. Prints
train.py's exit status, its error line and whether a traceback leaked; exit 0 when the fault was reported as
designed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.bench_train_py import ROOT, SHAPES, make_assets  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3.2-3b", choices=sorted(SHAPES))
    ap.add_argument("--seq-length", type=int, default=262144)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fault_oom_")
    model_dir, data_dir, _, n_params = make_assets(args.shape, args.seq_length, 2, work, "cuda")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model_dir, "--dataset", data_dir,
           "--seq-length", str(args.seq_length), "--parallel_mode", "data_parallel", "--checkpointing", "none",
           "--gradient-accumulate-every", "1", "--max-train-steps", "2", "--no-save-model",
           "--output-dir", os.path.join(work, "out")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("train.py: error:")]
    leaked = "Traceback" in p.stderr
    print(f"{args.shape} ({n_params / 1e9:.2f}B), L={args.seq_length}: train.py exit {p.returncode}, "
          f"traceback leaked: {leaked}")
    print("\n".join(lines) or p.stderr[-3000:])
    return 0 if p.returncode == 3 and len(lines) == 1 and "out of GPU memory" in lines[0] and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
