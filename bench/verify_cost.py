"""What one speculative verify step costs, relative to one plain decode step, for k = 1..8 drafts.

    python converters/make_random_e2b.py /tmp/e2b-random    # once (E2B shape, random bf16 weights)
    python bench/verify_cost.py /tmp/e2b-random             # ~5 min on 2 cores
    python bench/verify_cost.py checkpoints/gemma3-270m     # a converted checkpoint works too
    python bench/verify_cost.py /tmp/e2b-random --assistant  # + an E2B-assistant-shaped drafter's cost
    python3 bench/verify_cost.py --random e2b --assistant --batches 1 16   # a TPU host: weights made there

The decoder's own programs (`Decoder.step` and `Decoder.verify`) on rows holding a 128-token
prompt, medians of --repeats after a warm-up call each. From the cost ratio c(k) and a per-token
acceptance rate a, a verify step emits on average 1 + a + a^2 + ... + a^k tokens, so the speed-up
over plain decoding is that number divided by c(k); the table evaluates it for the acceptance rates
given with --acceptance (published figures for Gemma 4's MTP assistants are ~0.6-0.7 on code and
chat; prompt lookup on copy-heavy text measured 0.8-0.9 in bench/speculative.py).

--assistant: also time `Decoder.draft` (k steps of an MTP assistant over the target's cache) with a
random assistant of the published E2B-assistant shape (4 layers, hidden 256, MLP 2048, 4 heads,
centroid head: 2048 clusters, top 32; the target's KV geometry), bf16 weights, and add its cost to
the verify step in the predicted speed-up. Random weights: only the cost is meaningful, not drafts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from gemma4_nnx.io.hf_config import read_assistant_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", help="HF directory (config.json + safetensors) or a converted checkpoint")
    p.add_argument(
        "--random",
        choices=["e2b"],
        help="instead: E2B-shaped random bf16 weights made on the device (bench/accelerator.py's build; a TPU host)",
    )
    p.add_argument("--layers", type=int, default=0, help="with --random: the first N layers (a quick run)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    p.add_argument("--assistant", action="store_true", help="time an E2B-assistant-shaped drafter too")
    a = p.parse_args(argv)
    if (a.checkpoint is None) == (a.random is None):
        p.error("give a checkpoint or --random e2b")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gemma4_nnx.io.loader import checkpoint_format, load_any

    if a.random:
        from flax import nnx

        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from accelerator import build, smoke_config

        from gemma4_nnx import Gemma4Config

        model = nnx.merge(*build(smoke_config(Gemma4Config.e2b(), a.layers), "bf16"))
    else:  # a converted checkpoint as stored; an HF directory with bf16 weights
        model = load_any(a.checkpoint, None if checkpoint_format(a.checkpoint) == "orbax" else jnp.bfloat16)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs; {a.checkpoint or a.random}: "
        f"{model.config.num_hidden_layers} layers, "
        f"hidden {model.config.hidden_size}, matmul {model.matmul}",
        flush=True,
    )
    rng = np.random.default_rng(0)
    assistant = _e2b_like_assistant(model.config, model.embed_tokens.dtype) if a.assistant else None
    head = "verify + draft" if assistant is not None else "verify"
    print("\n| batch | plain step (ms) | " + " | ".join(f"k={k}: {head} ms (x plain)" for k in a.k) + " |")
    print("|---|---|" + "---|" * len(a.k))
    ratios = {}
    for b in a.batches:
        plain, verify, draft = _measure(model, b, a.k, a.repeats, rng, assistant)
        for k, ms, d in zip(a.k, verify, draft):
            ratios[(b, k)] = (ms + d) / plain
        cells = [
            f"{ms:.0f} + {d:.0f} ({(ms + d) / plain:.2f}x)"
            if assistant is not None
            else f"{ms:.0f} ({ms / plain:.2f}x)"
            for ms, d in zip(verify, draft)
        ]
        print(f"| {b} | {plain:.0f} | " + " | ".join(cells) + " |", flush=True)
    print("\npredicted speed-up over plain decoding (expected tokens per verify step / cost ratio):")
    print("| batch | acceptance | " + " | ".join(f"k={k}" for k in a.k) + " |")
    print("|---|---|" + "---|" * len(a.k))
    for b in a.batches:
        for acc in a.acceptance:
            cells = [f"{sum(acc**i for i in range(k + 1)) / ratios[(b, k)]:.2f}x" for k in a.k]
            print(f"| {b} | {acc} | " + " | ".join(cells) + " |")
    return 0


def _e2b_like_assistant(target, dtype):
    """A random bf16 assistant of the published E2B-assistant shape, fitted to `target`'s geometry."""
    import jax.numpy as jnp
    from flax import nnx

    from gemma4_nnx.model.assistant import Gemma4Assistant

    text = dict(
        model_type="gemma4_text",
        vocab_size=target.vocab_size,
        hidden_size=256,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=target.num_key_value_heads,
        num_global_key_value_heads=target.num_global_key_value_heads,
        attention_k_eq_v=target.attention_k_eq_v,
        head_dim=target.head_dim,
        global_head_dim=target.global_head_dim,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=target.sliding_window,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
    )
    config = read_assistant_config(
        dict(
            model_type="gemma4_assistant",
            backbone_hidden_size=target.hidden_size,
            use_ordered_embeddings=True,
            num_centroids=2048,
            centroid_intermediate_top_k=32,
            text_config=text,
        )
    )
    # the target's compute dtype (float32 on a CPU, bf16 on an accelerator: bench/accelerator.py's build)
    return Gemma4Assistant(config, dtype=dtype, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def _measure(model, b: int, ks: list[int], repeats: int, rng, assistant=None):
    """(plain step ms, [verify step ms for each k], [draft ms for each k: 0 without an assistant]) on
    b rows after a 128-token prompt."""
    import numpy as np

    from gemma4_nnx.decode.batching import PromptBatch
    from gemma4_nnx.decode.core import Decoder, DrawConfig
    from gemma4_nnx.decode.requests import make_request

    vocab = model.config.vocab_size
    dec = Decoder(model, rows=b, max_length=512, speculative_tokens=max(ks), assistant=assistant)
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
    verify, draft = [], []
    for k in ks:
        draft.append(median_ms(lambda k=k: np.asarray(dec.draft(b, k))) if assistant is not None else 0.0)
        drafts = rng.integers(3, vocab, (b, k)).astype(np.int32)  # random drafts: (almost) all rejected
        counts = np.full((b,), k, np.int32)
        verify.append(median_ms(lambda drafts=drafts, counts=counts: dec.verify(cfg, drafts, counts)))
    return plain, verify, draft


if __name__ == "__main__":
    sys.exit(main())
