"""Entry script for the HF -> Orbax converter from a source checkout (same as `gemma4-convert`).

    python converters/convert_hf.py SRC DST [--dtype bfloat16|float32] [--ple int4|int8|none] [--overwrite]

The logic lives in `gemma4_nnx.io.convert` (its command line in `gemma4_nnx.io.convert_cli`) so the
installed console command and this script share it and no generic top-level `converters` package lands
in site-packages.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemma4_nnx.io.convert_cli import main

if __name__ == "__main__":
    sys.exit(main())
