#!/usr/bin/env bash
# The small-scale reproduction of the paper's comparison (issue 5, README "The study"):
# three models of one size, one data mixture, one budget; each evaluated with its natural decoders.
#   bash scripts/study.sh            # about an hour on 2 CPU cores
#   N=200 bash scripts/study.sh      # more test samples per task (default 50)
# Trained models go to runs/, results to results/study/ (per-sample JSONL + summary JSON per run),
# the table to results/study/report.md and the plot to results/study/accuracy_vs_tps.png.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${REFUSION:-.venv/bin/refusion}
N=${N:-50}
OUT=${OUT:-results/study}
TASKS=arith,code,choice,table
GEN=160

$R train --config configs/refusion-tiny.toml --no-progress
$R train --config configs/refusion-tiny.toml --objective ar --out runs/ar-tiny --no-progress
$R train --config configs/refusion-tiny.toml --objective mdm --out runs/mdm-tiny --no-progress

ev() { $R eval --task $TASKS --n "$N" --gen-length $GEN --out "$OUT" --overwrite --no-progress "$@"; }
ev --model runs/refusion-tiny/model --label refusion --decoder refusion --slot-size 8 --slot-threshold 0.9 --token-threshold 0.4
ev --model runs/refusion-tiny/model --label refusion --decoder ar
ev --model runs/ar-tiny/model --label ar --decoder ar
ev --model runs/mdm-tiny/model --label mdm --decoder mdm --block-length 32 --steps $GEN
ev --model runs/mdm-tiny/model --label mdm --decoder mdm-threshold --block-length 32 --threshold 0.9 --prefix-cache
$R report "$OUT" --out "$OUT/report.md" --plot "$OUT/accuracy_vs_tps.png"
