"""The engine's LoRA adapters: names, bank slots, loading from disk, and who is using which.

`Adapters` keeps the adapters an engine serves in the banks of its decoder's model
(`decode.lora_bank`): slot 0 is "no adapter", slots 1..max_loras hold one adapter each. Loading
reads an adapter directory, ours (`train.finetune.save_adapters`: `lora.json` + Orbax) or Hugging
Face PEFT's (`adapter_config.json` + `adapter_model.safetensors`), checks it against the banks
(rank <= the banks' rank, only banked projections, matching shapes) and writes it into a free slot
of the decoder's weights: new arrays of the same shapes, so no program compiles again.

Weights can be finite (every check on the files passes them) and still so large that the model's
activations overflow, and the adapter's requests answer NaN. So before its name is served, each of
a new adapter's updates is run on a unit-scale input (`_bounded`), and a forward pass through it
scores a fixed probe prompt (`_probe`, `PROBE_TOKENS`: one program, compiled on the first load); an
overflow in either refuses it, naming the module and the file. (A probe is a probe: an adapter
could still overflow on other inputs; then only its own requests are affected.)

Requests hold their adapter (`acquire` when queued, `release` when they end). Unloading removes the
name at once (new requests naming it get "not found") and frees its slot when the last request
using it has ended: running rows finish with the adapter they started with, and the slot cannot be
given to another adapter under them.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading

import jax
import numpy as np

from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.lora_bank import LoRABankLinear
from gemma4_nnx.decode.requests import AdapterRef, check_adapter_name

__all__ = ["Adapters", "read_adapter"]


def _safe(e: Exception) -> str:
    """An error's message for a client, short (the readers name files inside the adapter directory,
    never paths or values)."""
    return str(e)[:300]


NOT_FOUND = "model_not_found"

#: Tokens of the probe prompt a new adapter is scored on before it is served (`Adapters.load`).
PROBE_TOKENS = 16


#: What a directory must hold to be an adapter (the one message for every path that is not one, so
#: that a server's client learns nothing of which paths exist).
NOT_AN_ADAPTER = (
    "is not an adapter directory (PEFT's adapter_config.json + adapter_model.safetensors, or save_adapters' "
    "lora.json + adapters/)"
)


def read_adapter(path: str | os.PathLike, *, check=None) -> tuple[float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(scale alpha / r, {module path: (a [in, r], b [r, out])}) of an adapter directory in our
    format (`save_adapters`) or PEFT's; ValueError naming the problem (and the file inside the
    directory, never the directory). Configs, file headers and shapes are checked before any tensor
    is read (`check`: a callable given {module path: (a shape, b shape)}, raising ValueError), and
    every value must be finite (`peft_io.read_peft_adapter`, `finetune.read_adapters`)."""
    from gemma4_nnx.train.finetune import read_adapters
    from gemma4_nnx.train.peft_io import CONFIG, read_peft_adapter

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"lora_path {NOT_AN_ADAPTER}")
    if os.path.isfile(os.path.join(path, CONFIG)):
        config, weights = read_peft_adapter(path, check=check)
        return config["lora_alpha"] / config["r"], weights
    if not os.path.isfile(os.path.join(path, "lora.json")):
        raise ValueError(f"lora_path {NOT_AN_ADAPTER}")
    meta, weights = read_adapters(path, check=check)
    return meta["alpha"] / meta["rank"], weights


def _weights_file(path) -> str:
    """The file inside an adapter directory that holds its tensors (as the readers name it)."""
    from gemma4_nnx.train.peft_io import CONFIG, WEIGHTS

    return WEIGHTS if os.path.isfile(os.path.join(os.fspath(path), CONFIG)) else "adapters/"


