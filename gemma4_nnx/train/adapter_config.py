"""Reading an adapter's config file safely: the checks every adapter format's reader shares (ours,
`train.finetune.read_adapters`, and PEFT's, `train.peft_io.read_peft_adapter`), in a module of its own
below both so neither imports the other for them. Errors name the file and field, never echo a value."""

from __future__ import annotations

import json
import os

import numpy as np

#: The largest adapter_config.json read (a real one is a few KB).
MAX_CONFIG_BYTES = 1 << 20


def read_config(path: str, name: str) -> dict:
    """The JSON object in the adapter's config file at `path` (`name` in messages), at most
    `MAX_CONFIG_BYTES`; ValueError otherwise."""
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise ValueError(f"{name} is over {MAX_CONFIG_BYTES >> 20} MiB: not an adapter config")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, RecursionError):
        raise ValueError(f"{name} is not valid JSON") from None
    if not isinstance(config, dict):
        raise ValueError(f"{name} must hold a JSON object")
    return config


def check_rank_alpha(config: dict, rank: str, alpha: str, name: str) -> tuple[int, float]:
    """(rank, alpha) of an adapter config: the rank a positive int, alpha a finite number (ValueError
    naming the field, not echoing its value)."""
    r, a = config.get(rank), config.get(alpha)
    if type(r) is not int or r < 1:
        raise ValueError(f"{name}: {rank} must be a positive integer")
    if type(a) not in (int, float) or not np.isfinite(a):
        raise ValueError(f"{name}: {alpha} must be a finite number")
    return r, float(a)
