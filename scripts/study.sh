#!/usr/bin/env bash
# The paper's recipe, small, as curves over training steps (docs/study.md).
# From ONE pretrained causal base:
#   base                  next-token pretraining on the task mixture + Python standard library source
#   ar                    the base continued with the next-token objective (the ARM baseline)
#   refusion              the base fine-tuned with the ReFusion objective (mask token added; variant "paper")
#   mdm                   the base adapted to masked diffusion (the MDM baseline)
#   refusion-boundary, refusion-ar-share-25, refusion-joint, refusion-hybrid, refusion-decoupled,
#   refusion-joint-hybrid
#                         the ReFusion objective's variants (TrainConfig.variant), configs/study/NAME.toml
#   refusion-hybrid-8k    the bundled model: its recipe (src/refusion/assets/refusion-tiny/recipe.toml, the
#                         hybrid variant to 8000 steps); RUNS/refusion-hybrid-8k/model is bit-identical to it
# Each fine-tune is ONE run from the base, on the same data, to a step budget; its checkpoints at
# UNIT, 2 UNIT, 4 UNIT, ... steps (UNIT = the ARM's original 2000) and at the budget are the points of
# its curves, each evaluated with the model's decoders on held-out prompts of the four task families,
# with 95% intervals. The learning-rate schedule spans the whole budget, so the point at 2000 steps of
# a 16000-step run is not a 2000-step run (its learning rate has not decayed yet).
#
#   bash scripts/study.sh                     # every stage, then the report (hours: run it in the background)
#   bash scripts/study.sh refusion report     # some stages, in this order (or STAGES="refusion report")
#   bash scripts/study.sh --quick             # a smoke test of every stage: steps 4 and 8, nothing learned
#                                             # (answers of 64 tokens; the variants evaluated with speculative only)
#   STEPS=8000 bash scripts/study.sh ar       # another budget for ar, refusion and mdm (default 16000)
#   VARIANT_STEPS=8000 ...                    # another budget for the variants (default 4000)
#   BUNDLED_STEPS=4000 ...                    # another budget for the bundled recipe (default its max_steps)
#   UNIT=1000 ...                             # the first curve point, doubled up to the budget (default 2000)
#   N=200 bash scripts/study.sh               # more test prompts per task (default 100)
#
# Stages: base, then any of the fine-tunes (they need the base's model), then report. Trainings run
# one at a time, one thread each. Everything resumes: a stage whose run has its final model is not
# retrained; a run cut off continues from its last checkpoint (`refusion train` resumes an out_dir
# that holds checkpoints); a (model, step, decoder) whose summaries exist is not evaluated again, so
# re-running the same command after a cut carries on where it stopped. A run trained to another
# budget is refused (delete runs/study/NAME, and its results, to redo it).
#
# Models go to runs/study[-quick]/NAME (checkpoint-STEP/ for every curve point, model/ at the budget),
# results to results/study[-quick]/: per-sample JSONL and a summary JSON per (NAME@STEP, task,
# decoder), the training logs, configs and metrics (gzipped), report.md, accuracy_vs_steps.png and
# accuracy_vs_tps.png.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${REFUSION:-.venv/bin/refusion}
ALL="base ar refusion mdm refusion-boundary refusion-ar-share-25 refusion-joint refusion-hybrid refusion-decoupled"
ALL+=" refusion-joint-hybrid"
ALL+=" refusion-hybrid-8k report"
BUNDLED_RECIPE=src/refusion/assets/refusion-tiny/recipe.toml
QUICK=0 NAMED=()
for a in "$@"; do
  case $a in
    --quick) QUICK=1 ;;
    -*) echo "study: unknown option $a (options: --quick; stages: $ALL)" >&2; exit 2 ;;
    *) NAMED+=("$a") ;;
  esac
