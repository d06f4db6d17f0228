#!/usr/bin/env bash
# EasyContext's progressive recipe on a real pretrained model, on ONE GPU: SmolLM2-135M-Instruct (Llama
# architecture: 30 layers, hidden 576, 9 q / 3 kv heads of 64; trained to 8K with RoPE theta 1e5) extended to 64K.
# Full fine-tuning, zigzag ring attention (one rank: the whole row through the kernel facade), chunked loss,
# selective checkpointing (layer inputs + attention outputs kept: 135M params need no more saving), bf16 autocast
# over fp32 weights with AdamW on the GPU: a plain `python train.py` launch (no DeepSpeed: weights + gradients +
# AdamW state are 2.2 GB). 65,536 tokens per optimizer step in every stage (bs 1 x GA x seq), LR 5e-5 constant
# after 10 warmup steps (a 135M model adapts to a new theta slower than EasyContext's 7B at 2e-5 on ~1M-token steps,
# and these stages see ~5-7M tokens each).
#
# | # | seq    | rope theta | steps | GA | tokens     | data     | seed |
# |---|--------|------------|-------|----|------------|----------|------|
# | 1 |  8,192 | 5e5        | 110   | 8  | 7.2M       | DATA_8K  | 2024 |
# | 2 | 32,768 | 2e6        |  80   | 2  | 5.2M       | DATA_32K | 2025 |
# | 3 | 65,536 | 5e6        |  60   | 1  | 3.9M       | DATA_64K | 2026 |
# | 4 | 65,536 | 5e6        |  80   | 2  | 10.5M      | DATA_RET | 2027 |
#
# Stage 4 (not in EasyContext, which extended a 7B model whose retrieval survived raw-text training): the retrieval
# curriculum (`python -m easy_context retrieval-data`, easy_context_train/curriculum/): numbers, words, key-value pairs,
# several facts with distractors, multi-hop variable chains and spans of the haystack, in many wordings and prompt
# frames disjoint from every eval's (eval_needle's, RULER's, the held-out probes'), over code, docstring prose and
# generated prose from the training split, mixed with short generated chat and a raw-text piece per row; labels on
# the replies and on the raw piece's tail (raw text half of a mixed row's loss, curriculum/rows.py), LR 3e-5.
# After stages 1-3 (raw text only) this 135M model keeps its perplexity but answers a long prompt's question with
# nothing or with more haystack; #48's stage 4 trained eval_needle's own format and taught mostly that (issue #64).
#
# Theta: a RoPE dimension whose period exceeds the trained length is never seen through a full turn; with head_dim
# 64 and theta 1e5 at 8K that is every dimension past the 40th. Keeping the same 40 dimensions within 32K needs
# theta ~8.9e5, within 64K ~2.7e6 (theta' = (L' / 2 pi) ^ (64 / 40)). Each stage takes a theta that already covers
# the next stage's length (5e5 at 8K; 2e6 at 32K), the last ~2x the 64K estimate, as EasyContext's Llama-2 stages
# (5e6 at 64K) did. The final config keeps 5e6 and max_position_embeddings 65536.
# Data: CPython's standard library (PSF-2.0) from `python -m easy_context real-text DIR` (7.5M tokens of this
# tokenizer; ~1 epoch per stage), packed by prepare_data.py (docs/real-model.md); bench/real_model_gpu.sh runs it all.
#
# Settings from the environment: MODEL (the converted model dir), DATA_8K / DATA_32K / DATA_64K / DATA_RET, OUT (default
# output), STAGES (default "1 2 3 4"), STEPS1..STEPS4, SEQ1..SEQ4 and GA1..GA4 (for a small smoke run), LR, LR4,
# TIME_LIMIT (seconds per stage, default 540: then train.py gets SIGTERM, saves a checkpoint and exits 75; running
# again resumes it), CKPT_EVERY (default 0: none besides that one), LAUNCH (default python3; e.g. "accelerate launch
# --config_file accelerate_configs/single_gpu.yaml" for DeepSpeed), DRY_RUN=1 (print the commands). Re-running
# skips finished stages and resumes an interrupted one.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-output/smollm2-135m-instruct}
DATA_8K=${DATA_8K:-data/real_8192}
DATA_32K=${DATA_32K:-data/real_32768}
DATA_64K=${DATA_64K:-data/real_65536}
DATA_RET=${DATA_RET:-data/retrieval_65536}
OUT=${OUT:-output}
STAGES=${STAGES:-1 2 3 4}
LR=${LR:-5e-5}
LR4=${LR4:-3e-5}
CKPT_EVERY=${CKPT_EVERY:-0}
TIME_LIMIT=${TIME_LIMIT:-540}
LAUNCH=${LAUNCH:-python3}
export ACCELERATE_MIXED_PRECISION=${ACCELERATE_MIXED_PRECISION:-bf16}  # plain launch: autocast over fp32 weights
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}

# stage N OUT INIT SEQ THETA STEPS GA DATASET SEED [LR]
stage() {
  local n=$1 out=$2 init=$3 seq=$4 theta=$5 steps=$6 ga=$7 data=$8 seed=$9 lr=${10:-$LR}
  case " $STAGES " in *" $n "*) ;; *) return 0 ;; esac
  if [ -f "$out/config.json" ]; then echo "== stage $n: $out is done, skipping"; return 0; fi
  echo "== stage $n: $out: seq $seq, rope theta $theta, $steps steps x GA $ga, lr $lr"
  local rc=0
  ${DRY_RUN:+echo} timeout --preserve-status --signal=TERM --kill-after=60 "$TIME_LIMIT" $LAUNCH train.py \
    --batch-size 1 --gradient-accumulate-every "$ga" --output-dir "$out" --seed "$seed" \
    --max-train-steps "$steps" --learning-rate "$lr" --warmup-steps "${WARMUP:-10}" --rope-theta "$theta" --model "$init" \
    --dataset "$data" --seq-length "$seq" --parallel_mode zigzag_ring_attn --chunked-loss \
    --checkpointing selective --checkpoint-every "$CKPT_EVERY" --resume || rc=$?
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 75 ] && echo "== stage $n stopped at the ${TIME_LIMIT}s limit with a checkpoint: run again to resume"
    exit "$rc"
  fi
  ${DRY_RUN:+echo} rm -rf "$out/checkpoints"
}

S=$OUT/smollm2-135m
stage 1 "$S-8K-rope-5e5"  "$MODEL"          "${SEQ1:-8192}"  500000  "${STEPS1:-110}" "${GA1:-8}" "$DATA_8K"  2024
stage 2 "$S-32K-rope-2e6" "$S-8K-rope-5e5"  "${SEQ2:-32768}" 2000000 "${STEPS2:-80}"  "${GA2:-2}" "$DATA_32K" 2025
stage 3 "$S-64K-rope-5e6" "$S-32K-rope-2e6" "${SEQ3:-65536}" 5000000 "${STEPS3:-60}"  "${GA3:-1}" "$DATA_64K" 2026
stage 4 "$S-64K-rope-5e6-retrieval" "$S-64K-rope-5e6" "${SEQ4:-65536}" 5000000 "${STEPS4:-80}" "${GA4:-2}" \
  "$DATA_RET" 2027 "$LR4"
echo "final model: $S-64K-rope-5e6-retrieval"

