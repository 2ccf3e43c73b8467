#!/usr/bin/env bash
# Wheels of the server's packages for a TPU machine of the device tool, whose own package index lacks
# them (bench/serve_sweep.py there): run here, in the repository root, with the venv of `make`; the folder
# .whl-tpu/ (ignored through .git/info/exclude) then travels with `carry`, and the visit's command installs
# it first:
#   PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
#     --target /tmp/site2 .whl-tpu/*.whl && export PYTHONPATH=/tmp/site2:$PYTHONPATH
# The versions are the venv's (one of each: two stop the install there); Python 3.11, manylinux x86-64;
# /tmp/site2 goes first on the path: pydantic 2.14 needs a newer typing_extensions than some Pythons hold.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl-tpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl-tpu/ >> .git/info/exclude; }
NAMES="fastapi starlette pydantic pydantic_core anyio h11 click uvicorn annotated-types annotated-doc
  typing-inspection sniffio idna opentelemetry-api typing_extensions prometheus_client python-multipart"
PINS=$(.venv/bin/python - $NAMES <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
PY
)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl-tpu $PINS
ls .whl-tpu
