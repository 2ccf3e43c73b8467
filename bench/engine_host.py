"""Host time per decode step: the engine against `generate` on a tiny random model (device work ~0).

    python bench/engine_host.py                      # one request of 256 tokens, batch 1
    python bench/engine_host.py --tokens 256 --rows 4 --profile
    python bench/engine_host.py --rows 1 16 64 --tokens 128 --decode-steps 1 auto --text --no-generate
    python bench/engine_host.py --model e2b --tokens 128 --json $OUT/engine_host.json   # a TPU host

On a tiny model the device step costs microseconds, so wall time per token is the driver's own host
work: `generate` runs its whole decode in one on-device loop (`Decoder.loop`), the engine runs one
dispatch per step (or per burst of `--decode-steps`) from Python (`Engine._run`). For each row count
(`--rows`: that many requests at once, one row each) and burst setting, reports ms per token of one
stream (wall / tokens) after a warm-up run (every program compiled), the engine with async scheduling
and synchronous (`Engine._overlap`, alternating runs in one process), the engine's own measure of its
host time per step and per dispatch (`EngineStats.host_seconds / decode_steps`: the serving thread's
time outside waits on the device; "ran": `host_cpu_seconds`, the part it ran on a core, steadier on a
shared machine), and with --profile the cProfile of the engine thread's loop over one async run,
sorted by own time, and its Python function calls per token (a count: the same on a busy machine).
--text gives the engine the tests' tiny tokenizer, so each token is detokenized too (what a server
does); --stop-string adds a stop string that never matches to every request (the matcher's work).
Each engine's warm-up runs are followed by a wait for the helper thread's compiles (fused step and
burst programs), so the runs measured run the bursts.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per request")
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="requests at once (each gets its own row)")
    p.add_argument("--decode-steps", nargs="+", default=["1"], help="the engine's decode_steps: numbers or auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile the engine thread (top 25 by own time)")
    p.add_argument("--text", action="store_true", help="detokenize (the tests' tiny tokenizer)")
    p.add_argument("--stop-string", action="store_true", help="a stop string that never matches, per request")
    p.add_argument("--no-generate", action="store_true", help="skip the `generate` reference")
    p.add_argument(
        "--model", choices=["tiny", "e2b"], default="tiny", help="the tests' tiny random model, or E2B random bf16"
    )
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--precompile", action="store_true", help="precompile every row count (else on first use)")
    p.add_argument("--row-factor", type=int, default=4, help="the engine's row_factor (4: fewer programs)")
    args = p.parse_args(argv)
    import jax

    from gemma4_nnx import Engine
    from gemma4_nnx.decode.bursts import Bursts

    model, tok = _model(args.model, args.text or args.stop_string)
    length = max(len(x) for x in _prompts(3)) + args.tokens + 1
    # one engine for every run (its programs compiled once): max(rows) rows, a run of r requests decodes
    # the first r; the burst setting is swapped between runs (`Engine.bursts`)
    engine = Engine(
        model, tok, max_batch=max(args.rows), max_length=length, precompile=(16,) if args.precompile else None,
        row_factor=args.row_factor,
    )  # fmt: skip
    results = []
    try:
        for rows in args.rows:
            for steps in args.decode_steps:
                engine.bursts = Bursts(steps if steps == "auto" else int(steps))
                r = measure(engine, model, rows, args)
                results.append(r)
                print(_line(r), flush=True)
    finally:
        engine.close()
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": str(jax.devices()[0].device_kind), "runs": results}, f, indent=1)
    return 0


def _line(r: dict) -> str:
    gen = f"generate {r['generate_ms_per_token']:.3f} ms/token; " if "generate_ms_per_token" in r else ""
    parts = [
        f"engine {name} {r[f'engine_{name}_ms_per_token']:.3f} ms/token, host "
        f"{r[f'engine_{name}_host_ms_per_step']:.3f} ms/step (ran {r[f'engine_{name}_host_cpu_ms_per_step']:.3f}) "
        f"{r[f'engine_{name}_host_ms_per_dispatch']:.3f} "
        f"ms/dispatch ({r[f'engine_{name}_steps_per_dispatch']:.1f} steps each)"
        for name in ("async", "sync")
    ]
    calls = r.get("engine_python_calls_per_token")
    calls = f"; {calls:.1f} Python calls/token on the engine thread" if calls else ""
    return f"rows {r['rows']:3d} decode_steps {r['decode_steps']!s:4s}: {gen}" + "; ".join(parts) + calls


def _prompts(rows: int) -> list[list[int]]:
    from tests.helpers import PROMPTS

    return [list(PROMPTS[i % len(PROMPTS)]) for i in range(max(rows, len(PROMPTS)))][:rows]


def measure(engine, model, rows: int, args) -> dict:
    from gemma4_nnx import generate

    prompts = _prompts(rows)
    n = args.tokens
    opts = dict(stop_tokens=[], stop_strings=["\x00never\x00"] if args.stop_string else None)
    figures = {"rows": rows, "tokens": n, "decode_steps": engine.bursts.most if not engine.bursts.auto else "auto"}
    figures["repeats"] = args.repeats
    if not args.no_generate:

        def gen() -> float:
            t = time.perf_counter()
            generate(model, prompts, n, stop_tokens=[], max_length=engine.max_length)
            return time.perf_counter() - t

        gen()
        figures["generate_ms_per_token"] = 1e3 * min(gen() for _ in range(args.repeats)) / n

    def run() -> float:
        t = time.perf_counter()
        reqs = [engine.submit(x, n, **opts) for x in prompts]
        for r in reqs:
            r.result()
        return time.perf_counter() - t

    prof = cProfile.Profile() if args.profile else None
    for _ in range(3):  # auto bursts measure steps first; their programs compile on the helper thread
        run()
        while engine.decoder._compiling:
            time.sleep(0.05)
    times = {True: [], False: []}
    host = {True: 0.0, False: 0.0}
    cpu = {True: 0.0, False: 0.0}
    steps = {True: 0, False: 0}
    dispatches = {True: 0, False: 0}
    for _ in range(args.repeats):  # async and synchronous alternating, same process and programs
        for overlap in (True, False):
            engine._overlap = overlap
            s = engine.stats
            before = s.host_seconds, s.decode_steps, s.decode_dispatches, s.host_cpu_seconds
            times[overlap].append(run())
            host[overlap] += s.host_seconds - before[0]
            cpu[overlap] += s.host_cpu_seconds - before[3]
            steps[overlap] += s.decode_steps - before[1]
            dispatches[overlap] += s.decode_dispatches - before[2]
    if prof is not None:
        engine._overlap = True
        _profiled(engine, prof, run)
    for overlap, name in ((True, "async"), (False, "sync")):
        figures[f"engine_{name}_ms_per_token"] = 1e3 * min(times[overlap]) / n
        figures[f"engine_{name}_host_ms_per_step"] = 1e3 * host[overlap] / max(steps[overlap], 1)
        figures[f"engine_{name}_host_ms_per_dispatch"] = 1e3 * host[overlap] / max(dispatches[overlap], 1)
        figures[f"engine_{name}_host_cpu_ms_per_step"] = 1e3 * cpu[overlap] / max(steps[overlap], 1)
        figures[f"engine_{name}_steps_per_dispatch"] = steps[overlap] / max(dispatches[overlap], 1)
    if prof is not None:
        stats = pstats.Stats(prof)
        figures["engine_python_calls_per_token"] = stats.total_calls / (rows * n)
        print(f"--- cProfile of the engine thread, rows {rows}, decode_steps {figures['decode_steps']}, one async run")
        stats.sort_stats("tottime").print_stats(25)
    return figures


def _profiled(engine, prof: cProfile.Profile, run) -> None:
    """One `run` with the engine thread's loop turns under `prof` (cProfile follows the thread that
    enables it: the engine thread's `_step` turns it on and off)."""
    step = engine._step

    def profiled(*a, **k):
        prof.enable()
        try:
            return step(*a, **k)
        finally:
            prof.disable()

    engine._step = profiled
    try:
        run()
    finally:
        engine._step = step


def _model(name: str, text: bool):
    """The tests' tiny random model (device work ~0; with `text`, over the tests' tiny tokenizer), or
    `Gemma4Config.e2b()` with random bf16 weights made on the device (a real step's device time: the
    host's share is what the engine adds)."""
    if name == "tiny":
        from tests.helpers import random_model, tokenizer_and_model

        if text:
            return tokenizer_and_model(tempfile.mkdtemp(), seed=0)[::-1]
        return random_model("e2b", seed=0, config={"max_position_embeddings": 1024}), None
    import jax.numpy as jnp
    from flax import nnx

    from gemma4_nnx import Gemma4, Gemma4Config

    config = Gemma4Config.e2b()

    @nnx.jit
    def build():
        return Gemma4(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))

    return build(), None


if __name__ == "__main__":
    raise SystemExit(main())