class Adapters:
    """LoRA adapters in the banks of `decoder`'s model (its weights are rewritten in place).

    banks: {dotted path: `LoRABankLinear`} of the model the decoder was built from (their arrays
    locate the banks among the decoder's weights). max_loras: slots for adapters (1..max_loras).
    """

    def __init__(self, decoder, banks: dict[str, LoRABankLinear], max_loras: int):
        position = {id(w): i for i, w in enumerate(decoder.weights)}
        self.decoder, self.max_loras = decoder, max_loras
        self.rank = next(iter(banks.values())).a.shape[-1]
        self.shapes = {p: (m.in_features, m.out_features) for p, m in banks.items()}
        # where each bank's a and b are among the decoder's weights (a flat tuple of arrays)
        self._where = {
            p: (position[id(m.a.get_raw_value())], position[id(m.b.get_raw_value())]) for p, m in banks.items()
        }
        self._lock = threading.Lock()
        self._loaded: dict[str, AdapterRef] = {}  # by name, in load order
        self._probing: set[str] = set()  # names written to a slot, their probe forward pass running
        self._base_finite = None  # where the base model's probe logprobs are finite (`_probe`)
        self._paths: dict[str, str] = {}
        self._users: collections.Counter[int] = collections.Counter()  # uid -> requests holding it
        self._unloaded: dict[int, int] = {}  # uid -> slot: unloaded, freed when its last request ends
        self._free = list(range(1, max_loras + 1))
        self._uids = itertools.count(1)

    # ------------------------------------------------------------------ names
    def names(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def get(self, name: str) -> AdapterRef | None:
        with self._lock:
            return self._loaded.get(name)

    def path(self, name: str) -> str | None:
        return self._paths.get(name)

    # ------------------------------------------------------------------ load / unload
    def load(self, name: str, path: str | os.PathLike) -> AdapterRef:
        """Read the adapter at `path` and put it in a free slot under `name`. RequestError (400) naming
        "lora_name" (empty, too long or unprintable, already loaded), "lora_path" (unreadable, rank above the
        banks', a module the banks do not hold, wrong shapes, a forward pass through it overflows: `_probe`) or
        "max_loras" (every slot taken)."""
        check_adapter_name(name)
        if self.get(name) is not None:
            raise RequestError(f"adapter {name!r} is loaded already; unload it first", "lora_name")
        try:
            scale, weights = read_adapter(path, check=self.check)
        except ValueError as e:
            raise RequestError(f"adapter {name!r}: {_safe(e)}", "lora_path") from None
        except OSError as e:  # its message holds the path: only the reason
            raise RequestError(f"adapter {name!r}: lora_path could not be read ({e.strerror})", "lora_path") from None
        except Exception as e:  # whatever a malformed file makes a reader raise: a bad adapter, not a crash
            raise RequestError(
                f"adapter {name!r}: lora_path could not be read ({type(e).__name__})", "lora_path"
            ) from None
        self._bounded(name, scale, weights, path)
        a, b = self._padded(name, scale, weights)
        with self._lock:
            if name in self._loaded or name in self._probing:
                raise RequestError(f"adapter {name!r} is loaded already; unload it first", "lora_name")
            if not self._free:
                raise RequestError(
                    f"adapter {name!r}: all {self.max_loras} adapter slots are taken (--max-loras "
                    f"{self.max_loras}): unload one ({', '.join(self._loaded)}) or start with more",
                    "max_loras",
                )
            slot = self._free.pop(0)
            self._probing.add(name)
            self._write(slot, a, b)
        try:  # the slot is written but not named yet: no request can decode with it
            self._probe(name, slot, scale, weights, path)
        except BaseException:
            with self._lock:
                self._probing.discard(name)
                self._free.append(slot)
                self._free.sort()
            raise
        with self._lock:
            self._probing.discard(name)
            ref = AdapterRef(name, slot, next(self._uids))
            self._loaded[name] = ref
            self._paths[name] = os.fspath(path)
        return ref

    def _bounded(self, name: str, scale: float, weights: dict, path) -> None:
        """RequestError naming "lora_path" and the module (and its file) whose update, `x @ A @ B * alpha / r`
        of a unit-RMS input x (what the model's normalizations feed a projection), has a sum of squares
        that overflows float32: finite weights whose output the next normalization cannot take (each
        file check passes such an adapter, and its requests answered NaN)."""
        for p, (a, b) in weights.items():
            x = np.random.default_rng(0).standard_normal(a.shape[0]).astype(np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                y = (x @ a) @ b * np.float32(scale)
                fine = np.isfinite(np.square(y).sum(dtype=np.float32))
            if not fine:
                raise RequestError(
                    f"adapter {name!r}: the update of {p} (lora_A, lora_B in {_weights_file(path)}) overflows "
                    "float32 on a unit-scale input: its weights are finite but far too large for the model",
                    "lora_path",
                )

    def _probe(self, name: str, slot: int, scale: float, weights: dict, path) -> None:
        """RequestError naming "lora_path" when the probe prompt scored through `slot` has a non-finite
        logprob where the base model's is finite: the adapter's updates pass `_bounded` one by one, but
        together overflow in the model. The message names the module whose update |A| |B| alpha / r is
        largest, and the file holding it."""
        tokens = [(1 + 7919 * i) % self.decoder.vocab_size for i in range(PROBE_TOKENS)]
        if self._base_finite is None:  # the base model's own (an -inf it gives is not the adapter's)
            self._base_finite = np.isfinite(self.decoder.score([tokens])[0].logprob)
        logprob = np.asarray(self.decoder.score([tokens], adapter=slot)[0].logprob)
        if np.isfinite(logprob)[self._base_finite].all():
            return

        def size(p: str) -> float:
            a, b = weights[p]
            return float(np.linalg.norm(a.astype(np.float64)) * np.linalg.norm(b.astype(np.float64)) * abs(scale))

        worst = max(weights, key=size)
        raise RequestError(
            f"adapter {name!r}: a forward pass through it gives non-finite logprobs (its weights are finite but "
            f"overflow in the model); its largest update is {worst} in {_weights_file(path)} "
            f"(|A| |B| alpha / r = {size(worst):.3g}): lora_path is refused",
            "lora_path",
        )

    def check(self, shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]]) -> None:
        """ValueError unless every module of an adapter ({path: (a shape [in, r], b shape [r, out])},
        from its file headers) is one the banks hold, of the model's shapes, with a rank the banks
        take."""
        unknown = sorted(set(shapes) - set(self.shapes))
        if unknown:
            raise ValueError(
                f"adapts {[p[:80] for p in unknown[:4]]}, which the server's adapter banks do not hold "
                "(attention q/k/v/o and MLP gate/up/down projections of the decoder layers)"
            )
        for p in (p for p in self.shapes if p in shapes):  # the banks' order: the same report every time
            (din, r), (r2, dout) = shapes[p]
            if r > self.rank:
                raise ValueError(
                    f"has rank {r}, above the server's --max-lora-rank {self.rank}: start the server with "
                    f"--max-lora-rank {r} or more"
                )
            if (din, dout) != self.shapes[p] or r != r2:
                raise ValueError(
                    f"{p} is {din}x{dout} (rank {r}), the model's projection {self.shapes[p][0]}x{self.shapes[p][1]}: "
                    "an adapter of another model"
                )

    def _padded(self, name: str, scale: float, weights) -> tuple[dict, dict]:
        """Every bank's slot contents (a [in, rank], b [rank, out] with the scale folded in; zeros for
        the projections the adapter leaves alone); `weights` passed `check`."""
        a_out, b_out = {}, {}
        for p, (din, dout) in self.shapes.items():
            a_out[p] = np.zeros((din, self.rank), np.float32)
            b_out[p] = np.zeros((self.rank, dout), np.float32)
            if p in weights:
                a, b = weights[p]
                a_out[p][:, : a.shape[1]] = a
                b_out[p][: a.shape[1]] = b * np.float32(scale)
        if not all(np.isfinite(x).all() for x in b_out.values()):  # a finite alpha / r times finite B can overflow
            raise RequestError(f"adapter {name!r}: its B times lora_alpha / r overflows float32", "lora_path")
        return a_out, b_out

    def _write(self, slot: int, a: dict, b: dict) -> None:
        """Slot `slot` of every bank := (a, b), as new weight arrays (same shapes and placement: the
        programs do not compile again). A program running meanwhile keeps the arrays it was given."""
        weights = list(self.decoder.weights)
        for p, (ia, ib) in self._where.items():  # placed as before (split over a mesh: `lora_bank.place_banks`)
            weights[ia] = jax.device_put(weights[ia].at[slot].set(a[p]), weights[ia].sharding)
            weights[ib] = jax.device_put(weights[ib].at[slot].set(b[p]), weights[ib].sharding)
        self.decoder.weights = tuple(weights)

    def unload(self, name: str) -> None:
        """Remove `name`: new requests no longer find it; its slot is freed once no request holds it
        (at once when none does). RequestError (404) naming "lora_name" when it is not loaded."""
        with self._lock:
            ref = self._loaded.pop(name, None)
            if ref is None:
                raise RequestError(
                    f"adapter {name!r} is not loaded (loaded: {', '.join(self._loaded) or 'none'})",
                    "lora_name",
                    NOT_FOUND,
                )
            self._paths.pop(name, None)
            if self._users[ref.uid]:
                self._unloaded[ref.uid] = ref.slot
            else:
                self._free_slot(ref)

    def _free_slot(self, ref: AdapterRef) -> None:
        self._users.pop(ref.uid, None)
        self._free.append(ref.slot)
        self._free.sort()

    # ------------------------------------------------------------------ requests
    def acquire(self, ref: AdapterRef) -> None:
        """A request will decode with `ref` (RequestError 404 naming "model" when it was unloaded)."""
        with self._lock:
            if self._loaded.get(ref.name) != ref:
                raise RequestError(f"adapter {ref.name!r} was unloaded", "model", NOT_FOUND)
            self._users[ref.uid] += 1

    def release(self, ref: AdapterRef) -> None:
        """A request that held `ref` has ended (its row is free or done)."""
        with self._lock:
            self._users[ref.uid] -= 1
            if self._users[ref.uid] <= 0 and ref.uid in self._unloaded:
                del self._unloaded[ref.uid]
                self._free_slot(ref)
