"""Data-parallel serving: N engines behind one server (`gemma4-serve --data-parallel-size N`, vLLM's flag).

`DataParallelEngines` holds N `decode.engine.Engine`s, each over its own copy of the weights on its own
device group (`device_groups`: the local devices split into N groups of `--tensor-parallel-size`
each), and answers the serving layer as one engine does: a request goes to the engine with the
fewest requests held (rows running + requests waiting; ties in turn, so an idle server spreads a
burst over every engine), and the engines' counters, gauges and probes are summed or combined.
Nothing of an engine's step changes: the router is a layer over `submit` / `score` / `cancel`.

What stays per engine (docs/deploy.md): each engine's KV pool and prefix cache (a conversation's
next turn reuses its earlier turns' KV only when it reaches the same engine; the router does not
route by prefix), its compiled programs (the same programs once per device group; the persistent
compile cache serves the later ones), and its adapter banks: `load_adapter` / `unload_adapter` act
on every engine, and a request's adapter is looked up by name in the engine it is sent to.
The process is one failure domain: `alive` is False (and /health 503) once any engine has stopped.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Sequence

from gemma4_nnx.decode.engine import Engine, EngineError, EngineStats
from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.requests import AdapterRef, Request

__all__ = ["DataParallelEngines", "copy_model", "device_groups"]


def device_groups(devices: Sequence, data_parallel: int, tensor_parallel: int) -> list[list]:
    """`devices` split into `data_parallel` groups of `tensor_parallel` consecutive devices (the first
    data_parallel x tensor_parallel devices; the rest stay unused). ValueError naming both flags when
    they ask for more devices than there are."""
    for value, flag in ((data_parallel, "--data-parallel-size"), (tensor_parallel, "--tensor-parallel-size")):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    need = data_parallel * tensor_parallel
    if need > len(devices):
        platform = devices[0].platform if devices else "no"
        raise ValueError(
            f"--data-parallel-size {data_parallel} x --tensor-parallel-size {tensor_parallel} = {need} devices, "
            f"but this machine has {len(devices)} {platform} device(s): make the product at most {len(devices)}"
        )
    return [list(devices[i * tensor_parallel : (i + 1) * tensor_parallel]) for i in range(data_parallel)]


def copy_model(model, devices: Sequence, mesh=None):
    """A copy of `model` with every array on `devices` (one device without `mesh`; with `mesh`, a
    mesh over `devices` of the source's shape, each array keeping its partition spec), copied device
    to device: the checkpoint is read once however many engines serve it."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    def move(x):
        if not isinstance(x, jax.Array):
            return x
        if mesh is None:
            return jax.device_put(x, devices[0])
        spec = x.sharding.spec if isinstance(x.sharding, jax.sharding.NamedSharding) else jax.sharding.PartitionSpec()
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

    return nnx.merge(graphdef, jax.tree.map(move, state))


def _summed(stats: Sequence[EngineStats]) -> EngineStats:
    """One `EngineStats` of several engines': counters added, `max_rows_in_step` the largest."""
    out = EngineStats()
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        setattr(out, f.name, max(values) if f.name == "max_rows_in_step" else sum(values))
    return out


class _Pools:
    """The KV block pools of several engines as one (what /metrics reads: used, free, block size)."""

    def __init__(self, pools):
        self.pools = pools
        self.block_size = pools[0].block_size

    @property
    def used(self) -> int:
        return sum(p.used for p in self.pools)

    @property
    def free(self) -> int:
        return sum(p.free for p in self.pools)


class DataParallelEngines:
    """Several engines over copies of one model, answering as one `Engine` (module docstring).

    engines: the engines (same model, tokenizer and settings; each on its own devices). The group owns
    them: `close` closes every one."""

    def __init__(self, engines: Sequence[Engine]):
        if not engines:
            raise ValueError("engines: give at least one engine")
        self.engines = list(engines)
        first = self.engines[0]
        self.model, self.tokenizer, self.decoder = first.model, first.tokenizer, first.decoder
        self.max_length, self.vocab_size = first.max_length, first.vocab_size
        self.max_batch = sum(e.max_batch for e in self.engines)  # rows over all engines
        self.max_score_tokens = first.max_score_tokens
        self._turn = itertools.count()
        self._owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # EngineRequest -> its engine
        self._lock = threading.Lock()  # one routing decision at a time (submit is called from several threads)
        self.routed = [0] * len(self.engines)  # requests (and score calls) sent to each engine

    # ------------------------------------------------------------------ as one engine
    @property
    def alive(self) -> bool:
        return all(e.alive for e in self.engines)

    @property
    def error(self) -> str | None:
        return next((f"engine {i}: {e.error}" for i, e in enumerate(self.engines) if e.error), None)

    @property
    def last_outcome(self) -> str | None:
        outcomes = [e.last_outcome for e in self.engines]
        return "error" if "error" in outcomes else next((o for o in outcomes if o), None)

    @property
    def active_rows(self) -> int:
        return sum(e.active_rows for e in self.engines)

    @property
    def pending(self) -> int:
        return sum(e.pending for e in self.engines)

    @property
    def stats(self) -> EngineStats:
        return _summed([e.stats for e in self.engines])

    @property
    def pool(self):
        pools = [e.pool for e in self.engines]
        return None if pools[0] is None else _Pools(pools)

    def compiled_programs(self) -> dict[str, int]:
        """Programs compiled by all engines together, by kind (each engine compiles its own)."""
        out: dict[str, int] = {}
        for e in self.engines:
            for kind, n in e.compiled_programs().items():
                out[kind] = out.get(kind, 0) + n
        return out

    def loads(self) -> list[int]:
        """Each engine's requests held (rows running + requests waiting): what the router compares."""
        return [e.active_rows + e.pending for e in self.engines]

    # ------------------------------------------------------------------ routing
    def _pick(self) -> int:
        """The running engine holding the fewest requests; ties go round in turn."""
        loads = self.loads()
        start = next(self._turn) % len(self.engines)
        order = [(start + k) % len(self.engines) for k in range(len(self.engines))]
        running = [i for i in order if self.engines[i].alive]
        if not running:
            raise EngineError(f"the engines are not running{': ' + self.error if self.error else ''}")
        return min(running, key=lambda i: loads[i])

    def _adapter_in(self, engine: Engine, ref: AdapterRef | None) -> AdapterRef | None:
        """`ref` (an adapter of the first engine, as `adapter` returns) as `engine` holds it, by name."""
        if ref is None:
            return None
        own = engine.adapter(ref.name)
        if own is None:
            raise RequestError(f"adapter {ref.name!r} is not loaded", "adapter", "model_not_found")
        return own

    def validate(self, prompt, max_tokens=None, **options) -> Request:
        """`Engine.validate` (every engine has the same model and limits: the first checks)."""
        return self.engines[0].validate(prompt, max_tokens, **options)

    def submit(self, prompt, max_tokens=None, *, sink=None, **options):
        """`Engine.submit` on the least-loaded engine; returns its `EngineRequest`."""
        request = prompt if isinstance(prompt, Request) else self.validate(prompt, max_tokens, **options)
        with self._lock:
            i = self._pick()
            engine = self.engines[i]
            if request.adapter is not None:
                request = dataclasses.replace(request, adapter=self._adapter_in(engine, request.adapter))
            req = engine.submit(request, sink=sink)
            self.routed[i] += 1
        self._owner[req] = engine
        return req

    def score(self, prompts, top_logprobs: int = 0, adapter: AdapterRef | None = None):
        """`Engine.score` on the least-loaded engine (it runs on the calling thread)."""
        with self._lock:
            i = self._pick()
            self.routed[i] += 1
        engine = self.engines[i]
        return engine.score(prompts, top_logprobs, self._adapter_in(engine, adapter))

    def cancel(self, req) -> None:
        engine = self._owner.get(req)
        if engine is not None:
            engine.cancel(req)

    def close(self, timeout: float = 30.0) -> None:
        for e in self.engines:
            e.close(timeout)

    # ------------------------------------------------------------------ LoRA adapters (on every engine)
    @property
    def adapters(self):
        return self.engines[0].adapters  # names and paths; every engine holds the same adapters

    def adapter(self, name: str) -> AdapterRef | None:
        return self.engines[0].adapter(name)

    def adapter_names(self) -> list[str]:
        return self.engines[0].adapter_names()

    def load_adapter(self, name: str, path) -> AdapterRef:
        """Load the adapter into every engine; when one refuses, the engines that took it unload it
        again and its error is raised."""
        done = []
        try:
            for e in self.engines:
                e.load_adapter(name, path)
                done.append(e)
        except Exception:
            for e in done:
                e.unload_adapter(name)
            raise
        return self.adapter(name)

    def unload_adapter(self, name: str) -> None:
        self.engines[0].unload_adapter(name)  # raises (naming the adapter) when it is not loaded
        for e in self.engines[1:]:
            e.unload_adapter(name)
