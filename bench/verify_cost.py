"""What one speculative verify step costs, relative to one plain decode step, for k = 1..8 drafts.

    python converters/make_random_e2b.py /tmp/e2b-random    # once (E2B shape, random bf16 weights)
    python bench/verify_cost.py /tmp/e2b-random             # ~5 min on 2 cores
    python bench/verify_cost.py checkpoints/gemma3-270m     # a converted checkpoint works too

The decoder's own programs (`Decoder.step` and `Decoder.verify`) on rows holding a 128-token
prompt, medians of --repeats after a warm-up call each. From the cost ratio c(k) and a per-token
acceptance rate a, a verify step emits on average 1 + a + a^2 + ... + a^k tokens, so the speed-up
over plain decoding is that number divided by c(k); the table evaluates it for the acceptance rates
given with --acceptance (published figures for Gemma 4's MTP assistants are ~0.6-0.7 on code and
chat; prompt lookup on copy-heavy text measured 0.8-0.9 in bench/speculative.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="HF directory (config.json + safetensors) or a converted checkpoint")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gemma4_nnx.cli_generate import load_model

    if os.path.isfile(os.path.join(a.checkpoint, "gemma4_config.json")):
        model = load_model(a.checkpoint)
    else:
        import gemma4_nnx

        model = gemma4_nnx.from_hf(a.checkpoint, dtype=jnp.float32, param_dtype=jnp.bfloat16)
    print(
        f"jax {jax.__version__}, {os.cpu_count()} CPUs; {a.checkpoint}: {model.config.num_hidden_layers} layers, "
        f"hidden {model.config.hidden_size}, matmul {model.matmul}",
        flush=True,
    )
    rng = np.random.default_rng(0)
    print("\n| batch | plain step (ms) | " + " | ".join(f"k={k}: ms (x plain)" for k in a.k) + " |")
    print("|---|---|" + "---|" * len(a.k))
    ratios = {}
    for b in a.batches:
        plain, verify = _measure(model, b, a.k, a.repeats, rng)
        for k, ms in zip(a.k, verify):
            ratios[(b, k)] = ms / plain
        cells = [f"{ms:.0f} ({ms / plain:.2f}x)" for ms in verify]
        print(f"| {b} | {plain:.0f} | " + " | ".join(cells) + " |", flush=True)
    print("\npredicted speed-up over plain decoding (expected tokens per verify step / cost ratio):")
    print("| batch | acceptance | " + " | ".join(f"k={k}" for k in a.k) + " |")
    print("|---|---|" + "---|" * len(a.k))
    for b in a.batches:
        for acc in a.acceptance:
            cells = [f"{sum(acc**i for i in range(k + 1)) / ratios[(b, k)]:.2f}x" for k in a.k]
            print(f"| {b} | {acc} | " + " | ".join(cells) + " |")
    return 0


def _measure(model, b: int, ks: list[int], repeats: int, rng) -> tuple[float, list[float]]:
    """(plain step ms, [verify step ms for each k]) on b rows after a 128-token prompt."""
    import numpy as np

    from gemma4_nnx.decode.batching import PromptBatch
    from gemma4_nnx.decode.core import Decoder, DrawConfig
    from gemma4_nnx.decode.requests import make_request

    vocab = model.config.vocab_size
    dec = Decoder(model, rows=b, max_length=512, speculative_tokens=max(ks))
    reqs = [
        make_request(
            [2] + rng.integers(3, vocab, 127).tolist(),
            300,
            vocab_size=vocab,
            context=512,
            context_name="bench",
            stop_tokens=[],
        )
        for _ in range(b)
    ]
    dec.start(reqs)
    cfg = DrawConfig()
    dec.draw(cfg, dec.prefill(PromptBatch.build([r.prompt for r in reqs], b)))

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    plain = median_ms(lambda: dec.step(cfg))
    verify = []
    for k in ks:
        drafts = rng.integers(3, vocab, (b, k)).astype(np.int32)  # random drafts: (almost) all rejected
        counts = np.full((b,), k, np.int32)
        verify.append(median_ms(lambda drafts=drafts, counts=counts: dec.verify(cfg, drafts, counts)))
    return plain, verify


if __name__ == "__main__":
    sys.exit(main())
