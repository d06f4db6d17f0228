#!/usr/bin/env bash
# The H200 measurements still owed by open issues (#8, #9, and #3's 512K row), packed into two device calls
# of < 10 minutes each (the device image has torch + transformers only; PYTHONPATH=. is enough):
#   bash bench/h200_pending.sh 1   # train step 16K..128K with a warm-up, fused-op check, layer split (~7 min)
#   bash bench/h200_pending.sh 2   # memory: hf vs ours vs ours-off to 256K + one optimizer step (~9 min)
#   bash bench/h200_pending.sh 3   # ring sim at 512K (W=2,4,8) + memory probes 512K..1M (~7 min)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp}
case "${1:-1}" in
  1)
    python3 bench/bench_train_step.py --lengths 16384 32768 65536 131072 --steps 1 --warmup 1 2>&1 | grep -v Warn | tee "$OUT/train_step.log" | tail -32
    ;;
  2)
    python3 bench/bench_memory.py --ours-lengths 32768 65536 131072 262144 --probe-lengths --budget-s 530 2>&1 \
      | grep -v Warn | tee "$OUT/memory.log" | tail -24
    ;;
  3)
    python3 bench/bench_ring_sim.py --lengths 524288 --worlds 2 4 8 --modes zigzag --iters 1 2>&1 | tee "$OUT/ring_sim_512k.log" | tail -6
    python3 bench/bench_memory.py --hf-lengths --ours-lengths 32768 --off-lengths --opt-length 0 --budget-s 380 2>&1 \
      | grep -v Warn | tee "$OUT/memory_probe.log" | tail -12
    ;;
  *) echo "usage: $0 1|2|3" >&2; exit 2 ;;
esac
