"""Warm starts: the persistent compile cache is on by default in the user's cache folder (here a tmp
XDG_CACHE_HOME), keyed by the package version, and a second process loads what the first compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gemma4_nnx.decode.compiles import _version, compile_cache_dir

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = r"""
import json, sys, time
import jax
from gemma4_nnx.decode.compiles import use_compile_cache

compile_s, hits = [0.0], [0]
def duration(name, secs, **kw):
    if name == "/jax/core/compile/backend_compile_duration":
        compile_s[0] += secs
def event(name, **kw):
    if name == "/jax/compilation_cache/cache_hits":
        hits[0] += 1
jax.monitoring.register_event_duration_secs_listener(duration)
jax.monitoring.register_event_listener(event)
path = use_compile_cache(sys.argv[1])  # what the CLIs do at start
from gemma4_nnx import generate
from tests.helpers import PROMPTS, random_model
generate(random_model("e2b", seed=1), [PROMPTS[0]], 3, stop_tokens=[])
print(json.dumps({"path": str(path), "compile_s": compile_s[0], "hits": hits[0]}))
"""


def _start(xdg: Path, where: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT") and k != "JAX_COMPILATION_CACHE_DIR"
    }
    env.update(XDG_CACHE_HOME=str(xdg), JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, where], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_start_loads_the_first_ones_programs(tmp_path):
    """Process 1 with the default cache (XDG_CACHE_HOME pointed at tmp) writes entries under
    $XDG_CACHE_HOME/gemma4_nnx/jax/gemma4_nnx-<version>; process 2 finds them (cache hits) and its
    backend compile time (jax's own measure, retrieval included) drops below half of the first's."""
    cold = _start(tmp_path, "default")
    where = tmp_path / "gemma4_nnx" / "jax" / f"gemma4_nnx-{_version()}"
    assert cold["path"] == str(where)
    entries = [p for p in where.rglob("*") if p.is_file()]
    assert entries, "the first start wrote no cache entry"
    warm = _start(tmp_path, "default")
    assert warm["hits"] > 0, warm
    assert warm["compile_s"] < 0.5 * cold["compile_s"], (cold, warm)


def test_compile_cache_none_is_off_and_a_directory_gets_a_version_folder(tmp_path):
    """'none' (any case) and None turn the cache off (jax's switch) and make no folder; a directory
    given gets the package version's subfolder."""
    import jax

    from gemma4_nnx.decode.compiles import use_compile_cache

    assert compile_cache_dir("none") is None and compile_cache_dir(None) is None and compile_cache_dir("NONE") is None
    assert compile_cache_dir(tmp_path) == tmp_path / f"gemma4_nnx-{_version()}"
    before = jax.config.jax_enable_compilation_cache
    try:
        assert use_compile_cache("none") is None and not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
    assert not list(tmp_path.iterdir())
