#!/usr/bin/env bash
# SmolLM2-135M-Instruct extended from 8K to 64K on one GPU, evaluated before and after (issue #48; docs/real-model.md).
# On the CPU machine, once (fills the git-ignored .real/a and .real/b, < 64 MiB each; needs PyPI):
#   bash bench/real_model_gpu.sh pack
# Then on the GPU machine, back to back (it keeps /tmp/real while warm; each call writes its results to $OUT):
#   bash bench/real_model_gpu.sh keep         # carry .real/a: first GGUF half + the corpus -> /tmp/real     ~10 s
#   bash bench/real_model_gpu.sh setup        # carry .real/b: join + sha256, wheels, convert, prepare data  ~2 min
#   bash bench/real_model_gpu.sh before       # evals of the original model (below)                          ~3 min
#   bash bench/real_model_gpu.sh stage 1      # 8K,  theta 5e5, 110 steps (+ perplexity of the stage model)   ~3-4 min
#   bash bench/real_model_gpu.sh stage 2      # 32K, theta 2e6,  80 steps                                    ~4-5 min
#   bash bench/real_model_gpu.sh stage 3      # 64K, theta 5e6,  60 steps                                    ~2-3 min
#   bash bench/real_model_gpu.sh stage 4      # 64K, retrieval chat rows (labels on replies), 60 x GA 2     ~4-5 min
#   bash bench/real_model_gpu.sh after        # the same evals of the final model + summary.md before/after   ~4 min
#   bash bench/real_model_gpu.sh report       # summary.md again from what /tmp/real holds                  ~5 s
# Evals: eval_needle.py 4K..64K (step NEEDLE_STEP=4096) x depth 0..1 (0.1), chat template, the CPython docs'
# prose as haystack; eval_ppl.py on the held-out long documents (first 1K..64K tokens, doubling -> loss by position);
# bench/real_model_probe.py generate (greedy answers to short chat prompts). Needle answers get 32 new tokens: the
# instruct model restates the question first ("The special magic Singapore number is: N" is already 15 tokens).
# A stage stopped by its time limit (TIME_LIMIT, 480 s here: SIGTERM, checkpoint, and the call still ends within
# 10 minutes) keeps a checkpoint: `stage N` again resumes it.
# STEPS1..3 / LR pass to the recipe.
# eval_ruler.py: niah_single, niah_multikey, vt at 16K..64K step 16K, 4 samples (RULER=0 skips it).
# Smaller grids (a CPU smoke run of keep/setup/before): NEEDLE_MIN/NEEDLE_MAX/NEEDLE_STEP, DEPTH, PPL_MIN/PPL_MAX,
# RULER_MIN/RULER_MAX/RULER_STEP/RULER_SAMPLES;
# REAL_DIR (default /tmp/real), SITE (where the wheels go, default /tmp/site), OUT (default REAL_DIR/out).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${REAL_DIR:-/tmp/real}
OUT=${OUT:-$R/out}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=${SITE:-/tmp/site}  # wheels installed here (as bench/h200_fa4.sh does)
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
export PYTORCH_ALLOC_CONF=expandable_segments:True
export HF_DATASETS_CACHE=$R/hf_datasets_cache
MODEL0=$R/model/smollm2-135m-instruct
STAGE3=$R/runs/smollm2-135m-64K-rope-5e6
FINAL=$R/runs/smollm2-135m-64K-rope-5e6-retrieval
PPL_MAX=${PPL_MAX:-65536}
export TIME_LIMIT=${TIME_LIMIT:-480}
mkdir -p "$OUT"
die() { echo "real_model_gpu.sh: error: $*" >&2; exit 2; }
logged() {  # LOG CMD...: the command's output to LOG; on failure its tail and the exit status (the call goes on)
  local log=$1 rc=0; shift
  "$@" > "$log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || { echo "FAILED (exit $rc): $*"; tr '\r' '\n' < "$log" | grep -v Warn | tail -25; }
  return 0
}
need_setup() {
  [ -f "$MODEL0/config.json" ] && [ -d "$R/data/65536" ] && [ -d "$R/data/retrieval_65536" ] \
    || die "nothing set up in $R (machine released?): run keep and setup again"
}

model_json() {  # DIR NOTE -> DIR's rope theta / max positions, for the report
  python3 - "$1" "$2" > "$3" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta"))
print(json.dumps({"path": sys.argv[1], "rope_theta": theta, "max_position_embeddings": c["max_position_embeddings"],
                  "trained": sys.argv[2]}))
EOF
}

