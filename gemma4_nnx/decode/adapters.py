"""The engine's LoRA adapters: names, bank slots, loading from disk, and who is using which.

`Adapters` keeps the adapters an engine serves in the banks of its decoder's model
(`decode.lora_bank`): slot 0 is "no adapter", slots 1..max_loras hold one adapter each. Loading
reads an adapter directory, ours (`train.finetune.save_adapters`: `lora.json` + Orbax) or Hugging
Face PEFT's (`adapter_config.json` + `adapter_model.safetensors`), checks it against the banks
(rank <= the banks' rank, only banked projections, matching shapes) and writes it into a free slot
of the decoder's weights: new arrays of the same shapes, so no program compiles again.

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

import numpy as np

from gemma4_nnx.decode.errors import RequestError
from gemma4_nnx.decode.lora_bank import LoRABankLinear
from gemma4_nnx.decode.requests import AdapterRef

__all__ = ["Adapters", "read_adapter"]

NOT_FOUND = "model_not_found"


def read_adapter(path: str | os.PathLike) -> tuple[float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(scale alpha / r, {module path: (a [in, r], b [r, out])}) of an adapter directory in our
    format (`save_adapters`) or PEFT's; ValueError naming the problem."""
    from gemma4_nnx.train.finetune import read_adapters
    from gemma4_nnx.train.peft_io import CONFIG, read_peft_adapter

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory")
    if os.path.isfile(os.path.join(path, CONFIG)):
        config, weights = read_peft_adapter(path)
        return float(config["lora_alpha"]) / int(config["r"]), weights
    meta, weights = read_adapters(path)
    return float(meta["alpha"]) / int(meta["rank"]), weights


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
        """Read the adapter at `path` and put it in a free slot under `name`. RequestError (400)
        naming "lora_name" (empty, already loaded), "lora_path" (unreadable, rank above the banks',
        a module the banks do not hold, wrong shapes) or "max_loras" (every slot taken)."""
        if not isinstance(name, str) or not name.strip():
            raise RequestError(f"lora_name must be a non-empty string, got {name!r}", "lora_name")
        if self.get(name) is not None:
            raise RequestError(
                f"adapter {name!r} is loaded already (from {self._paths[name]}); unload it first", "lora_name"
            )
        try:
            scale, weights = read_adapter(path)
        except (ValueError, OSError) as e:
            raise RequestError(f"adapter {name!r}: {e}", "lora_path") from None
        a, b = self._padded(name, scale, weights)
        with self._lock:
            if name in self._loaded:
                raise RequestError(f"adapter {name!r} is loaded already; unload it first", "lora_name")
            if not self._free:
                raise RequestError(
                    f"adapter {name!r}: all {self.max_loras} adapter slots are taken (--max-loras "
                    f"{self.max_loras}): unload one ({', '.join(self._loaded)}) or start with more",
                    "max_loras",
                )
            ref = AdapterRef(name, self._free.pop(0), next(self._uids))
            self._write(ref.slot, a, b)
            self._loaded[name] = ref
            self._paths[name] = os.fspath(path)
        return ref

    def _padded(self, name: str, scale: float, weights) -> tuple[dict, dict]:
        """Every bank's slot contents (a [in, rank], b [rank, out] with the scale folded in; zeros for
        the projections the adapter leaves alone), checked against the banks."""
        unknown = sorted(set(weights) - set(self.shapes))
        if unknown:
            raise RequestError(
                f"adapter {name!r} adapts {unknown[:4]}, which the server's adapter banks do not hold "
                "(attention q/k/v/o and MLP gate/up/down projections of the decoder layers)",
                "lora_path",
            )
        a_out, b_out = {}, {}
        for p, (din, dout) in self.shapes.items():
            a_out[p] = np.zeros((din, self.rank), np.float32)
            b_out[p] = np.zeros((self.rank, dout), np.float32)
            if p not in weights:
                continue
            a, b = weights[p]
            r = a.shape[1]
            if r > self.rank:
                raise RequestError(
                    f"adapter {name!r} has rank {r}, above the server's --max-lora-rank {self.rank}: start "
                    f"the server with --max-lora-rank {r} or more",
                    "lora_path",
                )
            if a.shape != (din, r) or b.shape != (r, dout):
                raise RequestError(
                    f"adapter {name!r}: {p} is {a.shape[0]}x{b.shape[1]} (rank {r}), the model's projection "
                    f"{din}x{dout}: an adapter of another model",
                    "lora_path",
                )
            a_out[p][:, :r] = a
            b_out[p][:r] = b * np.float32(scale)
        return a_out, b_out

    def _write(self, slot: int, a: dict, b: dict) -> None:
        """Slot `slot` of every bank := (a, b), as new weight arrays (same shapes and placement: the
        programs do not compile again). A program running meanwhile keeps the arrays it was given."""
        weights = list(self.decoder.weights)
        for p, (ia, ib) in self._where.items():
            weights[ia] = weights[ia].at[slot].set(a[p])
            weights[ib] = weights[ib].at[slot].set(b[p])
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
