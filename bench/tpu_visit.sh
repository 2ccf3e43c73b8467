#!/usr/bin/env bash
# One visit to a TPU chip running several prepared commands in turn (the device tool:
# `bash bench/tpu_visit.sh "240:python3 bench/serve_sweep.py ..." "120:python3 bench/tpu_gather.py ..."`):
# each "LIMIT:COMMAND" runs within LIMIT seconds (the last one within what is left of TOTAL_S, default 570),
# its output in $OUT/visit.log and $OUT/<n>.log; the commands write their JSON under $OUT themselves.
cd "$(dirname "$0")/.."
T0=$(date +%s)
source bench/tpu_env.sh
n=0
while [ $# -gt 0 ]; do
  n=$((n + 1)) limit=${1%%:*} run=${1#*:}
  left=$(( ${TOTAL_S:-570} - ( $(date +%s) - T0 ) ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then echo "== $n skipped (no time left): $run" | tee -a "$OUT/visit.log"; shift; continue; fi
  echo "== $n (limit $limit s, at $(( $(date +%s) - T0 )) s): $run" | tee -a "$OUT/visit.log"
  timeout "$limit" bash -c "$run" > "$OUT/$n.log" 2>&1
  echo "== $n rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/visit.log"
  grep -v "hugepages\|warnings.warn\|Warning" "$OUT/$n.log" | tail -40
  shift
done
