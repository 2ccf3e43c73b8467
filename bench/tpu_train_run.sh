#!/usr/bin/env bash
# One visit to a TPU chip for the trainer (the device tool: `bash bench/tpu_train_run.sh "ARGS" "ARGS" ...`):
# one process per configuration of bench/train_accelerator.py, each within PER_RUN_S; logs and JSON in $OUT.
cd "$(dirname "$0")/.."
source bench/tpu_env.sh
while [ $# -gt 0 ]; do
  echo "== $1" | tee -a "$OUT/train.log"
  timeout "${PER_RUN_S:-300}" python3 bench/train_accelerator.py $1 --out "$OUT/train.jsonl" 2>&1 \
    | grep -v "hugepages\|warnings.warn" | tee -a "$OUT/train.log"
  shift
done
