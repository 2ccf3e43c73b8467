#!/usr/bin/env bash
# One visit to a TPU chip for the trainer (the device tool: `bash bench/tpu_train_run.sh "ARGS" "ARGS" ...`):
# one process per configuration of bench/train_accelerator.py, each within PER_RUN_S seconds (default
# 300), or its own limit written before it ("420:--model e2b --method qlora ..."); logs and JSON in $OUT.
cd "$(dirname "$0")/.."
source bench/tpu_env.sh
while [ $# -gt 0 ]; do
  limit=${PER_RUN_S:-300} run=$1
  if [[ $run =~ ^([0-9]+):(.*)$ ]]; then limit=${BASH_REMATCH[1]} run=${BASH_REMATCH[2]}; fi
  echo "== $run (limit $limit s)" | tee -a "$OUT/train.log"
  timeout "$limit" python3 bench/train_accelerator.py $run --out "$OUT/train.jsonl" 2>&1 \
    | grep -v "hugepages\|warnings.warn" | tee -a "$OUT/train.log"
  shift
done
