#!/usr/bin/env bash
# SmolLM2-135M-Instruct from 64K to 128K on ONE GPU (issue #64): two more stages after
# EasyContext-SmolLM2-135M-64K.sh, from its final model (stage 4: 64K, theta 5e6, the retrieval curriculum).
# Same launch as that script (plain train.py, zigzag ring attention on one rank, chunked loss, selective
# checkpointing, bf16 autocast over fp32 weights, AdamW on the GPU); 131,072 tokens per optimizer step.
#
# | # | seq     | rope theta | steps | GA | tokens | data        | LR   | seed |
# |---|---------|------------|-------|----|--------|-------------|------|------|
# | 5 | 131,072 | 1.5e7      |  30   | 1  | 3.9M   | DATA_128K   | 5e-5 | 2028 |
# | 6 | 131,072 | 1.5e7      |  30   | 1  | 3.9M   | DATA_RET128 | 3e-5 | 2029 |
#
# Stage 5 is raw text (the model learns the new theta at twice the length), stage 6 the retrieval curriculum at
# 128K (rows from `python -m easy_context retrieval-data --seq-length 131072`: every length up to 128K).
# Theta: keeping the 40 of 64 dimensions that turn fully within the original 8K (theta 1e5) within 128K needs
# theta ~8.1e6 ((131072 / 2 pi) ^ (64 / 40)); ~2x that, as the 64K stages did.
# Data: the same CPython corpus packed at 131072 (57 rows: stage 5 sees about half of it).
#
# Settings from the environment: INIT (the 64K final model), DATA_128K / DATA_RET128, OUT, STAGES (default "5 6"),
# STEPS5 / STEPS6, GA5 / GA6, SEQ5 / SEQ6, LR5 / LR6, TIME_LIMIT (default 540; exit 75 with a checkpoint, run again
# to resume), LAUNCH, DRY_RUN=1. Re-running skips finished stages and resumes an interrupted one.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-output}
INIT=${INIT:-$OUT/smollm2-135m-64K-rope-5e6-retrieval}
DATA_128K=${DATA_128K:-data/real_131072}
DATA_RET128=${DATA_RET128:-data/retrieval_131072}
STAGES=${STAGES:-5 6}
TIME_LIMIT=${TIME_LIMIT:-540}
LAUNCH=${LAUNCH:-python3}
export ACCELERATE_MIXED_PRECISION=${ACCELERATE_MIXED_PRECISION:-bf16}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}

# stage N OUT INIT SEQ THETA STEPS GA DATASET SEED LR
stage() {
  local n=$1 out=$2 init=$3 seq=$4 theta=$5 steps=$6 ga=$7 data=$8 seed=$9 lr=${10}
  case " $STAGES " in *" $n "*) ;; *) return 0 ;; esac
  if [ -f "$out/config.json" ]; then echo "== stage $n: $out is done, skipping"; return 0; fi
  [ -n "${DRY_RUN:-}" ] || [ -f "$init/config.json" ] || { echo "stage $n: no model at $init" >&2; exit 2; }
  echo "== stage $n: $out: seq $seq, rope theta $theta, $steps steps x GA $ga, lr $lr"
  local rc=0
  ${DRY_RUN:+echo} timeout --preserve-status --signal=TERM --kill-after=60 "$TIME_LIMIT" $LAUNCH train.py \
    --batch-size 1 --gradient-accumulate-every "$ga" --output-dir "$out" --seed "$seed" \
    --max-train-steps "$steps" --learning-rate "$lr" --warmup-steps "${WARMUP:-5}" --rope-theta "$theta" \
    --model "$init" --dataset "$data" --seq-length "$seq" --parallel_mode zigzag_ring_attn --chunked-loss \
    --checkpointing selective --checkpoint-every "${CKPT_EVERY:-0}" --resume || rc=$?
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 75 ] && echo "== stage $n stopped at the ${TIME_LIMIT}s limit with a checkpoint: run again to resume"
    exit "$rc"
  fi
  ${DRY_RUN:+echo} rm -rf "$out/checkpoints"
}

S=$OUT/smollm2-135m
stage 5 "$S-128K-rope-1.5e7" "$INIT" "${SEQ5:-131072}" 15000000 "${STEPS5:-30}" "${GA5:-1}" "$DATA_128K" 2028 \
  "${LR5:-5e-5}"
stage 6 "$S-128K-rope-1.5e7-retrieval" "$S-128K-rope-1.5e7" "${SEQ6:-131072}" 15000000 "${STEPS6:-30}" "${GA6:-1}" \
  "$DATA_RET128" 2029 "${LR6:-3e-5}"
echo "final model: $S-128K-rope-1.5e7-retrieval"
