#!/usr/bin/env bash
# One visit to a TPU chip (the device tool: `bash bench/tpu_run.sh`): bench/accelerator.py, then the
# accelerator test selection (`make test-accelerator`'s files) in one process; logs and JSON in $OUT.
# BENCH_ARGS / BENCH_S: the benchmark's arguments and time limit; TOTAL_S: the visit's; TESTS: the files.
cd "$(dirname "$0")/.."
T0=$(date +%s)
source bench/tpu_env.sh
echo "set up in $(( $(date +%s) - T0 )) s"
timeout "${BENCH_S:-290}" python3 bench/accelerator.py ${BENCH_ARGS:---modes bf16,int8,int4 --batches 1,64 --prefill 1024,8192 --depth 8192} \
  --out "$OUT/accelerator.json" 2>&1 | grep -v Warning | tee "$OUT/bench.log"
echo "bench done $(( $(date +%s) - T0 )) s"
LEFT=$(( ${TOTAL_S:-570} - ( $(date +%s) - T0 ) ))
timeout $LEFT python3 -m pytest -v -p no:cacheprovider -rfE -m "not slow" ${TESTS:-$(make -s print-accelerator-tests)} > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? after $(( $(date +%s) - T0 )) s"
grep -cE " PASSED" "$OUT/pytest.log"; grep -E " FAILED| ERROR" "$OUT/pytest.log" | head -30; tail -5 "$OUT/pytest.log"
