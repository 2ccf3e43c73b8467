"""The server's adapter file I/O: on threads of its own, bounded in number and time, confined to the root.

Reading an adapter directory is file I/O the server does not control: a FIFO where Orbax's metadata
file should be, or a hung network mount, blocks a read forever, and a thread blocked in a read cannot
be cancelled. So adapter loads do not run on the event loop's default executor, where the routes
tokenize requests (six stuck loads there once stopped every completion), but each on a daemon thread
of its own (`AdapterIO`), at most `workers` at once (`--lora-load-workers`):

* a load answers within `timeout` seconds (`--lora-load-timeout`): 503 `adapter_load_timeout` when
  its work has not returned by then. Its thread keeps running, counted as stuck, until the read
  returns; what it then loaded is undone (`undo`), never served;
* a load that finds every thread busy is refused at once: 429 + Retry-After while they run within
  their time, 503 `adapter_loads_stuck` once stuck threads hold them all (they never come back while
  the file system stays hung); the threads are never more than `workers`, so stuck ones hold no more;
* `/ready` is 503 while a load is stuck (`problem`); daemon threads do not keep the process from
  exiting.

`outside_root`: whether a file or folder under an adapter directory (symbolic links resolved) lies
outside the adapter root (`--lora-root`), which would let a client read a file beyond it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable

from gemma4_nnx.serve.errors import ApiError

__all__ = ["DEFAULT_LORA_LOAD_TIMEOUT", "DEFAULT_LORA_LOAD_WORKERS", "MAX_ADAPTER_ENTRIES", "AdapterIO", "outside_root"]

#: Seconds an adapter load may take (reading its files, writing its slot, the probe forward pass that
#: compiles once on a server's first load) before it is answered 503 and its thread counted as stuck.
DEFAULT_LORA_LOAD_TIMEOUT = 120.0
#: Adapter loads running at once (stuck ones included); more are refused.
DEFAULT_LORA_LOAD_WORKERS = 2
#: Files and folders an adapter directory under the root may hold (each is resolved before a load).
MAX_ADAPTER_ENTRIES = 10_000


class _Job:
    """One load on its thread: its outcome, and whether its caller stopped waiting for it."""

    def __init__(self, undo: Callable | None):
        self.started = time.monotonic()
        self.done = threading.Event()
        self.result, self.error = None, None
        self.finished = self.abandoned = False  # fn returned / its caller stopped waiting (under the lock)
        self.undo = undo
        self.notify: Callable[[], None] | None = None

    def outcome(self):
        if self.error is not None:
            raise self.error
        return self.result


class AdapterIO:
    """Adapter loads on at most `workers` daemon threads, each answered within `timeout` seconds."""

    def __init__(self, workers: int = DEFAULT_LORA_LOAD_WORKERS, timeout: float = DEFAULT_LORA_LOAD_TIMEOUT):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"lora load workers (--lora-load-workers) must be an int >= 1, got {workers!r}")
        if not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ValueError(f"lora load timeout (--lora-load-timeout) must be seconds > 0, got {timeout!r}")
        self.workers, self.timeout = workers, float(timeout)
        self._lock = threading.Lock()
        self._jobs: set[_Job] = set()  # running (stuck ones too)

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        """{"workers", "running", "stuck"}: threads allowed, running, and running past the timeout."""
        now = time.monotonic()
        with self._lock:
            running = len(self._jobs)
            stuck = sum(now - j.started > self.timeout for j in self._jobs)
        return {"workers": self.workers, "running": running, "stuck": stuck}

    def problem(self) -> str | None:
        """Why the server is not ready for adapter loads (None: it is): loads stuck past the timeout."""
        stuck = self.state()["stuck"]
        if not stuck:
            return None
        return (
            f"{stuck} adapter load(s) have run past --lora-load-timeout {self.timeout:g} s (a blocking file or a "
            "hung file system under the adapter directory); their threads cannot be cancelled and stay busy until "
            f"the reads return ({self.workers} allowed, --lora-load-workers): restart the server if they do not"
        )

    # ------------------------------------------------------------------ running
    def _start(self, fn: Callable, undo: Callable | None, notify: Callable[[], None] | None = None) -> _Job:
        """`fn()` on a new daemon thread, or ApiError (429 / 503) when `workers` threads are running."""
        job = _Job(undo)
        job.notify = notify
        with self._lock:
            if len(self._jobs) >= self.workers:
                raise self._busy()
            self._jobs.add(job)
        threading.Thread(target=self._work, args=(job, fn), daemon=True, name="gemma4-adapter-io").start()
        return job

    def _busy(self) -> ApiError:
        now = time.monotonic()
        stuck = sum(now - j.started > self.timeout for j in self._jobs)
        if stuck >= self.workers:
            return ApiError(
                f"adapter loads are refused: all {self.workers} load threads (--lora-load-workers) are stuck in reads "
                f"that ran past --lora-load-timeout {self.timeout:g} s and cannot be cancelled (a blocking file or a "
                "hung file system); restart the server",
                "lora_path",
                status=503,
                code="adapter_loads_stuck",
                type_="server_error",
            )
        return ApiError(
            f"{len(self._jobs)} adapter loads are running, the most this server runs at once (--lora-load-workers "
            f"{self.workers}): retry when one has finished",
            None,
            status=429,
            code="too_many_requests",
            type_="rate_limit_error",
            headers={"Retry-After": "1"},
        )

    def _work(self, job: _Job, fn: Callable) -> None:
        try:
            job.result = fn()
        except BaseException as e:  # the caller's to raise (or nobody's, once abandoned)
            job.error = e
        with self._lock:
            job.finished = True
            undo = job.undo if job.abandoned and job.error is None else None
        if undo is not None:  # its caller was answered with an error: what it loaded is not served
            with contextlib.suppress(Exception):
                undo(job.result)
        with self._lock:  # the thread is free once the undo is done too
            self._jobs.discard(job)
        job.done.set()
        if job.notify is not None:
            job.notify()

    def _abandon(self, job: _Job) -> bool:
        """Stop waiting for `job`; False when it has finished meanwhile (its outcome stands)."""
        with self._lock:
            if job.finished:
                return False
            job.abandoned = True
            return True

    def _timed_out(self, what: str) -> ApiError:
        return ApiError(
            f"{what} did not finish within --lora-load-timeout {self.timeout:g} s (a blocking file or a hung file "
            "system under the adapter directory?); a read cannot be cancelled: its thread stays busy until the read "
            "returns, and what it loads then is dropped",
            "lora_path",
            status=503,
            code="adapter_load_timeout",
            type_="server_error",
        )

    def call(self, fn: Callable, what: str, undo: Callable | None = None):
        """`fn()` on a load thread, waited for here (start-up's `--lora-modules`): its result, its
        exception, or ApiError (503) after the timeout / when every thread is busy."""
        job = self._start(fn, undo)
        if not job.done.wait(self.timeout):
            if self._abandon(job):
                raise self._timed_out(what)
            job.done.wait()  # it finished just now: its thread is about to be free
        return job.outcome()

    async def run(self, fn: Callable, what: str, undo: Callable | None = None):
        """`fn()` on a load thread, awaited without blocking the event loop: its result, its exception,
        or ApiError after the timeout (503) / when every thread is busy (429, 503 when stuck). `undo(result)`
        runs when `fn` returns after its caller was answered with the timeout."""
        loop = asyncio.get_running_loop()
        finished = asyncio.Event()

        def notify() -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                loop.call_soon_threadsafe(finished.set)

        job = self._start(fn, undo, notify)
        try:
            await asyncio.wait_for(finished.wait(), self.timeout)
        except TimeoutError:
            if self._abandon(job):
                raise self._timed_out(what) from None
            await finished.wait()  # it finished just now: its thread is about to be free
        return job.outcome()


def outside_root(directory: str, root: str, limit: int = MAX_ADAPTER_ENTRIES) -> bool:
    """Whether any file or folder under `directory` resolves (symbolic links followed) outside `root`
    (both real paths), or the directory holds more than `limit` entries (a link cycle, or not an
    adapter). Folders that cannot be listed are left to the reader (it cannot read them either)."""
    seen, todo, count = {directory}, [directory], 0
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            count += 1
            real = os.path.realpath(entry.path)
            if count > limit or os.path.commonpath([real, root]) != root:
                return True
            if os.path.isdir(real) and real not in seen:
                seen.add(real)
                todo.append(real)
    return False