evals() {  # MODEL NAME NOTE [needle|no-needle]: results in $R/results/NAME (kept for the report) and $OUT/NAME
  local m=$1 name=$2 d=$R/results/$2 t0
  rm -rf "$d"; mkdir -p "$d"
  model_json "$m" "$3" "$d/model.json"
  t0=$(date +%s)
  logged "$d/ppl.log" python3 eval_ppl.py -m "$m" -d "$R/text/heldout_long.jsonl" --dataset-min-tokens "$PPL_MAX" \
    --min-tokens "${PPL_MIN:-1024}" --max-tokens "$PPL_MAX" --truncate --beyond-max-positions --hide-progress \
    --output-file "$d/ppl.csv"
  grep -E "^$m: [0-9]+=" "$d/ppl.log" || true
  echo "== eval_ppl $name: $(( $(date +%s) - t0 )) s"
  if [ "${4:-needle}" = needle ]; then
    t0=$(date +%s)
    logged "$d/generations.log" python3 bench/real_model_probe.py generate --model "$m" --out "$d/generations.json"
    grep -E "^(Q|A): " "$d/generations.log" || true
    echo "== generate $name: $(( $(date +%s) - t0 )) s"
    t0=$(date +%s)
    logged "$d/needle.log" python3 eval_needle.py --model "$m" --min_context_length "${NEEDLE_MIN:-4096}" \
      --max_context_length "${NEEDLE_MAX:-65536}" --context_interval "${NEEDLE_STEP:-4096}" \
      --depth_interval "${DEPTH:-0.1}" --num_samples 1 --haystack_dir "$R/text/haystack" --chat-template \
      --max_new_tokens 32 --parallel_mode zigzag_ring_attn --output-dir "$d"
    grep -E "^length |^Average" "$d/needle.log" || true
    echo "== eval_needle $name: $(( $(date +%s) - t0 )) s"
    if [ "${RULER:-1}" = 1 ]; then  # a RULER subset (its own wording: never trained), prose haystack
      t0=$(date +%s)
      logged "$d/ruler.log" python3 eval_ruler.py --model "$m" --tasks niah_single niah_multikey vt \
        --min_context_length "${RULER_MIN:-16384}" --max_context_length "${RULER_MAX:-65536}" \
        --context_interval "${RULER_STEP:-16384}" --num_samples "${RULER_SAMPLES:-4}" --haystack_dir "$R/text/haystack" \
        --chat-template --parallel_mode zigzag_ring_attn --output-dir "$d"
      grep -A8 -E "^task|^\| task" "$d/ruler.log" | head -12 || true
      echo "== eval_ruler $name: $(( $(date +%s) - t0 )) s"
    fi
  fi
  cp -r "$d" "$OUT/"
}

summary() {
  python3 bench/real_model_probe.py report --out "$R/results/summary" --runs before="$R/results/before" \
    stage1="$R/results/stage1" stage2="$R/results/stage2" stage3="$R/results/stage3" after="$R/results/after" \
    | tail -60
  cp -r "$R/results/summary" "$OUT/"
}

