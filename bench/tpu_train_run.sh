#!/usr/bin/env bash
# One prepared visit to a TPU chip for the trainer (bench/train_accelerator.py): installs the package's
# needs from the chip machine's own index beside its jax, then one process per configuration.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple \
  --target /tmp/site flax optax orbax-checkpoint safetensors sentencepiece tokenizers pillow ml_dtypes > "$OUT/pip.log" 2>&1
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:$PWD
python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/train.log"
while [ $# -gt 0 ]; do
  echo "== $1" | tee -a "$OUT/train.log"
  timeout "${PER_RUN_S:-200}" python3 bench/train_accelerator.py $1 --out "$OUT/train.jsonl" 2>&1 | grep -v "hugepages\|warnings.warn" | tee -a "$OUT/train.log"
  shift
done
