#!/usr/bin/env bash
# The FA4 measurements on one H200, in back-to-back device calls (the machine keeps /tmp while warm, 30 s):
#   bash bench/h200_fa4.sh keep      # call 1, carry .fa4a: park the first half of the CUTLASS DSL wheel
#   bash bench/h200_fa4.sh install   # call 2, carry .fa4b: join the halves, install FA4 into /tmp/site
#   bash bench/h200_fa4.sh kernels   # GPU tests of the facade (fa4 incl. varlen), bench_kernels, JIT/cache, 512K ring sim
#   bash bench/h200_fa4.sh step      # bench_train_step 16K..128K: ours(fa4) vs ours(cudnn) vs plain HF
#   bash bench/h200_fa4.sh packed    # GPU tests of document masking (fa4 varlen) + bench_packed 128K/512K W=8
#   bash bench/h200_fa4.sh dispatch-rects [L...]  # bench_packed default picks, one dense call per rectangle (default)
#                                    # vs a block's rectangles of <= RECTS_MAX score elements in one varlen call
#   bash bench/h200_fa4.sh calibrate [L...]  # bench/packed_calibrate.py: the rank-time model fitted on the seed-0 rows,
#                                    # then dispatch/plan.py's pick vs the fitted model's pick on rows of seeds 1-3
#   bash bench/h200_fa4.sh dispatch [L...]  # bench_packed: dispatch (old solver pick, fastest-predicted pick, the default
#                                    # pick with dispatch.pick's balance rule, old m=2,4,8) vs zigzag and the k-pair
#                                    # default, same rows/seed; default L = 131072 524288
#   bash bench/h200_fa4.sh dispatch-pick [L...]  # bench_packed's picks (fastest-predicted, first-search, the default:
#                                    # balance rule + deeper search) and the default ring layout, ROUNDS=5; L = 131072;
#                                    # rows SEEDS="0 2 3 5" (2, 3, 5: where the deeper search changes the pick)
#   bash bench/h200_fa4.sh dispatch-window [L...]  # bench_packed --window 4096 (WINDOW=): every layer windowed; the
#                                    # picks planned with the window vs the window-blind pick, ROUNDS=3; L = 131072
#   bash bench/h200_fa4.sh trainpy-a # the real train.py (3B shape, 32K): bare step + ZeRO-3 offload at GA 1 and 4
#   bash bench/h200_fa4.sh trainpy-b # same assets: all-on-GPU ZeRO-2 config at GA 1 and 4
#   bash bench/h200_fa4.sh lora      # bench_lora: LoRA vs full fine-tuning, 7B shape at 128K (peak memory, tok/s)
#   bash bench/h200_fa4.sh window    # GPU tests of windows / fa4 head groups / offload, bench_kernels --window 4096 at
#                                    # 128K, bench_memory ours at 64K and 128K (KB/token)
#   bash bench/h200_fa4.sh mistral   # Mistral-7B-shape step at 128K: sliding window 4096 vs full attention
#   bash bench/h200_fa4.sh hybrid    # carry .tf524 (transformers 5.24 wheel): bench_hybrid at 32K and 128K (one layer)
#   bash bench/h200_fa4.sh timeline  # bench_memory --auto --timeline at 128K: offload copies vs compute, stalls
#   bash bench/h200_fa4.sh heads [N] # head-chunked attention (N=8 groups) vs none: KB/token, tok/s at 64K/128K
#   bash bench/h200_fa4.sh heads-1m [N]  # the 1M memory probe (k=3, ~88 GiB host) with N head groups
#   bash bench/h200_fa4.sh m1m-layers [N]  # a real 1M-token fwd+bwd (full causal attention, --auto) through N=4
#                                    # decoder layers of the 7B shape: per-layer time and memory within one call
#   bash bench/h200_fa4.sh m1m-group   # the 32-layer 1M configuration (offload k=3, 8 head groups) on one nested
#                                    # group of 3 decoder layers: x32/3 is the full step the plan predicts (~2120 s)
#   bash bench/h200_fa4.sh m512-start [N]  # N (default 1) real 7B fwd+bwd at 512K in one process (--auto: k and
#                                    # selective layers from the budgets), detached (setsid: it outlives the call,
#   bash bench/h200_fa4.sh m512-wait N   #   ~10 min, over one call's limit); wait up to N s, copy its log to $OUT
# install also installs .whl/ (deepspeed, datasets: bash ../shared/tools/device_wheels.sh ds) when carried.
# Wheels: bash ../shared/tools/device_wheels.sh fa4 (fills .fa4a/.fa4b, both git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
OUT=${OUT:-/tmp}
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True EASY_CONTEXT_FA4_CACHE=/tmp/fa4cache
case "${1:-}" in
  keep) mkdir -p /tmp/keep && cp .fa4a/part.aa /tmp/keep/ && nvidia-smi --query-gpu=name,memory.used --format=csv ;;
  install)
    cat /tmp/keep/part.aa .fa4b/part.ab > "/tmp/keep/$CU13"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "/tmp/keep/$CU13" .fa4b/*.whl
    if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
    python3 -c "from easy_context.kernels import fa4; print('fa4 usable:', fa4.usable(0))" ;;
  kernels)
    python3 -m pytest -q -p no:cacheprovider tests/test_fa4_backend.py tests/test_kernels.py 2>&1 | tail -5 || true
    python3 bench/bench_kernels.py 2>&1 | grep -v Warn | tee "$OUT/kernels.log" | tail -24
    python3 bench/bench_fa4_jit.py 2>&1 | tee "$OUT/fa4_jit.log" | tail -9
    python3 bench/bench_ring_sim.py --lengths 524288 --worlds 8 --modes zigzag --iters 1 2>&1 | tee "$OUT/ring_sim.log" | tail -4 ;;
  step)
    python3 bench/bench_train_step.py --lengths 16384 32768 65536 131072 --steps 1 --warmup 1 --compare-cudnn 2>&1 \
      | grep -v Warn | tee "$OUT/train_step.log" | tail -34 ;;
  packed)
    python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_packed.py tests/test_fa4_backend.py -k "gpu or varlen or facade" 2>&1 | tail -4 || true
    python3 bench/bench_packed.py --lengths 131072 524288 --world 8 --pairs 1 8 16 2>&1 | grep -v Warn | tee "$OUT/packed.log" | tail -30 ;;
  dispatch)
    shift
    python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_fa4_backend.py -k "varlen" 2>&1 | tail -3 || true
    python3 bench/bench_packed.py --lengths ${@:-131072 524288} --world 8 --per-rank 2 4 8 --rounds ${ROUNDS:-3} 2>&1 | grep -v Warn \
      | tee "$OUT/packed_dispatch_${1:-all}.log" | tail -40 ;;
  dispatch-pick)
    shift
    python3 bench/bench_packed.py --lengths ${@:-131072} --world 8 --rounds ${ROUNDS:-5} --seeds ${SEEDS:-0 2 3 5} \
      2>&1 | grep -v Warn | tee "$OUT/packed_pick.log" | grep -A40 "^## Simulated" ;;
  dispatch-window)
    shift  # every layer windowed (4096, Mistral v0.1): the picks planned with the window vs the window-blind pick
    python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_fa4_backend.py -k "varlen" 2>&1 | tail -3 || true
    python3 bench/bench_packed.py --lengths ${@:-131072} --world 8 --rounds ${ROUNDS:-3} --window ${WINDOW:-4096} \
      2>&1 | grep -v Warn | tee "$OUT/packed_window.log" | grep -A20 "^## Simulated" ;;
  calibrate)
    shift
    python3 bench/packed_calibrate.py --lengths ${@:-131072} --rounds ${ROUNDS:-3} 2>&1 | grep -v Warn \
      | tee "$OUT/packed_calibrate.log" | tail -16 ;;
  dispatch-rects)
    # one dense call per rectangle (the default) vs a block's rectangles of <= RECTS_MAX (default 2048^2; 2^62: all)
    # score elements in one varlen call, same rows, same call
    shift
    python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_fa4_backend.py -k "varlen" 2>&1 | tail -3 || true
    for flag in "" "--rect-varlen ${RECTS_MAX:-4194304}"; do
      python3 bench/bench_packed.py --lengths ${@:-131072} --world 8 --rounds ${ROUNDS:-3} $flag 2>&1 | grep -v Warn \
        | tee -a "$OUT/packed_rects.log" | grep -A12 "^## Simulated"
    done ;;
  trainpy-a)
    python3 bench/bench_train_py.py --shape llama3.2-3b --seq-length 32768 --configs offload --ga 1 4 --steps 3 \
      --work /tmp/trainpy 2>&1 | grep -v Warn | tee "$OUT/train_py_a.log" | tail -12 ;;
  trainpy-b)
    python3 bench/bench_train_py.py --shape llama3.2-3b --seq-length 32768 --configs gpu --ga 1 4 --steps 3 \
      --work /tmp/trainpy 2>&1 | grep -v Warn | tee "$OUT/train_py_b.log" | tail -12 ;;
  window)
    python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_fa4_backend.py tests/test_packed.py tests/test_memory.py \
      -k "gpu or window or cuda or fa4" 2>&1 | tail -4 || true
    python3 bench/bench_kernels.py --skip-dense --window 4096 --window-length 131072 2>&1 | grep -v Warn \
      | tee "$OUT/window_kernels.log" | tail -12
    python3 bench/bench_memory.py --hf-lengths --ours-lengths 65536 131072 --off-lengths --opt-length 0 \
      --probe-lengths 2>&1 | grep -v Warn | tee "$OUT/memory_64k_128k.log" | tail -16 ;;
  mistral)
    python3 bench/bench_train_step.py --mistral-window 4096 --lengths 131072 --steps 1 --warmup 1 2>&1 | grep -v Warn \
      | tee "$OUT/mistral_window.log" | tail -8 ;;
  timeline)
    python3 bench/bench_memory.py --hf-lengths --ours-lengths 131072 --off-lengths --opt-length 0 --probe-lengths \
      --auto --timeline --host-gib 100 2>&1 | grep -v Warn | tee "$OUT/timeline_128k.log" | tail -10 ;;
  hybrid)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf .tf524/*.whl
    export PYTHONPATH=/tmp/tf:$PYTHONPATH
    timeout 200 python3 bench/bench_hybrid.py --length 32768 2>&1 | grep -v Warn | tee "$OUT/hybrid_32k.log" | tail -9 || true
    timeout 240 python3 bench/bench_hybrid.py --length 131072 --iters 1 --no-full 2>&1 | grep -v Warn \
      | tee "$OUT/hybrid_128k.log" | tail -9 || true ;;
  lora)
    python3 bench/bench_lora.py 2>&1 | grep -v Warn | tee "$OUT/lora.log" | tail -10 ;;
  heads)
    # attention blocks in N=8 head groups (memory/head_chunks.py) vs none, same call: KB/token and tok/s at
    # 64K/128K (the 96.6 KB/token run's options, then the same plus --head-chunks N)
    for n in 1 "${2:-8}"; do
      python3 bench/bench_memory.py --hf-lengths --ours-lengths 65536 131072 --off-lengths --opt-length 0 \
        --probe-lengths --head-chunks "$n" 2>&1 | grep -v Warn | tee -a "$OUT/heads.log"
    done ;;
  heads-1m)
    # the 1M memory probe with 8 head groups (block-local attention stand-in: a real 1M step takes ~35 min), k=3
    python3 bench/bench_memory.py --hf-lengths --ours-lengths --off-lengths --opt-length 0 \
      --probe-lengths 1048576 --probe-host-gib 100 --head-chunks "${2:-8}" 2>&1 | grep -v Warn | tee "$OUT/heads_1m.log" ;;
  m1m-layers)
    python3 bench/bench_memory.py --hf-lengths --off-lengths --probe-lengths --opt-length 0 --ours-lengths 1048576 \
      --layers "${2:-4}" --host-gib 70 --auto --budget-s 560 2>&1 | grep -v Warn | tee "$OUT/m1m_layers.log" | tail -8 ;;
  m1m-group)
    # 3 layers x 1M x 8 KB = 24 GiB of layer inputs; a 9 GiB host budget makes bench_memory keep one per 3 (k = 3)
    python3 bench/bench_memory.py --hf-lengths --off-lengths --probe-lengths --opt-length 0 --ours-lengths 1048576 \
      --layers 3 --checkpointing offload --host-gib 9 --head-chunks 8 --budget-s 560 2>&1 | grep -v Warn \
      | tee "$OUT/m1m_group.log" | tail -8 ;;
  m512-start)
    # 512K: layer inputs offloaded one per 2 layers (64 GiB pinned host memory: 128 GiB would not fit the host);
    # as many layers as the GPU memory left over holds keep their attention output (~4 GiB each): memory/auto.py.
    # --timeline: CUDA events only (no sync in the step): how much of the offload copies compute hides at 512K.
    mkdir -p /tmp/keep && rm -f /tmp/keep/m512.*
    OUT=/tmp/keep setsid nohup python3 bench/bench_memory.py --hf-lengths --off-lengths --probe-lengths \
      --opt-length 0 --ours-lengths 524288 --host-gib 70 --auto --repeat "${2:-1}" --budget-s 1800 --timeline \
      > /tmp/keep/m512.log 2>&1 < /dev/null & echo $! > /tmp/keep/m512.pid; echo "started pid $(cat /tmp/keep/m512.pid)" ;;
  m512-wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while kill -0 "$(cat /tmp/keep/m512.pid)" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    kill -0 "$(cat /tmp/keep/m512.pid)" 2>/dev/null && echo "still running" || echo "finished"
    cp /tmp/keep/m512.log /tmp/keep/offload_trace_*.json "$OUT/" 2>/dev/null || true; for f in /tmp/keep/bench_memory*.json; do cp "$f" "$OUT/m512.json" 2>/dev/null || true; done
    grep -v Warn /tmp/keep/m512.log | tail -14 || true ;;
  *) echo "usage: $0 keep|install|kernels|step|packed|calibrate [L...]|dispatch [L...]|dispatch-pick [L...]|dispatch-window [L...]|dispatch-rects [L...]|trainpy-a|trainpy-b|window|mistral|hybrid|timeline|lora|heads|heads-1m|m1m-layers [N]|m1m-group|m512-start|m512-wait N" >&2; exit 2 ;;
esac
