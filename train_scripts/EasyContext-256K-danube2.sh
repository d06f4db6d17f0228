#!/usr/bin/env bash
# EasyContext's small-model recipe: h2o-danube2-1.8B (Mistral architecture) from 16K to 256K, 8 GPUs,
# DeepSpeed ZeRO-3 offload, LR 2e-5, GA 4, ~1.02M tokens per optimizer step (bs x GA x seq x dp).
# No config edit is needed: train.py routes Mistral's attention itself and turns off the sliding window
# (EasyContext had to relabel the config as Llama because HF 4.39's Mistral RoPE broke under ring attention).
# Stage 7 originally started from the hub model PY007/EasyContext-64K-h2o; here it continues from stage 6
# (set INIT7 to use another model). Re-running skips finished stages and resumes an interrupted one.
#
# | # | seq     | rope theta | steps | bs | mode             | dataset   | seed |
# |---|---------|------------|-------|----|------------------|-----------|------|
# | 1 |  16,000 | 3e4        | 400   | 2  | data_parallel    | DATA_128K | 2024 |
# | 2 |  32,000 | 1e5        | 400   | 1  | data_parallel    | DATA_128K | 2025 |
# | 3 |  32,000 | 3e5        | 400   | 1  | data_parallel    | DATA_128K | 2026 |
# | 4 |  64,000 | 1e6        | 400   | 4  | zigzag_ring_attn | DATA_128K | 2027 |
# | 5 |  64,000 | 2.5e6      | 400   | 4  | zigzag_ring_attn | DATA_128K | 2028 |
# | 6 |  64,000 | 5e6        | 400   | 4  | zigzag_ring_attn | DATA_128K | 2029 |
# | 7 | 128,000 | 1e7        | 300   | 2  | zigzag_ring_attn | DATA_128K | 2030 |
# | 8 | 128,000 | 3e7        | 200   | 2  | zigzag_ring_attn | DATA_128K | 2031 |
# | 9 | 256,000 | 1e8        | 200   | 1  | zigzag_ring_attn | DATA_1M   | 2032 |
set -euo pipefail
cd "$(dirname "$0")/.."
# DRY_RUN=1 prints the commands instead of running them.

MODEL=${MODEL:-h2oai/h2o-danube2-1.8b-base}
DATA_128K=${DATA_128K:-PY007/slimpajama_mistral_tokenized_upsample_4096_chunk_128K}
DATA_1M=${DATA_1M:-PY007/slimpajama_mistral_tokenized_upsample_4096_chunk_1M}
OUT=${OUT:-output}
CONFIG=${CONFIG:-accelerate_configs/single_node.yaml}
WANDB=${WANDB:-EasyContext-danube2}
CKPT_EVERY=${CKPT_EVERY:-50}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}

# stage OUT INIT SEQ THETA STEPS BS MODE DATASET SEED
stage() {
  local out=$1 init=$2 seq=$3 theta=$4 steps=$5 bs=$6 mode=$7 data=$8 seed=$9
  if [ -f "$out/config.json" ]; then echo "== $out is done, skipping"; return; fi
  echo "== $out: seq $seq, rope theta $theta, $steps steps, bs $bs, $mode"
  ${DRY_RUN:+echo} accelerate launch --config_file "$CONFIG" train.py \
    --batch-size "$bs" --gradient-accumulate-every 4 --output-dir "$out" --wandb "$WANDB" --seed "$seed" \
    --max-train-steps "$steps" --learning-rate 2e-5 --rope-theta "$theta" --model "$init" --dataset "$data" \
    --seq-length "$seq" --parallel_mode "$mode" --checkpoint-every "$CKPT_EVERY" --resume
  ${DRY_RUN:+echo} rm -rf "$out/checkpoints"
}

D=$OUT/danube2
stage "$D-16K-rope-3e4"   "$MODEL"             16000  30000     400 2 data_parallel    "$DATA_128K" 2024
stage "$D-32K-rope-1e5"   "$D-16K-rope-3e4"    32000  100000    400 1 data_parallel    "$DATA_128K" 2025
stage "$D-32K-rope-3e5"   "$D-32K-rope-1e5"    32000  300000    400 1 data_parallel    "$DATA_128K" 2026
stage "$D-64K-rope-1e6"   "$D-32K-rope-3e5"    64000  1000000   400 4 zigzag_ring_attn "$DATA_128K" 2027
stage "$D-64K-rope-2.5e6" "$D-64K-rope-1e6"    64000  2500000   400 4 zigzag_ring_attn "$DATA_128K" 2028
stage "$D-64K-rope-5e6"   "$D-64K-rope-2.5e6"  64000  5000000   400 4 zigzag_ring_attn "$DATA_128K" 2029
stage "$D-128K-rope-1e7"  "${INIT7:-$D-64K-rope-5e6}" 128000 10000000 300 2 zigzag_ring_attn "$DATA_128K" 2030
stage "$D-128K-rope-3e7"  "$D-128K-rope-1e7"   128000 30000000  200 2 zigzag_ring_attn "$DATA_128K" 2031
stage "$D-256K-rope-1e8"  "$D-128K-rope-3e7"   256000 100000000 200 1 zigzag_ring_attn "$DATA_1M"   2032
echo "final model: $D-256K-rope-1e8"
