# Sourced by the scripts of a visit to a TPU chip (bench/tpu_run.sh, bench/tpu_train_run.sh): installs what
# the package needs from the chip machine's own package index into /tmp/site, appended to PYTHONPATH so
# that the machine's own jax (with libtpu) stays first. Logs go to $OUT (the device tool's folder).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -f /tmp/site/.done ] || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple \
  --target /tmp/site flax optax orbax-checkpoint safetensors sentencepiece tokenizers pillow ml_dtypes pytest \
  > "$OUT/pip.log" 2>&1 && touch /tmp/site/.done  # once per machine: a second script of the visit skips it
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:$PWD
export JAX_PLATFORMS=${JAX_PLATFORMS-}  # empty: JAX takes the chip (tests/conftest.py keeps it so)
python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())"
