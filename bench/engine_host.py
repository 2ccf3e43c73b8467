"""Host time per decode step: the engine against `generate` on a tiny random model (device work ~0).

    python bench/engine_host.py                      # one request of 256 tokens, batch 1
    python bench/engine_host.py --tokens 256 --rows 4 --profile
    python bench/engine_host.py --model e2b --tokens 128 --json $OUT/engine_host.json   # a TPU host

On a tiny model the device step costs microseconds, so wall time per token is the driver's own host
work: `generate` runs its whole decode in one on-device loop (`Decoder.loop`), the engine runs one
step per token from Python (`Engine._run`). Reports ms per token for both after a warm-up run (every
program compiled), the engine with async scheduling and synchronous (`Engine._overlap`, alternating
runs in one process), the engine's own measure of its host time per step (`EngineStats.host_seconds /
decode_steps`: the serving thread's time outside waits on the device), and with --profile the
cProfile of the engine thread's loop over one run, sorted by own time. Each engine's warm-up run is
followed by a wait for the helper thread's compiles (the fused step programs, `compiles.FUSE_AFTER`),
so the runs measured take one dispatch per step.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per request")
    p.add_argument("--rows", type=int, default=1, help="requests at once (each gets its own row)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile the engine thread (top 25 by own time)")
    p.add_argument(
        "--model", choices=["tiny", "e2b"], default="tiny", help="the tests' tiny random model, or E2B random bf16"
    )
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)

    from gemma4_nnx import Engine, generate
    from tests.helpers import PROMPTS

    model = _model(args.model)
    prompts = [list(PROMPTS[i % len(PROMPTS)]) for i in range(args.rows)]
    n = args.tokens
    length = max(len(x) for x in prompts) + n + 1

    def gen() -> float:
        t = time.perf_counter()
        generate(model, prompts, n, stop_tokens=[], max_length=length)
        return time.perf_counter() - t

    gen()
    g = min(gen() for _ in range(args.repeats))
    engine = Engine(model, max_batch=args.rows, max_length=length, precompile=(16,))
    try:

        def run() -> float:
            t = time.perf_counter()
            reqs = [engine.submit(x, n, stop_tokens=[]) for x in prompts]
            for r in reqs:
                r.result()
            return time.perf_counter() - t

        run()
        while engine.decoder._compiling:  # the fused step programs compile on the helper thread after start-up
            time.sleep(0.05)
        run()
        times = {True: [], False: []}
        host = {True: 0.0, False: 0.0}
        steps = {True: 0, False: 0}
        for _ in range(args.repeats):  # async and synchronous alternating, same process and programs
            for overlap in (True, False):
                engine._overlap = overlap
                before = engine.stats.host_seconds, engine.stats.decode_steps
                times[overlap].append(run())
                host[overlap] += engine.stats.host_seconds - before[0]
                steps[overlap] += engine.stats.decode_steps - before[1]
    finally:
        engine.close()
    if args.profile:  # a second engine whose thread runs its loop under cProfile (the timings above ran without)
        prof, loop = cProfile.Profile(), Engine._run

        def profiled(self):
            prof.enable()
            try:
                loop(self)
            finally:
                prof.disable()

        Engine._run = profiled
        engine = Engine(model, max_batch=args.rows, max_length=length, precompile=(16,))
        try:
            for profile in (False, True):  # a warm-up run (its fused steps compile after it), then the profiled one
                if profile:
                    while engine.decoder._compiling:
                        time.sleep(0.05)
                    prof.clear()
                for req in [engine.submit(x, n, stop_tokens=[]) for x in prompts]:
                    req.result()
        finally:
            engine.close()
            Engine._run = loop
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    import jax

    figures = {
        "model": args.model,
        "device": str(jax.devices()[0].device_kind),
        "rows": args.rows,
        "tokens": n,
        "repeats": args.repeats,
        "generate_ms_per_token": 1e3 * g / n,
    }
    print(f"{args.model} on {figures['device']}: rows {args.rows}, {n} tokens each (best of {args.repeats})")
    print(f"generate:      {1e3 * g / n:.3f} ms/token")
    for overlap, name in ((True, "async"), (False, "sync")):
        figures[f"engine_{name}_ms_per_token"] = 1e3 * min(times[overlap]) / n
        figures[f"engine_{name}_host_ms_per_step"] = 1e3 * host[overlap] / max(steps[overlap], 1)
        print(
            f"engine {name:5s}: {figures[f'engine_{name}_ms_per_token']:.3f} ms/token; host time per step "
            f"{figures[f'engine_{name}_host_ms_per_step']:.3f} ms"
        )
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


def _model(name: str):
    """The tests' tiny random model (device work ~0), or `Gemma4Config.e2b()` with random bf16 weights
    made on the device (a real step's device time: the host's share is what the engine adds)."""
    if name == "tiny":
        from tests.helpers import random_model

        return random_model("e2b", seed=0, config={"max_position_embeddings": 1024})
    import jax.numpy as jnp
    from flax import nnx

    from gemma4_nnx import Gemma4, Gemma4Config

    config = Gemma4Config.e2b()

    @nnx.jit
    def build():
        return Gemma4(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))

    return build()


if __name__ == "__main__":
    raise SystemExit(main())
