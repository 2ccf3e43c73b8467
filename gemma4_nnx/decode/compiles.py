"""Compile management of the decode core: counting the programs compiled, and draw and verify
programs compiled off the caller's thread.

`compiled_programs()` counts each jitted program's compiled variants in this process; a `Decoder`
counts its own (`Decoder.compiles`, by kind) from jax's lowering events on the thread that runs it.

`Compiles` (mixed into `Decoder`) also keeps which draw programs have run and a helper thread
(`HelperQueue`: what a waiting request needs first) that compiles more ahead of time, from the
shapes and placements of placeholder rows (nothing runs there, so it is safe beside multi-device
programs): the engine serves a request whose exact sampler has not compiled yet with the precompiled
`DrawConfig.widest()` of its top-k width (same tokens) while the exact one compiles there (`cover`).
A decode step is one program, the decode and its draw fused (`programs._step`, one dispatch per
step), one per (sampler, m); the engine's decoder (`fuse_after`) runs a step whose fused program has
not compiled as two, the decode program (one per m, whatever the sampler) and the draw, and once a
sampler has taken `FUSE_AFTER` such steps at m its fused program compiles there (`compile_step`): a
sampler used for a few steps only costs no compile of the whole model's step, and the serving thread
never compiles one. A burst (several steps in one program, `programs._burst`), one per (sampler, m,
steps), compiles there too, queued with its sampler's fused step (`burst_ready`); meanwhile the
engine takes single steps. Verify programs (speculative decoding) compile there ahead of time from abstract
shapes (`compile_verify`); the engine takes plain steps meanwhile."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import stat
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_nnx.decode.batching import pow2
from gemma4_nnx.decode.programs import (
    PROGRAMS,
    _burst_jit,
    _decode_jit,
    _draw_jit,
    _prefill_jit,
    _step_jit,
    _verify_jit,
)
from gemma4_nnx.decode.state import DrawConfig, Next

__all__ = [
    "FUSE_AFTER",
    "Compiles",
    "HelperQueue",
    "compile_cache_dir",
    "compiled_programs",
    "default_compile_threads",
    "use_compile_cache",
    "verify_width",
]


# ------------------------------------------------------------------------------------------- the compile cache
def compile_cache_dir(where: str | os.PathLike | None = "default") -> Path | None:
    """Where `use_compile_cache(where)` keeps compiled programs (None and "none": nowhere, the cache
    is off): "default": the user's cache folder, `$XDG_CACHE_HOME` or `~/.cache`, then
    `gemma4_nnx/jax`; any other value is that directory. Either way a subfolder
    named for this package's version (`gemma4_nnx-<version>`) holds the entries, so another
    version never reads them (jax's own key covers the jax, jaxlib and XLA versions, the program
    and the devices)."""
    if where is None or str(where).strip().lower() == "none":
        return None
    if str(where) == "default":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "gemma4_nnx", "jax")
    return Path(where).expanduser() / f"gemma4_nnx-{_version()}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gemma4_nnx")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "dev"


def add_compile_cache_flag(parser) -> None:
    """`--compile-cache` of every command that compiles (gemma4-serve, gemma4-generate,
    gemma4-finetune); the command passes its value to `use_compile_cache` at start."""
    parser.add_argument(
        "--compile-cache",
        default=os.environ.get("GEMMA4_COMPILE_CACHE", "default"),
        help="jax's persistent compilation cache (warm starts): a directory, 'default' (the user's cache folder: "
        "$XDG_CACHE_HOME or ~/.cache, then gemma4_nnx/jax; a subfolder per package version), or 'none' (off); "
        "env GEMMA4_COMPILE_CACHE",
    )


def use_compile_cache(where: str | os.PathLike | None = "default") -> Path | None:
    """Turn jax's persistent compilation cache on at `compile_cache_dir(where)` (off for None /
    "none"), with no minimum compile time or entry size, so the small programs of a decode (a
    draw, a step of a tiny model) are kept too: a second process loads what the first compiled
    instead of compiling it. Returns the directory (None: off). The CLIs call this at start
    (`--compile-cache`); it changes process-wide jax settings, so the package never calls it on
    import. Call it before the first compile: jax reads the setting once. "default" when jax's own
    setting names a directory already (`JAX_COMPILATION_CACHE_DIR`, the test suite's): that one
    stays, as it is.

    The entries are native code this process will run, so the directory must be private: missing
    folders are made 0700, and a directory (or a symbolic link to one) that another user owns or that
    group / others may write is not used: a warning names it and the fix, and the cache is off
    (`_private_dir`)."""
    if str(where) == "default" and jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    path = compile_cache_dir(where)
    problem = None if path is None else _private_dir(path)
    if problem is not None:
        warnings.warn(
            f"gemma4_nnx: the compile cache {problem}: its entries are native code this process would run, so it "
            "is not used (no compile cache this run). Fix its owner / mode (chown, chmod 700), or give a "
            "directory of your own with --compile-cache DIR (env GEMMA4_COMPILE_CACHE), or 'none'",
            stacklevel=2,
        )
    if path is None or problem is not None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", os.fspath(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # jax's default also keeps XLA's GPU autotuning results under the directory, and for that puts the
    # directory's path in every program's compile options, which its cache key hashes: a cache moved,
    # or reached through another path (a symbolic link, a volume mounted elsewhere), then missed every
    # entry. The compiled programs themselves are what warm starts read.
    with contextlib.suppress(AttributeError):  # a jax without the option
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    try:  # a cache jax already set up (or left off) in this process follows the new setting
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass
    return path


def _private_dir(path: Path) -> str | None:
    """Make `path` (mode 0700, with its missing parents); None when it and its parent (the directory
    given) are this user's and no one else may write them, else what is wrong, for a message; a
    refused parent gets no folder made in it. Symbolic links are followed: a link to such a directory
    is refused as it is. A cache folder of this user that others may read is narrowed to 0700 (its
    entries, written with the process's umask, are then out of their reach)."""
    try:
        for d in (path.parent, path):
            if not os.path.lexists(d):
                _make_dirs(d)
            info, real = os.stat(d), os.path.realpath(d)
            where = f"directory {d}" + (f" (a link to {real})" if real != os.path.abspath(d) else "")
            if not stat.S_ISDIR(info.st_mode):
                return f"path {d} is not a directory"
            if info.st_uid != os.geteuid():
                return f"{where} is owned by uid {info.st_uid}, not by this process's user (uid {os.geteuid()})"
            if info.st_mode & 0o022:
                return f"{where} may be written by group or others (mode {stat.S_IMODE(info.st_mode):o})"
        if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
            os.chmod(path, 0o700)
    except OSError as e:
        return f"directory {path} cannot be made or read ({e.strerror})"
    return None


def _make_dirs(path: Path) -> None:
    """`path` and its missing parents, each 0700 (`Path.mkdir(parents=True)` makes the parents 0777 less
    the umask)."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700)  # the umask can only take bits away


def default_compile_threads() -> int:
    """Programs the engine's precompile compiles at once: the cores this process may run on, at most 8
    (each compile of a large model's step holds a few GB of host memory)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


#: Steps a (sampler, rows) pair of the engine runs as two programs (decode, then draw) before its fused
#: step program (`programs._step`, one dispatch) compiles on the helper thread (`Compiles.fuse_after`).
FUSE_AFTER = 32


def verify_width(ndraft: np.ndarray, k: int) -> int:
    """The draft columns a verify step runs for proposals of `ndraft` [m] drafts each (at most k): as
    many as the longest, bucketed to 1, 2, 4, ... (one program each), so a step whose rows propose
    little costs little."""
    return min(pow2(int(ndraft.max())), k) if len(ndraft) else 0


def _abstract(x):
    """The shape, dtype and placement of an array: what a program compiled for it is keyed on."""
    sharding = x.sharding if getattr(x, "_committed", True) else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)


def compiled_programs() -> dict[str, int]:
    """How many programs each jitted stage has compiled in this process (all decoders together)."""
    return {name: fn._cache_size() for name, fn in PROGRAMS.items()}


# ------------------------------------------------------------------------------------------- compile counting
_counting = threading.local()  # .counts: the dict of the Decoder whose program this thread is running
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def _on_event(name: str, *args, **kwargs) -> None:
    counts = getattr(_counting, "counts", None)
    if counts is not None and name == _LOWERING_EVENT:
        counts[_counting.kind] = counts.get(_counting.kind, 0) + 1


_listening = False
_listen_lock = threading.Lock()


def _listen() -> None:
    """Register the compile listener once (on first use of a Decoder, not at import)."""
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True


# ------------------------------------------------------------------------------------------- the decoder's share
class HelperQueue:
    """The helper thread's jobs: one thread (a `ThreadPoolExecutor` of one: the process's exit stops it
    as it stops any pool) running them one at a time: the **urgent** ones (a request waits in the queue
    for them: its prompt's prefill program, its sampler), then those wanted **soon** (the rows running
    now go faster with them: fused step and verify programs), then the others (queued ahead for
    later: the precompile's last supersets, pacing widths), each kind in the order queued.
    `submit(key, work, urgent, soon)` returns the job's future; `promote(key)` makes a job still queued
    urgent (a request now needs what was queued for later). Each submission adds one run of
    `_next` to the pool, which takes the most urgent job left, so every job runs once."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gemma4-compile")
        self._lock = threading.Lock()
        self._jobs: list[list] = []  # [rank (0 urgent, 1 soon, 2 later), sequence number, key, work, future]
        self._order = itertools.count()

    def submit(self, key, work, urgent: bool = False, soon: bool = False) -> Future:
        future: Future = Future()
        with self._lock:
            self._jobs.append([0 if urgent else 1 if soon else 2, next(self._order), key, work, future])
        self._pool.submit(self._next)
        return future

    def promote(self, key) -> None:
        with self._lock:
            for job in self._jobs:
                if job[2] == key:
                    job[0] = 0

    def _next(self) -> None:
        with self._lock:
            if not self._jobs:
                return
            job = min(self._jobs, key=lambda j: (j[0], j[1]))
            self._jobs.remove(job)
        work, future = job[3], job[4]
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as e:  # the job's own error, for whoever waits on its future
            future.set_exception(e)

    def shutdown(self, wait: bool = False) -> None:
        """Drop the jobs not started (their futures cancelled); the one running finishes (`wait`: this
        call returns after it)."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            job[4].cancel()
        self._pool.shutdown(wait=wait, cancel_futures=True)


class Compiles:
    """The compile bookkeeping of a `Decoder` (a mixin: it uses the decoder's `rows`, `mesh`,
    `config`, `vocab_size`, `stop_width`, `graphdef`, `weights`, `state`, `_place`, `build_rows` and
    `_mask`).

    compiles: the programs this decoder had to compile, by kind ("draw (background)", "verify
    (background)": on the helper thread). draw_failures / verify_failures: programs whose background
    compile raised (the caller then compiles them itself, and sees the error)."""

    def _init_compiles(self) -> None:
        _listen()
        self.compiles: dict[str, int] = {}
        self._draws_run: set[tuple] = set()  # (cfg, shape key) of every draw program run so far
        self._verifies_run: set[tuple] = set()  # (cfg, m, width) of every verify program run or compiled
        self._steps_run: set[tuple] = set()  # (cfg, stop width, m) of every fused step program run or compiled
        self.step_failures: set[tuple] = set()  # ... whose background compile raised
        self._bursts_run: set[tuple] = set()  # (cfg, stop width, m, steps) of every burst program run or compiled
        self.burst_failures: set[tuple] = set()  # ... whose background compile raised
        # None: a step compiles its fused program when it has not (`generate_stream`); a number (the
        # engine's): a step whose fused program has not compiled runs the decode and draw programs,
        # and after this many such steps of its (sampler, m) the fused one compiles on the helper thread
        self.fuse_after: int | None = None
        self._apart_steps: dict[tuple, int] = {}  # (cfg, stop width, m) -> steps run as two programs
        self._prefills_run: set[tuple] = set()  # (rows, chunk width, with soft tokens) of every engine prefill
        self.prefill_failures: set[tuple] = set()  # ... whose background compile raised
        self._background: HelperQueue | None = None  # the helper thread's jobs (created on first use)
        self._compiling: set[tuple] = set()  # (cfg, shapes) jobs queued or running there
        self.draw_failures: set[DrawConfig] = set()
        self.verify_failures: set[tuple] = set()  # (cfg, m, width) whose background compile raised
        self._stopped = False

    @property
    def compiles_pending(self) -> int:
        """Compiles queued or running on the helper thread (`/metrics`: `gemma4_compiles_pending`)."""
        return len(self._compiling)

    def stop_compiling(self) -> None:
        """Drop the background compiles not yet started (the one running finishes: a compile cannot be
        interrupted) and queue no more, so a closed engine leaves no helper thread working for
        minutes, nor holds up the process's exit (which joins that thread)."""
        self._stopped = True
        if self._background is not None:
            self._background.shutdown()

    def _run(self, kind: str, fn, *args):
        """fn(*args), its compiles counted in `compiles[kind]`."""
        _counting.counts, _counting.kind = self.compiles, kind
        try:
            return fn(*args)
        finally:
            _counting.counts = None

    def _draw_key(self, cfg: DrawConfig, n: int, indexed: bool, init: bool) -> tuple:
        return (cfg, self.stop_width, n, indexed, init)

    def row_bucket(self, n: int, joining: bool) -> int:
        """The rows a program runs for `n` rows: the first power of `row_factor` >= n, at most `rows` (a
        step of the first m rows) or pow2(`rows`) (`joining` rows, padded: the padding is dropped).
        `row_factor` 2 (a CPU: a step's cost grows with its rows) or 4 (an accelerator: a step reads
        the weights whatever its rows, so fewer programs to compile at start-up)."""
        m = 1
        while m < n:
            m *= self.row_factor
        return min(m, pow2(self.rows) if joining else self.rows)

    def draw_shapes(self, joining: bool) -> list[tuple[int, bool, bool]]:
        """(rows drawn, indexed, with init) of every draw the engine makes: a step of the first m
        rows, or `joining` rows written first; m and the joining count each a `row_bucket`."""
        key = (joining, self.rows, self.row_factor)  # asked per pending request at every loop turn: kept
        shapes = self.__dict__.setdefault("_draw_shapes", {})
        if key not in shapes:
            sizes = sorted({self.row_bucket(n, joining) for n in range(1, self.rows + 1)})
            shapes[key] = [(n, True, True) if joining else (n, n != self.rows, False) for n in sizes]
        return list(shapes[key])

    def draw_ready(self, cfg: DrawConfig, shape: tuple[int, bool, bool]) -> bool:
        """Whether `cfg` draws at `shape` without compiling: its draw program ran or compiled, or (a
        step's shape: m rows, no init) its fused step program did."""
        n, _, init = shape
        return self._draw_key(cfg, *shape) in self._draws_run or (not init and self.step_ready(cfg, n))

    def step_ready(self, cfg: DrawConfig, m: int) -> bool:
        return (cfg, self.stop_width, m) in self._steps_run

    def compile_step(self, cfg: DrawConfig, m: int):
        """Compile the fused step program (`programs._step`: decode and draw of the first m rows) of
        `cfg` on the helper thread, ahead of time from the shapes and placements of the decoder's
        weights, cache and rows (a step rewrites the cache: it cannot run on placeholders). Returns
        the future, or None (queued already, compiled, failed before, or stopped)."""
        key = (cfg, self.stop_width, m)
        if key in self.step_failures:
            return None

        # a failure: the serving thread goes on with the decode and draw programs
        args = functools.partial(self._step_args, cfg, m)
        return self._compile_ahead("step", key, _step_jit, args, self._steps_run, self.step_failures)

    def burst_ready(self, cfg: DrawConfig, m: int, steps: int, queue: bool = True) -> bool:
        """Whether the burst program of `cfg` (`steps` decode steps of the first m rows,
        `programs._burst`) has run or compiled. When not (and `queue`), its compile is queued on the
        helper thread once `cfg`'s single steps at m are due their fused program (it compiled, or
        they passed `fuse_after`: the burst compiles after it), so a sampler used for a few steps
        compiles no burst; a failed compile is not queued again (the engine keeps single steps)."""
        key = (cfg, self.stop_width, m, steps)
        if key in self._bursts_run:
            return True
        due = self.fuse_after is None or self.step_ready(cfg, m)
        due = due or self._apart_steps.get((cfg, self.stop_width, m), 0) > self.fuse_after
        if queue and due and key not in self.burst_failures and not cfg.constrained:
            args = functools.partial(self._burst_args, cfg, m, steps)
            self._compile_ahead("burst", key, _burst_jit, args, self._bursts_run, self.burst_failures)
        return False

    def _burst_args(self, cfg: DrawConfig, m: int, steps: int, state: tuple | None = None) -> tuple:
        """The burst program's abstract arguments (`state`: `_abstract_state()`, read here if None)."""
        return (cfg, m, steps, *(self._abstract_state() if state is None else state))

    def _step_args(self, cfg: DrawConfig, m: int, state: tuple | None = None) -> tuple:
        """The fused step program's abstract arguments (`state`: `_abstract_state()`, read here if None)."""
        state = self._abstract_state() if state is None else state
        return (cfg, m, *state, jax.tree.map(_abstract, self._mask(cfg, m, None)))

    def cover(self, cfg: DrawConfig, shape: tuple[int, bool, bool]) -> DrawConfig | None:
        """The program to draw `cfg` with, at this shape, without compiling: `cfg` itself once it ran,
        else its `widest()` (same tokens) while `cfg` compiles in the background; None when neither is
        ready (the caller compiles)."""
        if self.draw_ready(cfg, shape):
            return cfg
        if cfg not in self.draw_failures and self.draw_ready(cfg.widest(), shape):
            self.compile_draws(cfg, [shape], background=True)
            return cfg.widest()
        return None

    def verify_ready(self, cfg: DrawConfig, m: int, width: int) -> bool:
        return (cfg, m, width) in self._verifies_run

    def compile_verify(self, cfg: DrawConfig, m: int, width: int):
        """Compile the verify program of `cfg` for the first m rows and `width` draft columns on the
        helper thread, ahead of time from the shapes of the decoder's weights, cache and rows: a verify
        step rewrites the cache, so unlike a draw it cannot be compiled by running it on placeholders
        without a second cache. jax's ahead-of-time compile fills the cache its calls look in, so the
        first real call runs the compiled program. Returns the future, or None (queued already,
        compiled, or stopped)."""
        key = (cfg, m, width)

        def args() -> tuple:
            rows = (jax.ShapeDtypeStruct((m, width), jnp.int32), jax.ShapeDtypeStruct((m,), jnp.int32))
            return (cfg, m, *self._abstract_state(), *rows)

        # a failure: the caller then compiles it itself, and sees the error
        return self._compile_ahead("verify", key, _verify_jit, args, self._verifies_run, self.verify_failures)

    def _abstract_state(self) -> tuple:
        """(graphdef, weights, cache, rows) as a program compiled ahead of time takes them: the arrays'
        shapes, dtypes and placements (read here: the serving thread replaces the state)."""
        state = self.state
        weights, cache, rows = (jax.tree.map(_abstract, t) for t in (self.weights, state.cache, state.rows))
        return self.graphdef, weights, cache, rows

    def _compile_ahead(self, kind: str, key: tuple, jitted, make_args, done: set, failures: set):
        """Compile `jitted` for the abstract arguments `make_args()` on the helper thread (jax's
        ahead-of-time compile fills the cache its calls look in): `key` joins `done`, or `failures` if it
        raised. Returns the future, or None (queued already, compiled, or stopped). The arguments are
        read on the calling thread, and only when the job is queued: the serving thread asks at every
        step while the program compiles, and reading the shapes of every weight, cache and row array
        of a full-size model takes milliseconds of it."""
        if key in done or (kind, *key) in self._compiling or self._stopped:
            return None
        args = make_args()

        def build() -> None:
            self._run(f"{kind} (background)", lambda: jitted.lower(*args).compile())
            done.add(key)

        # soon: the rows running now go faster with it (the later-queued supersets serve rare requests)
        return self._queue((kind, *key), build, functools.partial(failures.add, key), soon=True)

    def prefill_ready(self, rows: int, width: int, soft: bool = False) -> bool:
        """Whether the prefill program of `rows` joining rows (indexed) and chunks of `width` columns
        has run or compiled (its background compile failed: True, the caller compiles and sees why)."""
        key = (rows, width, soft)
        return key in self._prefills_run or key in self.prefill_failures

    def compile_prefills(self, shapes, *, then=None, urgent: bool = False, first=None):
        """Compile the indexed prefill program (the engine's) for each (rows, chunk width) of `shapes`
        on the helper thread, ahead of time from the shapes and placements of the weights, the cache
        and placeholder prompts (nothing runs, the cache is not touched), one job a program (so a job
        another request waits for runs between them); `then()` after each. A request whose prompt
        needs one of them waits in the queue meanwhile, the running rows decode on (the engine's
        `_take_joining`): `urgent` makes `first` (the (rows, width) it needs; every shape when None)
        run before the helper's jobs for later, a shape already queued moved up. Returns the future
        of the last job queued (None: all queued already, compiled, or stopped). The weights' and the
        cache's shapes are read on the calling thread (the serving thread replaces the cache) and only
        when a job is queued: the serving thread asks at every step while a request waits (as
        `_compile_ahead`)."""
        future, state = None, None
        for r, w in sorted({(r, w) for r, w in shapes if (r, w, False) not in self._prefills_run}):
            now = urgent and (first is None or first == (r, w))
            if state is None and ("prefill", r, w) not in self._compiling and not self._stopped:
                state = self._abstract_state()

            def build(key=(r, w, False), state=state) -> None:
                if key not in self._prefills_run:
                    graphdef, weights, cache, _ = state
                    args = self._prefill_placeholders(*key[:2])
                    lower = functools.partial(_prefill_jit.lower, graphdef, weights, cache, *args)
                    self._run("prefill (background)", lambda: lower().compile())
                    self._prefills_run.add(key)

            failed = functools.partial(self.prefill_failures.add, (r, w, False))
            future = self._queue(("prefill", r, w), build, failed, then, now) or future
        return future

    def _prefill_placeholders(self, r: int, w: int) -> tuple:
        """Abstract arguments of an indexed prefill chunk after (graphdef, weights, cache), placed as
        `Decoder.prefill_chunks` places the real ones."""
        logits, last, idx, adapter = self._place(
            (
                Next(np.zeros((r, self.vocab_size), np.float32), np.zeros((r, self.config.hidden_size), np.float32)),
                np.zeros(r, np.int32),
                np.zeros(r, np.int32),
                np.zeros(r, np.int32) if self.banked else None,
            )
        )
        ids, pos, valid, c0, first = self._place(
            (np.zeros((r, w), np.int32), np.zeros((r, w), np.int32), np.zeros((r, w), bool), np.int32(0),
             np.ones(r, bool))
        )  # fmt: skip
        real = (idx, ids, pos, valid, last, logits, c0, first)
        return (*jax.tree.map(_abstract, real), None, None if adapter is None else _abstract(adapter))

    def _queue(self, job, build, failed, then=None, urgent: bool = False, soon: bool = False):
        """Queue `build()` (a compile) on the helper thread as `job` (in `_compiling` until it ends;
        `failed()` if it raises, `then()` after it either way); returns its future, or None when `job`
        is queued or running already (moved up if `urgent`) or the helper is stopped."""
        if job in self._compiling:
            if urgent and self._background is not None:
                self._background.promote(job)
            return None
        if self._stopped:
            return None

        def work() -> None:
            try:
                build()
            except Exception:
                failed()
            finally:
                self._compiling.discard(job)
                if then is not None:
                    then()

        if self._background is None:
            self._background = HelperQueue()
        self._compiling.add(job)
        return self._background.submit(job, work, urgent, soon)

    def compile_draws(self, cfg: DrawConfig, shapes, *, background: bool = False, then=None, urgent: bool = False):
        """Compile the draw program of `cfg` at each shape, ahead of time from placeholder rows (the
        decoder's state is not touched); `then()` after the last (in the background: after each).
        `background`: on the helper thread, one job a shape (so a job a request waits for runs between
        them; `urgent`: a request waits for these, shapes already queued are moved up). Returns the
        future of the last job queued (None: all queued already, or stopped)."""

        def compile_each(shapes) -> None:
            for shape in shapes:
                key = self._draw_key(cfg, *shape)
                if key not in self._draws_run:
                    self._compile_draw(cfg, *shape)
                    self._draws_run.add(key)

        if not background:
            try:
                return compile_each(shapes)
            except Exception:
                self.draw_failures.add(cfg)  # the caller then compiles it itself, and sees the error
                raise
            finally:
                if then is not None:
                    then()
        failed = functools.partial(self.draw_failures.add, cfg)  # the caller then compiles it, and sees why
        future = None
        for shape in shapes:
            queued = self._queue((cfg, tuple(shape)), functools.partial(compile_each, [shape]), failed, then, urgent)
            future = queued or future
        return future

    def _compile_draw(self, cfg: DrawConfig, n: int, indexed: bool, init: bool) -> None:
        """Compile the draw program of `cfg` at this shape ahead of time, from placeholders placed as
        the real arguments are (nothing runs: safe beside multi-device programs on the caller's thread)."""
        self._run("draw (background)", lambda: self._lower_draw(cfg, n, indexed, init).compile())

    def _lower_draw(self, cfg: DrawConfig, n: int, indexed: bool, init: bool):
        """The draw program of `cfg` at this shape, lowered from placeholders placed as the real
        arguments are."""
        hidden = self.config.hidden_size
        nxt = self._place(Next(jnp.zeros((n, self.vocab_size), jnp.float32), jnp.zeros((n, hidden), jnp.float32)))
        rows = self._place(self.build_rows([None] * self.rows))
        idx = jnp.asarray(np.arange(n) % self.rows, jnp.int32) if indexed else None
        start = self._place(self.build_rows([None] * n)) if init else None
        args = jax.tree.map(_abstract, (rows, idx, nxt, start, self._mask(cfg, n, None)))
        return _draw_jit.lower(cfg, *args)

    def compile_together(self, steps=(), draws=(), prefills=(), threads: int = 1, fused=(), bursts=()) -> None:
        """Compile ahead of time, `threads` at once, the decode program of each row count in `steps`,
        the draw program of each (cfg, shape) in `draws`, the indexed prefill program of each (rows,
        chunk width) in `prefills`, the fused step program (`programs._step`) of each (cfg, m) in
        `fused` and the burst program (`programs._burst`) of each (cfg, m, steps) in `bursts` (the
        engine's precompile; a first call finds them in jax's cache).
        Tracing and lowering run here one after another (they hold the GIL); XLA's compiles run on a
        pool of `threads`, side by side (they release it): an accelerator host's cores compile an E2B
        engine's ~30 programs together instead of one by one. The first failure raises here."""
        from concurrent.futures import ThreadPoolExecutor

        graphdef, weights, cache, rows = self._abstract_state()
        adapter = rows.adapter if self.banked else None

        def decode(m):
            return _decode_jit.lower(m, graphdef, weights, cache, rows.token, rows.pos, rows.done, adapter)

        def prefill(r, w):
            return _prefill_jit.lower(graphdef, weights, cache, *self._prefill_placeholders(r, w))

        # (kind, lowering, the set its key joins once compiled, the key)
        jobs = [("decode", functools.partial(decode, m), None, None) for m in steps]
        jobs += [("prefill", functools.partial(prefill, r, w), self._prefills_run, (r, w, False)) for r, w in prefills]
        jobs += [
            ("draw", functools.partial(self._lower_draw, cfg, *shape), self._draws_run, self._draw_key(cfg, *shape))
            for cfg, shape in draws
        ]
        state = (graphdef, weights, cache, rows)
        jobs += [
            ("step", functools.partial(_step_jit.lower, *self._step_args(cfg, m, state)), self._steps_run,
             (cfg, self.stop_width, m))
            for cfg, m in fused
        ]  # fmt: skip
        jobs += [
            ("burst", functools.partial(_burst_jit.lower, *self._burst_args(cfg, m, k, state)), self._bursts_run,
             (cfg, self.stop_width, m, k))
            for cfg, m, k in bursts
        ]  # fmt: skip
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="gemma4-precompile") as pool:
            running = []
            for kind, lower, done, key in jobs:
                if done is None or key not in done:
                    running.append((pool.submit(self._run(kind, lower).compile), done, key))
            for future, done, key in running:
                future.result()
                if done is not None:
                    done.add(key)
