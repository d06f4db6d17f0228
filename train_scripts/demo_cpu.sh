#!/usr/bin/env bash
# `make demo`: the whole pipeline on 2 CPU cores, no downloads, under 10 minutes.
#  1. a tiny Llama from a config, a byte-level BPE tokenizer (tokenizers library) and a packed toy corpus that
#     mixes templated prose with passkey documents in eval_needle's exact prompt format (training/toy.py)
#  2. two progressive stages on 2 CPU processes: zigzag ring attention under DeepSpeed ZeRO-3 (gloo),
#     sequence length 256 -> 512 and RoPE theta 2e4 -> 8e4 (the final model is saved with theta 1e5)
#  3. eval_ppl.py (+ plot.py, log y axis), eval_needle.py (heatmap) and eval_ruler.py (score vs length) on the
#     result, CSV/PNG next to the models; the paths of the pictures are printed at the end
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

echo "== [1/5] tiny Llama + byte-level tokenizer + packed corpus (prose + passkey documents, masked per document) -> $OUT/assets"
rm -rf "$OUT/assets" "$OUT/stage1" "$OUT/stage2" "$OUT/eval"
python -m easy_context.training.toy "$OUT/assets" --seq-lengths 256 512 --docs 400 --needle-docs 3000 --document-masking \
  --needle-max-sentences 6

echo "== [2/5] stage 1: seq 256, rope theta 2e4, zigzag_ring_attn on 2 CPU processes, DeepSpeed ZeRO-3"
train --model "$OUT/assets/tiny-llama" --dataset "$OUT/assets/data_256" --output-dir "$OUT/stage1" \
  --seq-length 256 --rope-theta 2e4 --parallel_mode zigzag_ring_attn --batch-size 8 \
  --gradient-accumulate-every 1 --max-train-steps ${STAGE1_STEPS:-400} --learning-rate 3e-3 --warmup-steps 10 \
  --checkpoint-every 200

echo "== [3/5] stage 2: seq 512, rope theta 8e4 (saved as 1e5), starting from stage 1"
train --model "$OUT/stage1" --dataset "$OUT/assets/data_512" --output-dir "$OUT/stage2" \
  --seq-length 512 --rope-theta 8e4 --save-rope-theta 1e5 --parallel_mode zigzag_ring_attn --batch-size 4 \
  --gradient-accumulate-every 1 --max-train-steps ${STAGE2_STEPS:-150} --learning-rate 1e-3 --warmup-steps 5 \
  --checkpoint-every 50

echo "== [4/5] evals"
EVAL=$OUT/eval
mkdir -p "$EVAL"
cpu2 eval_ppl.py -m "$OUT/assets/tiny-llama" -m "$OUT/stage2" --tokenized "$OUT/assets/data_512" \
  --min-tokens 64 --max-tokens 512 --samples 4 --truncate --parallel_mode zigzag_ring_attn \
  --output-file "$EVAL/ppl.csv" || echo "warning: eval_ppl.py exited with an error (outputs so far kept)"
python plot.py "$EVAL/ppl.csv" --xmax 600 --ymin 1 --ymax 1000 || echo "(plot.py failed; CSV kept)"
# haystacks of 64-320 tokens: whole prompts stay within the 512 trained tokens
cpu2 eval_needle.py --model "$OUT/stage2" --min_context_length 64 --max_context_length 320 \
  --context_interval 64 --depth_interval 0.25 --num_samples 2 --rnd_number_digits 4 \
  --parallel_mode zigzag_ring_attn --output-dir "$EVAL" \
  || echo "warning: eval_needle.py exited with an error (outputs so far kept)"
echo "== [5/5] RULER niah_single + vt (formats the model never saw; the suite itself on a toy)"
cpu2 eval_ruler.py --model "$OUT/stage2" --tasks niah_single vt --min_context_length 384 --max_context_length 512 \
  --context_interval 128 --num_samples 2 --max_new_tokens 16 --parallel_mode zigzag_ring_attn \
  --output-dir "$EVAL" || echo "warning: eval_ruler.py exited with an error (outputs so far kept)"

echo
echo "== demo done in $(( $(date +%s) - t0 )) s. Outputs:"
echo "   assets (model, tokenizer, data): $OUT/assets"
echo "   stage 1 model + metrics.jsonl:   $OUT/stage1"
echo "   stage 2 model (rope theta 1e5):  $OUT/stage2"
echo "   evals (CSV / PNG):               $EVAL"
ls -1 "$EVAL" | sed 's/^/     /'
echo "   pictures:"
for f in "$EVAL"/ppl.csv.png "$EVAL"/heatmap_stage2.png "$EVAL"/ruler_stage2.png; do
  if [ -f "$f" ]; then echo "     $f"; fi
done
if [ -f "$EVAL/accuracy_stage2.txt" ]; then echo "   needle: $(cat "$EVAL/accuracy_stage2.txt")"; fi
