#!/usr/bin/env bash
# `make demo`: the whole pipeline on 2 CPU cores, no downloads, a few minutes.
#  1. a tiny Llama from a config, a byte-level BPE tokenizer (tokenizers library) and a packed toy corpus
#  2. two progressive stages on 2 CPU processes: zigzag ring attention under DeepSpeed ZeRO-3 (gloo),
#     sequence length 256 -> 512 and RoPE theta 2e4 -> 8e4 (the final model is saved with theta 1e5)
#  3. eval_ppl.py and eval_needle.py on the result (when present), CSV/PNG next to the model
# The first DeepSpeed run JIT-compiles two ops (about a minute; cached in ~/.cache/torch_extensions).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-output_demo}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
t0=$(date +%s)
port() { python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
train() { accelerate launch --config_file accelerate_configs/cpu.yaml --main_process_port "$(port)" train.py "$@"; }
cpu2() { ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --main_process_port "$(port)" "$@"; }

echo "== [1/4] tiny Llama + byte-level tokenizer + packed corpus -> $OUT/assets"
rm -rf "$OUT/assets" "$OUT/stage1" "$OUT/stage2" "$OUT/eval"
python -m easy_context.training.toy "$OUT/assets" --seq-lengths 256 512 --docs 400

echo "== [2/4] stage 1: seq 256, rope theta 2e4, zigzag_ring_attn on 2 CPU processes, DeepSpeed ZeRO-3"
train --model "$OUT/assets/tiny-llama" --dataset "$OUT/assets/data_256" --output-dir "$OUT/stage1" \
  --seq-length 256 --rope-theta 2e4 --parallel_mode zigzag_ring_attn --batch-size 1 \
  --gradient-accumulate-every 2 --max-train-steps 60 --learning-rate 3e-3 --warmup-steps 5 --checkpoint-every 20

echo "== [3/4] stage 2: seq 512, rope theta 8e4 (saved as 1e5), starting from stage 1"
train --model "$OUT/stage1" --dataset "$OUT/assets/data_512" --output-dir "$OUT/stage2" \
  --seq-length 512 --rope-theta 8e4 --save-rope-theta 1e5 --parallel_mode zigzag_ring_attn --batch-size 1 \
  --gradient-accumulate-every 2 --max-train-steps 30 --learning-rate 1e-3 --warmup-steps 2 --checkpoint-every 10

echo "== [4/4] evals"
EVAL=$OUT/eval
mkdir -p "$EVAL"
if [ -f eval_ppl.py ] && python eval_ppl.py --help > /dev/null 2>&1; then
  cpu2 eval_ppl.py -m "$OUT/assets/tiny-llama" -m "$OUT/stage2" --tokenized "$OUT/assets/data_512" \
    --min-tokens 64 --max-tokens 512 --samples 4 --truncate --parallel_mode zigzag_ring_attn \
    --output-file "$EVAL/ppl.csv" || echo "warning: eval_ppl.py exited with an error (outputs so far kept)"
  if [ -f plot.py ]; then python plot.py "$EVAL/ppl.csv" --xmax 600 --ymin 1 --ymax 400 || echo "(plot.py failed; CSV kept)"; fi
else
  echo "eval_ppl.py not available: skipped"
fi
if [ -f eval_needle.py ] && python eval_needle.py --help > /dev/null 2>&1; then
  cpu2 eval_needle.py --model "$OUT/stage2" --min_context_length 128 --max_context_length 384 \
    --context_interval 128 --depth_interval 0.5 --num_samples 1 --rnd_number_digits 4 \
    --parallel_mode zigzag_ring_attn --output-dir "$EVAL" \
    || echo "warning: eval_needle.py exited with an error (outputs so far kept)"
else
  echo "eval_needle.py not available: skipped"
fi

echo
echo "== demo done in $(( $(date +%s) - t0 )) s. Outputs:"
echo "   assets (model, tokenizer, data): $OUT/assets"
echo "   stage 1 model + metrics.jsonl:   $OUT/stage1"
echo "   stage 2 model (rope theta 1e5):  $OUT/stage2"
echo "   evals (CSV / PNG):               $EVAL"
ls -1 "$EVAL" | sed 's/^/     /'
