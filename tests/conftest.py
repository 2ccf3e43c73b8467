"""Shared fixtures. JAX float32 matmuls run at highest precision (no TF32/bf16 passes) for parity: the
tests compare float32 against float64 references, and a TPU's default precision multiplies float32 in
bf16 passes (about three digits).

Device: the CPU unless `JAX_PLATFORMS` is set; set but empty (`make test-accelerator`), JAX takes the
accelerator it finds (one process: a TPU is held by one process at a time)."""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # an empty value is kept: JAX then picks the accelerator

# Compiling dominates the suite's time on CPU (a module warm from the cache below runs ~3x faster), and
# many modules, the xdist workers and the server subprocesses compile the same programs. One persistent
# compilation cache per run, made by the first process and inherited through the environment by the
# workers and subprocesses; every program is still compiled at least once per run (a fresh directory,
# removed at the end). Set JAX_COMPILATION_CACHE_DIR yourself to keep one across runs.
_OWN_JAX_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWN_JAX_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gemma4_nnx_jax_cache_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop every compiled program after each test module (the next module compiles its own).

    XLA:CPU maps each executable's code and data into memory (~3-6 mappings each) and unmaps them only
    when the executable is freed; jax's caches keep every one alive. One process running the whole
    suite compiled enough programs to reach Linux's limit of 65,530 mappings (`vm.max_map_count`),
    and the next compile then died with SIGSEGV inside the compiler (seen three times, always in
    test_speculative, ~75% into the suite).
    """
    yield
    import gc

    jax.clear_caches()
    gc.collect()


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _have_google_jax() -> bool:
    try:
        import gemma.gm  # noqa: F401
        import tunix  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    # Tests that need the torch/transformers reference carry the `reference` marker; on an
    # interpreter without them (the Python 3.12 newest-jax CI leg) they are deselected, not skipped.
    # Likewise `interop` (Google's gemma library and tunix), which only `make test-interop` installs.
    missing = set()
    if not _have_torch():
        missing.add("reference")
    if any("interop" in it.keywords for it in items) and not _have_google_jax():
        missing.add("interop")
    keep = [it for it in items if not missing & set(it.keywords)]
    dropped = [it for it in items if missing & set(it.keywords)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    items[:] = heaviest_files_first(items)


# Test files that take longest, heaviest first (the first names the longest). pytest-xdist (`--dist
# loadfile --no-loadscope-reorder`, the Makefile) hands whole files to the workers in collection order;
# left to itself it orders them by test count, so these files of a few long tests (subprocess servers
# over simulated devices, the real weights, notebooks in Jupyter kernels, server fixtures) started last
# and one worker ran them alone at the end. Order from the per-file times each run prints (the
# "slowest test files" summary below); files not named follow, those with more tests first.
HEAVY_FILES = (
    "test_server.py", "test_quantized.py", "test_gemma3_real.py", "test_speculative.py", "test_train_loop.py",
    "test_notebooks.py", "test_serve_tp.py", "test_serve_dp.py", "test_finetune.py", "test_engine_async.py",
    "test_engine_bursts.py", "test_constraints.py", "test_multi_lora.py", "test_server_multimodal.py",
    "test_engine_pacing.py", "test_compile_cache.py", "test_parity.py", "test_sharding.py", "test_isolation.py",
    "test_adapter_safety.py", "test_penalties.py", "test_serve_uds.py", "test_responses.py", "test_logprobs.py",
)  # fmt: skip


def heaviest_files_first(items):
    """`items` grouped by file: HEAVY_FILES in their order, then the other files by test count (most
    first); within a file, the collected order. Stable, so every xdist worker computes the same order."""
    files: dict[str, list] = {}
    for it in items:
        files.setdefault(it.nodeid.split("::")[0], []).append(it)
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}

    def key(entry):
        name = os.path.basename(entry[0])
        return (rank.get(name, len(rank)), -len(entry[1]), entry[0])

    return [it for _, group in sorted(files.items(), key=key) for it in group]


_FILE_SECONDS: dict[str, list[float]] = {}  # file -> [wall seconds, CPU seconds]


def _cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its children that have ended (subprocess servers)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's CPU time (setup, call, teardown) rides on its reports to the controller: wall time on
    a shared machine says more about the neighbours than about the test."""
    start = _cpu_seconds()
    item.user_properties.append(("cpu_start", start))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    start = dict(item.user_properties).get("cpu_start")
    if start is not None and call.when == "teardown":
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - start))
        if os.environ.get("GEMMA4_NNX_TEST_TIMES"):  # a line per test as it ends, for a run cut short
            with open(os.environ["GEMMA4_NNX_TEST_TIMES"], "a") as f:
                f.write(f"{_cpu_seconds() - start:.2f} {item.nodeid}\n")


def pytest_runtest_logreport(report):
    """Per-file wall and CPU time (setup, call and teardown of its tests) for the summary below; under
    xdist the controller receives every worker's reports."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        name = report.nodeid.split("::")[0]
        entry = _FILE_SECONDS.setdefault(name, [0.0, 0.0])
        entry[0] += report.duration
        entry[1] += dict(report.user_properties).get("cpu_seconds", 0.0) if report.when == "teardown" else 0.0


def pytest_terminal_summary(terminalreporter):
    """The 25 test files that took the most CPU time (this process's threads and the subprocesses it
    waited for: where a run's time goes; HEAVY_FILES is ordered by it), with their wall time."""
    if _FILE_SECONDS and not os.environ.get("PYTEST_XDIST_WORKER"):
        top = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1][1])[:25]
        terminalreporter.write_sep("=", "slowest test files (wall seconds, CPU seconds; setup + call + teardown)")
        for name, (seconds, cpu) in top:
            terminalreporter.write_line(f"{seconds:8.1f} {cpu:8.1f} {name}")
        total = sum(cpu for _, cpu in _FILE_SECONDS.values())
        terminalreporter.write_line(f"{'':8} {total:8.1f} CPU seconds in all")


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """get(variant, multimodal=False, google_extras=False) -> (hf_model, checkpoint_dir), cached."""
    from tests import hf_fixtures as fx

    cache: dict = {}

    def get(variant: str, multimodal: bool = False, google_extras: bool = False, sharded: bool = False):
        key = (variant, multimodal, google_extras, sharded)
        if key not in cache:
            model = fx.build_hf_model(variant, multimodal=multimodal)
            out = str(tmp_path_factory.mktemp(f"hf_{variant}_{int(multimodal)}{int(google_extras)}{int(sharded)}"))
            extras = None
            if google_extras:
                prefix = "model.language_model." if multimodal else "model."
                extras = fx.google_style_extras(model, variant, prefix)
                if multimodal:  # a stray vision tensor the text loader must skip
                    import numpy as np

                    extras["model.vision_tower.dummy.weight"] = np.zeros((3, 3), np.float32)
                    extras["model.embed_vision.embedding_projection.weight"] = np.zeros((4, 4), np.float32)
            fx.save_hf_checkpoint(model, out, extra_tensors=extras, max_shard_size="200KB" if sharded else None)
            cache[key] = (model, out)
        return cache[key]

    return get


def pytest_unconfigure(config):
    if _OWN_JAX_CACHE and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_OWN_JAX_CACHE, ignore_errors=True)