done
if (( ${#NAMED[@]} )); then STAGES=${NAMED[*]}; fi
STAGES=${STAGES:-$ALL}
for s in $STAGES; do
  [[ " $ALL " == *" $s "* ]] || { echo "study: unknown stage '$s' (stages: $ALL)" >&2; exit 2; }
done
if [[ $QUICK == 1 ]]; then
  RUNS=${RUNS:-runs/study-quick} OUT=${OUT:-results/study-quick} N=${N:-4}
  UNIT=${UNIT:-4} STEPS=${STEPS:-8} VARIANT_STEPS=${VARIANT_STEPS:-8} BUNDLED_STEPS=${BUNDLED_STEPS:-8}
  VARIANT_DECODERS=quick_decoders  # (refusion's stage runs every decoder)
  # a few steps on a few examples, a small tokenizer, shorter answers (still two MDM blocks):
  # exercises every stage end to end
  GEN=64
  SHRINK=(--set synthetic_examples=200 --set warmup_steps=2)
  BASE_SHRINK=("${SHRINK[@]}" --set max_steps=8 --set save_every=4 --set corpus_examples=100 --set vocab_size=300)
else
  RUNS=${RUNS:-runs/study} OUT=${OUT:-results/study} N=${N:-100}
  UNIT=${UNIT:-2000} STEPS=${STEPS:-16000} VARIANT_STEPS=${VARIANT_STEPS:-4000} VARIANT_DECODERS=refusion_decoders
  BUNDLED_STEPS=${BUNDLED_STEPS:-$(sed -n 's/^max_steps = \([0-9]*\).*/\1/p' "$BUNDLED_RECIPE")}
  GEN=96
  SHRINK=() BASE_SHRINK=()
fi
TASKS=sort,add,repeat,code
# One thread per process: these models are too small for a second thread to pay.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT/logs"

die() { echo "study: $*" >&2; exit 1; }
failed() { tail -n 3 "$OUT/logs/$1.log" >&2; die "training $1 failed (log $OUT/logs/$1.log)"; }

points() {  # points BUDGET: the curve's steps, UNIT doubled up to BUDGET, and BUDGET itself
  local s=$UNIT
  while (( s < $1 )); do echo $s; s=$((s * 2)); done
  echo "$1"
}

keep_logs() {  # keep_logs NAME: the run's config and metrics beside the results (the metrics gzipped:
  #               a line per step)
  cp "$RUNS/$1/train_config.json" "$OUT/logs/$1.train_config.json"
  gzip -nc "$RUNS/$1/metrics.jsonl" > "$OUT/logs/$1.metrics.jsonl.gz"
}

train() {  # train NAME BUDGET [CONFIG]: CONFIG (default configs/study/NAME.toml) from the base, a checkpoint
  #           every UNIT steps, all kept
  local name=$1 budget=$2 config=${3:-configs/study/$1.toml} dir=$RUNS/$1
  [[ -f $RUNS/base/model/config.json ]] || die "$name starts from the base: run the base stage first"
  if [[ -f $dir/train_config.json ]]; then  # the schedule spans max_steps: a run cannot change its budget
    local had
    had=$(sed -n 's/^ *"max_steps": \([0-9]*\),*$/\1/p' "$dir/train_config.json")
    [[ $had == "$budget" ]] || die "$dir was trained to $had steps, not $budget; its learning-rate schedule spans" \
      "its budget, so it cannot be extended: move it away (and its results in $OUT) or choose another budget"
  fi
  if [[ -f $dir/model/config.json ]]; then
    echo "study: $name already trained ($dir/model)"
  else
    echo "study: training $name ($budget steps) -> $dir; log $OUT/logs/$name.log"
    SECONDS=0
    $R train --config "$config" --set out_dir="$dir" --set init="$RUNS/base/model" \
      --set max_steps="$budget" --set save_every="$UNIT" --set keep_checkpoints=$(((budget + UNIT - 1) / UNIT)) \
      "${SHRINK[@]}" --no-progress >> "$OUT/logs/$name.log" 2>&1 || failed "$name"
    echo "study: $name trained in $((SECONDS / 60)) min"
  fi
  keep_logs "$name"
}

ev() {  # ev MODEL_DIR LABEL SETTING...: each SETTING ('DECODER [flags] [--tag TAG]', as `refusion eval
  #        --setting` takes it) on the tasks whose summaries are missing; the settings that miss the same
  #        tasks share one eval, which loads the model once
  local dir=$1 label=$2 name key i t w missing
  shift 2
  local settings=("$@") keys=()
  local -A group=()  # missing tasks -> the settings (their indices) that miss them
  for i in "${!settings[@]}"; do
    read -ra w <<< "${settings[i]}"
    name=${w[0]}  # the decoder's name in the result files: DECODER[-TAG]
    for ((t = 1; t < ${#w[@]}; t++)); do
      [[ ${w[t]} == --tag ]] && name+=-${w[t + 1]}
    done
    missing=()
    for t in ${TASKS//,/ }; do
      [[ -f $OUT/${label}__${t}__$name.json ]] || missing+=("$t")
    done
    if (( ${#missing[@]} == 0 )); then
      echo "study: $label $name already evaluated"
      continue
    fi
    key=$(IFS=,; echo "${missing[*]}")
    [[ -n ${group[$key]+set} ]] || keys+=("$key")
    group[$key]+=" $i"
  done
  for key in "${keys[@]}"; do
    [[ -f $dir/config.json ]] || die "$dir: no such model (its checkpoint was not kept?)"
    local args=()
    for i in ${group[$key]}; do args+=(--setting "${settings[i]}"); done
    $R eval --model "$dir" --label "$label" --task "$key" --n "$N" --gen-length $GEN --out "$OUT" --no-progress \
      "${args[@]}"
  done
}

eval_curve() {  # eval_curve NAME BUDGET DECODERS: every curve point of the run with the model family's decoders
  local name=$1 budget=$2 decoders=$3 step
  echo "$name $(uptime)" >> "$OUT/logs/eval_load.txt"
  for step in $(points "$budget"); do
    "$decoders" "$RUNS/$name/checkpoint-$step" "$name@$step"
  done
}

ar_decoders() { ev "$1" "$2" ar; }
refusion_decoders() {
  ev "$1" "$2" speculative ar "refusion --slot-size 8 --slot-threshold 0.9 --token-threshold 0.4" \
    "refusion --slot-size 8 --slot-threshold 0.7 --token-threshold 0.2 --tag fast" \
    "refusion --slot-size 8 --slot-threshold 0.9 --token-threshold 0.4 --checks --tag checked"
}
quick_decoders() { ev "$1" "$2" speculative; }  # --quick's variants: the stage runs, one decoder
mdm_decoders() {
  ev "$1" "$2" "mdm --block-length 32 --steps $GEN" "mdm-threshold --block-length 32 --threshold 0.9"
}

for s in $STAGES; do
  case $s in
    base)
      if [[ -f $RUNS/base/model/config.json ]]; then
        echo "study: base already trained ($RUNS/base/model)"
      else
        echo "study: training base -> $RUNS/base; log $OUT/logs/base.log"
        $R train --config configs/study/base.toml --set out_dir="$RUNS/base" "${BASE_SHRINK[@]}" --no-progress \
          >> "$OUT/logs/base.log" 2>&1 || failed base
      fi
      keep_logs base
      ev "$RUNS/base/model" base ar ;;
    # (two commands, not `a && b`: set -e does not apply inside a function called left of &&)
    ar) train ar "$STEPS"; eval_curve ar "$STEPS" ar_decoders ;;
    refusion) train refusion "$STEPS"; eval_curve refusion "$STEPS" refusion_decoders ;;
    mdm) train mdm "$STEPS"; eval_curve mdm "$STEPS" mdm_decoders ;;
    refusion-hybrid-8k)
      train "$s" "$BUNDLED_STEPS" "$BUNDLED_RECIPE"; eval_curve "$s" "$BUNDLED_STEPS" "$VARIANT_DECODERS" ;;
    refusion-*) train "$s" "$VARIANT_STEPS"; eval_curve "$s" "$VARIANT_STEPS" "$VARIANT_DECODERS" ;;
    report)
      $R report "$OUT" --out "$OUT/report.md" --plot "$OUT/accuracy_vs_tps.png" \
        --curves-plot "$OUT/accuracy_vs_steps.png" > /dev/null
      echo "study: $OUT/report.md, $OUT/accuracy_vs_steps.png, $OUT/accuracy_vs_tps.png" ;;
  esac
done
