#!/usr/bin/env bash
# The paper's recipe, small (issue 11; README "The study"). From ONE pretrained causal base:
#   (a) base      next-token pretraining on the task mixture + Python standard library source
#   (b) refusion  the base fine-tuned with the ReFusion objective (mask token added)
#   (c) ar        the base continued with the next-token objective (the ARM baseline)
#   (d) mdm       the base adapted to masked diffusion (the MDM baseline)
# b, c and d see the same data for the same number of steps; each is evaluated with its own decoders
# on held-out prompts of the four task families, with 95% intervals.
#
#   bash scripts/study.sh            # the full study: about 75 minutes on 2 CPU cores
#   bash scripts/study.sh --quick    # a smoke test of every stage: a few minutes, nothing learned
#   N=200 bash scripts/study.sh      # more test prompts per task (default 100)
#
# Models go to runs/study[-quick]/, results to results/study[-quick]/: per-sample JSONL and a summary
# JSON per (model, task, decoder), the training logs and configs, report.md and accuracy_vs_tps.png.
# A finished stage is not retrained (delete its runs/ directory to redo it); training resumes from
# its last checkpoint if cut off.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${REFUSION:-.venv/bin/refusion}
QUICK=0
[[ "${1:-}" == "--quick" ]] && QUICK=1
if [[ $QUICK == 1 ]]; then
  RUNS=${RUNS:-runs/study-quick} OUT=${OUT:-results/study-quick} N=${N:-4}
  # a few steps on a few examples, a small tokenizer: exercises every stage end to end
  SHRINK=(--set max_steps=8 --set save_every=4 --set synthetic_examples=200 --set warmup_steps=2)
  BASE_SHRINK=(--set corpus_examples=100 --set vocab_size=300)
else
  RUNS=${RUNS:-runs/study} OUT=${OUT:-results/study} N=${N:-100}
  SHRINK=() BASE_SHRINK=()
fi
TASKS=sort,add,repeat,code
GEN=96
# One thread per process: these models are too small for a second thread to pay, and the fine-tunes
# run side by side on the two cores.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT/logs"

stage() {  # stage NAME CONFIG [extra train args]: train unless the final model exists; keep its logs
  local name=$1 cfg=$2
  shift 2
  if [[ -f $RUNS/$name/model/config.json ]]; then
    echo "study: $name already trained ($RUNS/$name/model)"
  else
    echo "study: training $name ($cfg) -> $RUNS/$name; log $OUT/logs/$name.log"
    $R train --config "$cfg" --set out_dir="$RUNS/$name" "${SHRINK[@]}" "$@" --no-progress > "$OUT/logs/$name.log" 2>&1
  fi
  cp "$RUNS/$name/train_config.json" "$OUT/logs/$name.train_config.json"
  cp "$RUNS/$name/metrics.jsonl" "$OUT/logs/$name.metrics.jsonl"
}

SECONDS=0
stage base configs/study/base.toml "${BASE_SHRINK[@]}"
# the three fine-tunes share nothing but the base: run them side by side, one core each
stage refusion configs/study/refusion.toml --set init="$RUNS/base/model" &
stage ar configs/study/ar.toml --set init="$RUNS/base/model" &
wait
stage mdm configs/study/mdm.toml --set init="$RUNS/base/model"
echo "study: training took $((SECONDS / 60)) min"

SECONDS=0
uptime > "$OUT/logs/eval_load.txt"
ev() {  # ev MODEL LABEL [eval args]
  local model=$1 label=$2
  shift 2
  $R eval --model "$RUNS/$model/model" --label "$label" --task $TASKS --n "$N" --gen-length $GEN \
    --out "$OUT" --overwrite --no-progress "$@"
}
ev base base --decoder ar
ev ar ar --decoder ar
ev refusion refusion --decoder speculative
ev refusion refusion --decoder ar
ev refusion refusion --decoder refusion --slot-size 8 --slot-threshold 0.9 --token-threshold 0.4
ev refusion refusion --decoder refusion --slot-size 8 --slot-threshold 0.7 --token-threshold 0.2 --tag fast
ev mdm mdm --decoder mdm --block-length 32 --steps $GEN
ev mdm mdm --decoder mdm-threshold --block-length 32 --threshold 0.9 --prefix-cache
uptime >> "$OUT/logs/eval_load.txt"
echo "study: evaluation took $((SECONDS / 60)) min"
$R report "$OUT" --out "$OUT/report.md" --plot "$OUT/accuracy_vs_tps.png"
