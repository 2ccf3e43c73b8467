"""Warm starts: the persistent compile cache is on by default in the user's cache folder (here a tmp
XDG_CACHE_HOME), keyed by the package version, and a second process loads what the first compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
generate(random_model("plain", seed=1), [PROMPTS[0]], 3, stop_tokens=[])
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


@pytest.fixture
def jax_cache_settings():
    """jax's compile-cache settings restored (the suite's own cache) after a test that changes them."""
    import jax
    from jax._src import compilation_cache

    names = (
        "jax_enable_compilation_cache",
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
        "jax_persistent_cache_enable_xla_caches",
    )
    before = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in before.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


def _refused(where) -> str:
    """use_compile_cache(where)'s warning, checking that it turned the cache off and returned None."""
    import jax

    from gemma4_nnx.decode.compiles import use_compile_cache

    with pytest.warns(UserWarning, match="--compile-cache") as caught:
        assert use_compile_cache(where) is None
    assert not jax.config.jax_enable_compilation_cache
    message = str(caught[0].message)
    assert "GEMMA4_COMPILE_CACHE" in message and "not used" in message, message
    return message


def test_a_cache_directory_others_can_write_or_that_another_user_owns_is_not_used(tmp_path, jax_cache_settings):
    """The entries are native code the server runs: a directory given with mode 0777, one owned by
    another user, a symbolic link to the 0777 one, and our own directory with a version folder of mode
    0777 inside are each refused (a warning naming the directory, the flag and the environment
    variable; the cache off) and no folder is made inside a refused directory."""
    open_ = tmp_path / "open"
    open_.mkdir()
    open_.chmod(0o777)
    assert "may be written by group or others (mode 777)" in _refused(open_)
    assert not list(open_.iterdir())
    if os.geteuid() == 0:  # root can give a directory away; another user finds / owned by root
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 54321, 54321)
    else:
        foreign = Path("/")
    assert "is owned by uid" in _refused(foreign)
    assert not (foreign / f"gemma4_nnx-{_version()}").exists()
    link = tmp_path / "link"
    link.symlink_to(open_)
    assert f"(a link to {open_})" in _refused(link)
    own = tmp_path / "own"
    (own / f"gemma4_nnx-{_version()}").mkdir(parents=True, mode=0o700)
    own.chmod(0o700)
    (own / f"gemma4_nnx-{_version()}").chmod(0o777)
    assert f"gemma4_nnx-{_version()} may be written" in _refused(own)


def test_a_new_cache_directory_is_private(tmp_path, jax_cache_settings):
    """Folders the cache makes are 0700, its parents included (whatever the umask leaves); an existing
    version folder of ours that others may read is narrowed to 0700."""
    import stat

    from gemma4_nnx.decode.compiles import use_compile_cache

    path = use_compile_cache(tmp_path / "a" / "b")
    assert path == tmp_path / "a" / "b" / f"gemma4_nnx-{_version()}"
    for d in (tmp_path / "a", tmp_path / "a" / "b", path):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, (d, oct(d.stat().st_mode))
    older = tmp_path / "older" / f"gemma4_nnx-{_version()}"
    older.mkdir(parents=True)
    older.chmod(0o755)
    assert use_compile_cache(tmp_path / "older") == older
    assert stat.S_IMODE(older.stat().st_mode) == 0o700


def test_a_moved_cache_directory_keeps_its_entries_keys(tmp_path, jax_cache_settings):
    """The same program compiled with the cache in two directories is stored under the same entry
    names: the key does not hold the directory's path (jax's GPU autotuning cache, on by default, put
    it in every program's compile options), so a moved or linked cache still gives warm starts."""
    import jax
    import numpy as np

    from gemma4_nnx.decode.compiles import use_compile_cache

    names = []
    for where in ("one", "two"):
        path = use_compile_cache(tmp_path / where)
        jax.clear_caches()  # compiled again, not found in memory
        jax.jit(lambda x: x * 3.0 + 1.0)(np.arange(4, dtype=np.float32)).block_until_ready()
        names.append(sorted(p.name for p in path.iterdir()))
    assert names[0] and names[0] == names[1], names
