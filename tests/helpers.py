"""Torch-free builders shared by the test modules: tiny random models, tokenizers and checkpoints.

(The transformers-built reference checkpoints are in `hf_fixtures`.)
"""

from __future__ import annotations

import atexit
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

import gemma4_nnx
from gemma4_nnx import Gemma4, Gemma4Config
from gemma4_nnx.io.hf import expected_hf_shapes
from gemma4_nnx.io.hf_config import config_to_hf, read_assistant_config, read_text_config
from gemma4_nnx.model.build import abstract_model, variables_by_path
from tests import hf_fixtures as fx

S, F = fx.S, fx.F


# ----------------------------------------------------------------------------- references
def attention_f64(q, k, v, kpos, qpos, window, scale):
    """Attention in float64 NumPy, loop by loop: the visible keys of each query (attention.visibility's
    rule), softmax, weighted values; a query that sees no key gives zeros."""
    b_, s_, n_, _ = q.shape
    g = n_ // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(b_):
        for s in range(s_):
            p = qpos[b, s]
            seen = (kpos[b] >= 0) & (kpos[b] <= p)
            if window:
                seen &= kpos[b] > p - window
            if not seen.any():
                continue
            for n in range(n_):
                scores = scale * (k[b][seen][:, n // g] @ q[b, s, n])
                w = np.exp(scores - scores.max())
                out[b, s, n] = (w / w.sum()) @ v[b][seen][:, n // g]
    return out


# ----------------------------------------------------------------------------- models
def random_model(
    variant: str,
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    param_dtype=jnp.float32,
    matmul: str = "auto",
    config: dict | None = None,
) -> Gemma4:
    """A tiny float32 model with weights perturbed like the HF fixtures (norms away from 1, large
    final norm so the softcap is non-linear), built without torch. config: HF config fields to
    override (e.g. a longer context). Built abstractly (`abstract_model`) and filled from NumPy: every
    variable gets its value below, and an eager init would compile one random program per weight shape
    (~6 CPU seconds per test module, whose programs `_release_compiled_programs` drops)."""
    d = dict(fx.VARIANTS[variant], model_type="gemma4_text", **(config or {}))
    if vocab_size is not None:
        d.update(vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size)
    config = read_text_config(d)
    model = abstract_model(config, jnp.float32, param_dtype, matmul)
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        x = var.get_value()
        name = ".".join(map(str, path))
        if x.ndim == 1:
            new = 1.0 + 0.25 * rng.standard_normal(x.shape)
            if name.startswith("norm."):
                new = 1.0 + rng.random(x.shape)
        elif name == "embed_tokens.embedding":
            new = 0.5 * rng.standard_normal(x.shape)
        else:
            new = 0.08 * rng.standard_normal(x.shape)
        var.set_value(jnp.asarray(new, x.dtype))
    return model


PROMPTS = [fx.sample_ids(1, n, seed=20 + n)[0].tolist() for n in (3, 10, 6)]


def tiny_config(**over) -> gemma4_nnx.Gemma4Config:
    """4 layers with KV sharing (sliding donor 0, full donor 1, consumers 2-3), PLE, double-wide MLP."""
    d = dict(
        fx.VARIANTS["e2b"],
        model_type="gemma4_text",
        num_hidden_layers=4,
        layer_types=[S, F, S, F],
        num_kv_shared_layers=2,
    )
    d.update(over)
    return read_text_config(d)


def model_from_config(config: gemma4_nnx.Gemma4Config, seed: int = 0) -> gemma4_nnx.Gemma4:
    """A model filled from NumPy (no per-op JAX compiles): kernels N(0, 0.08), embeddings N(0, 0.5) so
    logits can be sharp, norm scales 1 + N(0, 0.25), layer_scalar 1."""
    return fill_random(abstract_model(config, jnp.float32), seed)


def fill_random(model, seed: int, kernel_std: float = 0.08):
    """Fill an abstract model's variables from NumPy: kernels N(0, kernel_std), embeddings
    N(0, 0.5), norm scales 1 + N(0, 0.25), layer_scalar 1, an assistant's token_ordering a random
    permutation."""
    rng = np.random.default_rng(seed)
    for path, var in variables_by_path(model).items():
        shape = var.shape
        if path[-1] == "token_ordering":
            value = rng.permutation(shape[0])
        elif path[-1] == "layer_scalar":
            value = np.ones(shape)
        elif path[-1] in ("scale", "per_expert_scale"):
            value = 1.0 + 0.25 * rng.standard_normal(shape)
        elif path[-1] == "embedding":
            value = 0.5 * rng.standard_normal(shape)
        else:
            value = kernel_std * rng.standard_normal(shape)
        var.set_value(jnp.asarray(value, var.dtype))
    return model


def tiny_model(seed: int = 0) -> gemma4_nnx.Gemma4:
    return model_from_config(tiny_config(), seed)


def micro_model(seed: int = 0) -> gemma4_nnx.Gemma4:
    """2 layers: layer 0 a sliding KV donor, layer 1 its consumer (fast to compile)."""
    cfg = tiny_config().replace(num_hidden_layers=2, layer_types=(fx.S, fx.S), num_kv_shared_layers=1)
    return model_from_config(cfg, seed)


# ----------------------------------------------------------------------------- tokenizers
# Gemma 4 special tokens at their real ids (reference doc section 18).
GEMMA_SPECIALS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
    # multimodal placeholders (Gemma 4's strings; its ids 255999..258884 lie beyond a tiny vocabulary)
    60: "<|image|>",
    61: "<|image>",
    62: "<image|>",
    63: "<|audio|>",
    64: "<|audio>",
    65: "<audio|>",
    66: "<|video|>",
}


def _corpus(n: int = 600) -> list[str]:
    """Deterministic training text: ASCII words plus a few accented letters.

    No CJK or emoji, so those must go through byte fallback in the tests.
    """
    rng = random.Random(0)
    words = (
        "the a model token turn user system answer think thought hello world "
        "gemma text chat large small fast slow naïve café Zürich déjà vu über "
        "0 1 2 3 42 2024 , . ! ? : ; ( ) - tab"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def build_hf_json(path: str | Path) -> None:
    """A Gemma-layout BPE tokenizer.json (specials at Gemma's ids, byte fallback), trained on `_corpus`."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    def configure(tok: HFTokenizer) -> None:  # Gemma-style: spaces as "▁", no prefix space
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])

    base = HFTokenizer(models.BPE())
    configure(base)
    base.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=400, show_progress=False))
    trained = json.loads(base.to_str())["model"]

    # Re-lay the vocabulary the Gemma way: specials at their ids (gaps filled
    # with <unusedN>), "\n" at 107, then the 256 byte tokens, then the BPE pieces.
    specials = [GEMMA_SPECIALS.get(i, f"<unused{i}>") for i in range(107)]
    pieces = specials + ["\n"] + [f"<0x{b:02X}>" for b in range(256)]
    vocab = {p: i for i, p in enumerate(pieces)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    configure(tok)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for i, s in GEMMA_SPECIALS.items():
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s), i)
    tok.save(str(path))


# ----------------------------------------------------------------------------- HF checkpoints
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    layer_types=(S, F, S, F, S, F),
    sliding_window=4,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=128,
)


def make_tiny_hf(path, *, dtype=np.float32, seed=0, tokenizer=False, **overrides) -> str:
    """An HF-format Gemma 4 directory (config.json + model.safetensors) with random weights, no torch."""
    from safetensors.numpy import save_file

    config = Gemma4Config(**{**TINY, **overrides})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_hf_shapes(config).items():
        x = rng.standard_normal(shape).astype(np.float32) * (0.5 if "embed" in name else 0.08)
        if len(shape) == 1:
            x = 1.0 + 0.25 * x / 0.08
        tensors["model." + name] = x.astype(dtype)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    if tokenizer:
        _write_tokenizer(path)
    return str(path)


def make_tiny_assistant(path, target: Gemma4Config, *, vocab_size: int, seed=0, ordered=0, **text_overrides) -> str:
    """An HF-format Gemma 4 MTP assistant directory (config.json + model.safetensors, random weights, no
    torch) that drafts for `target` (same head dims, KV heads and window; its hidden size as backbone).
    `ordered`: the centroid head with that many centroids (top 2) and a random token ordering."""
    from safetensors.numpy import save_file

    from gemma4_nnx.io.hf import assistant_name_map
    from gemma4_nnx.io.tensors import hf_file_name
    from gemma4_nnx.model.build import abstract_assistant

    text = dict(
        model_type="gemma4_text",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        global_head_dim=target.global_head_dim,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=target.sliding_window,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        final_logit_softcapping=None,
    )
    text.update(text_overrides)
    raw = dict(model_type="gemma4_assistant", backbone_hidden_size=target.hidden_size, text_config=text)
    if ordered:
        raw.update(use_ordered_embeddings=True, num_centroids=ordered, centroid_intermediate_top_k=2)
    config = read_assistant_config(raw)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f)
    entries = assistant_name_map(config)
    shapes = expected_hf_shapes(config.text, entries, abstract_assistant(config, np.float32))
    rng = np.random.default_rng(seed)
    tensors = {}
    for e in entries:
        shape = shapes[e.hf_name]
        x = rng.standard_normal(shape).astype(np.float32) * (0.5 if "embed" in e.hf_name else 0.15)
        if len(shape) == 1:
            x = 1.0 + 0.25 * x / 0.15
        if e.path == ("token_ordering",):
            x = rng.permutation(vocab_size).astype(np.int64)
        tensors[hf_file_name(e, assistant=True)] = x
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


def _write_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, 106]}, f)


# ----------------------------------------------------------------------------- comparing training runs
def update_error(a: dict, b: dict, start: dict) -> float:
    """|a - b| / |a - start| over all the tensors together (Frobenius norms, float64): how far two training
    runs' weights (`a`, `b`: name -> array, after the same steps from `start`) are apart, relative to the
    update itself.

    Why not element by element: Adam moves an element by about lr whatever its gradient's size, so where
    a gradient nearly cancels, float32 summation-order noise (8 devices against one, another kernel,
    another framework) decides the sign of that element's update, and an element-wise bound in lr units
    then depends on the CPU and jax (1.05e-4 against a 1e-4 bound on an AVX-512 EPYC). Over all elements
    one flipped element moves this ratio by ~2 / sqrt(elements); a wrong or missing gradient by O(1).
    What is linear in the sums, the gradients (or an SGD step), is compared element-wise instead."""
    diff = sum(float(np.sum((np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)) ** 2)) for k in a)
    step = sum(float(np.sum((np.asarray(a[k], np.float64) - np.asarray(start[k], np.float64)) ** 2)) for k in a)
    assert step > 0, "the runs did not move the weights: the comparison would be vacuous"
    return (diff / step) ** 0.5


# ----------------------------------------------------------------------------- multi-device subprocesses
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ScriptRun:
    """A Python script run in a subprocess (XLA's device count is fixed when jax starts, so 8 simulated
    CPU devices need their own process); it ends by printing `REPORT <json>`.

    Started at once (scripts that must run together: the processes of one distributed run), or, `lazy`,
    by the first `report()`: what a module-level run must be, so that it starts in the process that runs
    the module's tests (every pytest-xdist worker imports every test module when it collects: a start at
    import ran the script once per worker, each run taking both cores for minutes). `report()` waits
    for it and returns the parsed report (or fails the test with the script's output)."""

    def __init__(self, script: str, name: str, *, lazy: bool = False):
        self.script, self.name, self.proc = script, name, None
        if not lazy:
            self._start()

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("XLA_FLAGS", None)
        fd, self.log = tempfile.mkstemp(prefix=f"gemma4_{self.name}_", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.script], cwd=ROOT, env=env, stdout=fd, stderr=subprocess.STDOUT
        )
        os.close(fd)
        atexit.register(lambda: self.proc.poll() is None and self.proc.kill())

    def report(self, timeout: float) -> dict:
        if self.proc is None:
            self._start()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        with open(self.log, encoding="utf-8", errors="replace") as f:
            out = f.read()
        lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
        assert self.proc.returncode == 0 and lines, f"subprocess failed (rc {self.proc.returncode}):\n{out[-6000:]}"
        return json.loads(lines[-1][len("REPORT ") :])


def random_assistant(target: Gemma4Config, *, ordered: bool, seed: int = 0):
    """A tiny random MTP assistant that fits `target` (its KV geometry and hidden size), filled from
    NumPy like `model_from_config`; `ordered`: the centroid head with a random token ordering."""
    from gemma4_nnx.model.build import abstract_assistant

    text = dict(
        model_type="gemma4_text",
        vocab_size=target.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        global_head_dim=target.global_head_dim,
        layer_types=[S, F, S],
        sliding_window=target.sliding_window,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        attention_k_eq_v=target.attention_k_eq_v,
        num_global_key_value_heads=target.num_global_key_value_heads,
    )
    centroids = 4 if target.vocab_size % 4 == 0 else 1
    config = read_assistant_config(
        dict(
            model_type="gemma4_assistant",
            backbone_hidden_size=target.hidden_size,
            use_ordered_embeddings=ordered,
            num_centroids=centroids,
            centroid_intermediate_top_k=min(2, centroids),
            text_config=text,
        )
    )
    return fill_random(abstract_assistant(config, jnp.float32), seed, kernel_std=0.15)


# ----------------------------------------------------------------------------- serving
def tokenizer_and_model(directory, variant: str = "e2b", seed: int = 3):
    """A tiny Gemma-layout tokenizer (specials at Gemma 4's ids) written into `directory`, and a random
    model over its vocabulary."""
    directory = Path(directory)
    build_hf_json(directory / "tokenizer.json")
    tok = gemma4_nnx.load_tokenizer(directory)
    return tok, random_model(variant, seed=seed, vocab_size=tok.vocab_size)


class ServerThread:
    """`gemma4-serve`'s app over `engine` on a free loopback port, in a daemon thread (a context
    manager: healthy on entry, stopped on exit; the engine stays the caller's)."""

    def __init__(self, engine, name: str, **app_options):
        import socket

        import uvicorn

        from gemma4_nnx.serve.app import create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = create_app(engine, name, **app_options)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))

    def __enter__(self):
        import threading
        import time
        import urllib.request

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the server did not become healthy within 300 s")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


#: Gemma 4 variants a GGUF export / llama.cpp's gemma4 graph must get right, as overrides of TINY
#: (sliding + full layers, PLE, KV sharing, double-wide MLP): tests/test_gguf_export.py, bench/gguf_export.py
GEMMA4_VARIANTS = {
    "e2b": {},
    "k_eq_v": dict(
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
        hidden_size_per_layer_input=0,
    ),
    "moe": dict(
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
        hidden_size_per_layer_input=0,
    ),
}
