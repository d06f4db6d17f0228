#!/usr/bin/env bash
# EasyContext's recipe: Llama-2-7B from 4K to 512K training length (generalizes to ~1M), 8 GPUs, DeepSpeed
# ZeRO-3 with CPU offload. RoPE theta rises 1e6 -> 2.5e8 while training; the final model is saved with
# theta 1e9 (--save-rope-theta, no hand edit of config.json). ~1M tokens per optimizer step throughout
# (bs x GA x seq x data-parallel size); 3,540 steps, ~3.6B tokens. Step counts follow the original,
# which picked them to fit a daily schedule, not by tuning.
#
# Every stage starts from the previous stage's output. Re-running the script skips finished stages (their
# output has config.json) and resumes an interrupted one from its latest checkpoint (--resume).
#
# | # | seq len | rope theta | steps | LR   | GA | mode             | tokens/step      | dataset     | seed |
# |---|---------|------------|-------|------|----|------------------|------------------|-------------|------|
# | 1 |  32,768 | 1e6        | 1000  | 2e-5 | 4  | data_parallel    | 8x4x32768 = 1.05M | DATA_SHORT  | 42   |
# | 2 |  65,536 | 5e6        | 1000  | 2e-5 | 2  | data_parallel    | 8x2x65536 = 1.05M | DATA_SHORT  | 2022 |
# | 3 | 256,000 | 1e7        |  500  | 2e-5 | 4  | zigzag_ring_attn | 4x256000 = 1.02M  | DATA_256K   | 2023 |
# | 4 | 256,000 | 2.5e7      |  500  | 2e-5 | 4  | zigzag_ring_attn | 1.02M             | DATA_256K   | 2024 |
# | 5 | 256,000 | 5e7        |  150  | 2e-5 | 4  | zigzag_ring_attn | 1.02M             | DATA_256K   | 2025 |
# | 6 | 512,000 | 1e8        |  300  | 2e-5 | 2  | zigzag_ring_attn | 2x512000 = 1.02M  | DATA_1M     | 2026 |
# | 7 | 512,000 | 2.5e8      |   90  | 1e-5 | 2  | zigzag_ring_attn | 1.02M             | DATA_1M     | 2027 |
# | final: stage 7 saved with rope theta 1e9                                                              |
set -euo pipefail
cd "$(dirname "$0")/.."
# DRY_RUN=1 prints the commands instead of running them.

# Point these at local copies if you have them (save_to_disk dirs or json/parquet files work too).
MODEL=${MODEL:-meta-llama/Llama-2-7b-hf}
DATA_SHORT=${DATA_SHORT:-yaofu/slimpajama-per-source-length-upsample}
DATA_256K=${DATA_256K:-PY007/slimpajama_llama_tokenized_upsample_4096_chunk_256K}
DATA_1M=${DATA_1M:-PY007/slimpajama_llama_tokenized_upsample_4096_chunk_1M}
OUT=${OUT:-output}
CONFIG=${CONFIG:-accelerate_configs/single_node.yaml}
WANDB=${WANDB:-EasyContext}
CKPT_EVERY=${CKPT_EVERY:-50}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}

# stage OUT INIT SEQ THETA STEPS LR GA MODE DATASET SEED [more train.py flags]
stage() {
  local out=$1 init=$2 seq=$3 theta=$4 steps=$5 lr=$6 ga=$7 mode=$8 data=$9 seed=${10}
  shift 10
  if [ -f "$out/config.json" ]; then echo "== $out is done, skipping"; return; fi
  echo "== $out: seq $seq, rope theta $theta, $steps steps, lr $lr, $mode"
  ${DRY_RUN:+echo} accelerate launch --config_file "$CONFIG" train.py \
    --batch-size 1 --gradient-accumulate-every "$ga" --output-dir "$out" --wandb "$WANDB" --seed "$seed" \
    --max-train-steps "$steps" --learning-rate "$lr" --rope-theta "$theta" --model "$init" --dataset "$data" \
    --seq-length "$seq" --parallel_mode "$mode" --checkpoint-every "$CKPT_EVERY" --resume "$@"
  ${DRY_RUN:+echo} rm -rf "$out/checkpoints"  # the final model is in $out; checkpoints only matter while a stage runs
}

S1=$OUT/7B_32K_bs_1M_rope_1M_step_1000_lr_2e-5
S2=$OUT/7B_64K_bs_1M_rope_5M_step_1000_lr_2e-5
S3=$OUT/7B_0.256M_bs_1M_rope_10M_step_500_lr_2e-5
S4=$OUT/7B_0.256M_bs_1M_rope_25M_step_500_lr_2e-5
S5=$OUT/7B_0.256M_bs_1M_rope_50M_step_150_lr_2e-5
S6=$OUT/7B_0.5M_bs_1M_rope_100M_step_300_lr_2e-5
S7=$OUT/7B_0.5M_bs_1M_rope_250M_step_90_lr_1e-5

stage "$S1" "$MODEL" 32768  1000000   1000 2e-5 4 data_parallel    "$DATA_SHORT" 42
stage "$S2" "$S1"    65536  5000000   1000 2e-5 2 data_parallel    "$DATA_SHORT" 2022
stage "$S3" "$S2"    256000 10000000  500  2e-5 4 zigzag_ring_attn "$DATA_256K"  2023
stage "$S4" "$S3"    256000 25000000  500  2e-5 4 zigzag_ring_attn "$DATA_256K"  2024
stage "$S5" "$S4"    256000 50000000  150  2e-5 4 zigzag_ring_attn "$DATA_256K"  2025
stage "$S6" "$S5"    512000 100000000 300  2e-5 2 zigzag_ring_attn "$DATA_1M"    2026
# The last stage trains at theta 2.5e8 and writes 1e9 into the saved config (EasyContext hand-edited it).
stage "$S7" "$S6"    512000 250000000 90   1e-5 2 zigzag_ring_attn "$DATA_1M"    2027 --save-rope-theta 1e9
echo "final model (rope theta 1e9): $S7"
