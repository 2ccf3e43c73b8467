#!/usr/bin/env bash
# `make test-accelerator`'s selection on a TPU chip (the device tool), in parts that each fit one command:
# PART=k/n runs the k-th of n parts (the selection's files dealt round-robin, in the Makefile's order);
# REFERENCE=1 first installs torch + transformers from the machine's own index (the `reference` tests).
# One process (one process at a time holds the chip); the log and a JUnit XML go to $OUT.
cd "$(dirname "$0")/.."
T0=$(date +%s)
source bench/tpu_env.sh
if [ -n "${REFERENCE:-}" ] && [ ! -f /tmp/site3/.done ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple \
    --target /tmp/site3 torch transformers > "$OUT/pip-reference.log" 2>&1 && touch /tmp/site3/.done
fi
[ -f /tmp/site3/.done ] && export PYTHONPATH=$PYTHONPATH:/tmp/site3
IFS=/ read -r k n <<< "${PART:-1/1}"
files=($(make -s print-accelerator-tests))
mine=()
for i in "${!files[@]}"; do (( i % n == k - 1 )) && mine+=("${files[$i]}"); done
echo "part $k/$n: ${mine[*]} (set up in $(( $(date +%s) - T0 )) s)"
timeout "${TESTS_S:-540}" python3 -m pytest -q -p no:cacheprovider -rfE -m "not slow" --durations=10 \
  --junitxml="$OUT/junit-$k.xml" "${mine[@]}" > "$OUT/pytest-$k.log" 2>&1
echo "pytest rc=$? after $(( $(date +%s) - T0 )) s"
grep -E "FAILED|ERROR" "$OUT/pytest-$k.log" | head -30; tail -15 "$OUT/pytest-$k.log"