case "${1:-}" in
  pack)  # CPU machine: everything the GPU machine lacks, in two carries of < 64 MiB
    PY=${PY:-python3}
    rm -rf .real && mkdir -p .real/a .real/b/wheels .cache/smollm2
    $PY -m easy_context fetch-smollm2 .cache/smollm2
    split -n 2 ".cache/smollm2/$GGUF" .real/gguf.part.
    mv .real/gguf.part.aa .real/a/ && mv .real/gguf.part.ab .real/b/
    (cd .cache/smollm2 && sha256sum "$GGUF") > .real/b/SHA256
    $PY -m easy_context real-text .real/text
    tar czf .real/a/real_text.tar.gz -C .real text && rm -rf .real/text
    # pure-Python wheels (gguf; datasets and the two it pins) for Python 3.12; pyarrow, xxhash, pandas, fsspec are
    # already there (train.py ran with datasets on that machine: bench/h200_fa4.sh install)
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none \
      --platform any -d .real/b/wheels gguf==0.19.0 \
      "datasets==$($PY -c 'import datasets; print(datasets.__version__)')" \
      "dill==$($PY -c 'import dill; print(dill.__version__)')" \
      "multiprocess==$($PY -c 'import multiprocess; print(multiprocess.__version__)')"
    du -sh .real/a .real/b; ls -la .real/a .real/b .real/b/wheels ;;
  keep)
    [ -f .real/a/gguf.part.aa ] || die "carry .real/a (made by 'pack' on the CPU machine)"
    mkdir -p "$R/keep" && cp .real/a/* "$R/keep/" && ls -la "$R/keep"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true ;;
  setup)
    t0=$(date +%s)
    [ -f "$R/keep/gguf.part.aa" ] || die "no first GGUF half in $R/keep: run 'keep' (carry .real/a) first"
    [ -f .real/b/gguf.part.ab ] || die "carry .real/b (made by 'pack' on the CPU machine)"
    cat "$R/keep/gguf.part.aa" .real/b/gguf.part.ab > "$R/$GGUF"
    (cd "$R" && sha256sum -c "$OLDPWD/.real/b/SHA256") || die "the joined GGUF does not match its sha256"
    for w in .real/b/wheels/*.whl; do  # only what is missing (an installed datasets stays)
      mod=$(basename "$w" | cut -d- -f1)
      python3 -c "import $mod" 2>/dev/null \
        || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w"
    done
    python3 -c "import datasets, gguf, torch, transformers; print('datasets', datasets.__version__, 'gguf ok; torch',
      torch.__version__, 'transformers', transformers.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" \
      || die "a package is missing (see above); wheels: .real/b/wheels"
    rm -rf "$R/text" && tar xzf "$R/keep/real_text.tar.gz" -C "$R"
    [ -f "$MODEL0/config.json" ] || python3 -m easy_context convert "$R/$GGUF" "$MODEL0" 2>&1 \
      | grep -v -E "Warn|it/s"
    echo "== convert: $(( $(date +%s) - t0 )) s"
    mkdir -p "$R/data"  # prepare_data.py does not create --output's parent
    for S in 8192 32768 65536; do
      [ -d "$R/data/$S" ] || python3 prepare_data.py --dataset "$R/text/train.jsonl" --tokenizer "$MODEL0" \
        --seq-length "$S" --output "$R/data/$S" 2>&1 | grep -E "^wrote|rror"
    done
    [ -d "$R/data/retrieval_65536" ] || python3 -m easy_context retrieval-data --tokenizer "$MODEL0" \
      --haystack "$R/text/train.jsonl" --seq-length 65536 --rows "${RET_ROWS:-160}" --output "$R/data/retrieval_65536" \
      2>&1 | grep -E "^wrote|rror"
    echo "== setup: $(( $(date +%s) - t0 )) s"
    cp "$R/text/manifest.json" "$OUT/" ;;
  before)
    need_setup
    evals "$MODEL0" before "original: 8K, theta 1e5" ;;
  stage)
    need_setup
    n=${2:?stage 1, 2, 3 or 4}
    case "$n" in 1) s=$R/runs/smollm2-135m-8K-rope-5e5 ;; 2) s=$R/runs/smollm2-135m-32K-rope-2e6 ;;
                 3) s=$STAGE3 ;; 4) s=$FINAL ;; *) die "stage 1, 2, 3 or 4" ;; esac
    t0=$(date +%s)
    logged "$OUT/stage$n.log" env MODEL="$MODEL0" DATA_8K="$R/data/8192" DATA_32K="$R/data/32768" \
      DATA_64K="$R/data/65536" DATA_RET="$R/data/retrieval_65536" OUT="$R/runs" STAGES="$n" bash train_scripts/EasyContext-SmolLM2-135M-64K.sh
    grep -E "^== |^(zigzag|saved)" "$OUT/stage$n.log" || true
    if [ -f "$s/metrics.jsonl" ]; then
      cp "$s/metrics.jsonl" "$OUT/metrics_stage$n.jsonl"
      python3 bench/real_model_probe.py metrics "$s/metrics.jsonl"
    fi
    [ -f "$s/config.json" ] || die "stage $n did not finish (log: $OUT/stage$n.log); run 'stage $n' again to resume"
    echo "== stage $n: $(( $(date +%s) - t0 )) s"
    [ "$n" = 4 ] || [ "${PPL_AFTER_STAGE:-1}" = 0 ] || evals "$s" "stage$n" "stage $n" no-needle ;;
  after)
    need_setup
    [ -f "$FINAL/config.json" ] || die "no 64K model at $FINAL: run the stages first"
    evals "$FINAL" after "stages 1-4: 64K, theta 5e6, retrieval chat"
    summary ;;
  report) summary ;;
  *) echo "usage: $0 pack|keep|setup|before|stage 1|stage 2|stage 3|stage 4|after|report" >&2; exit 2 ;;
esac
