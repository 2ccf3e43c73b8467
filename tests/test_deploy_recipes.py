"""The container recipes in deploy/ checked step by step without a container runtime (cheap: no build,
no model): every COPY source exists, every `pip install ".[extras]"` names extras pyproject.toml
defines, the entry point is one of the package's commands and its CMD parses with that command's own
parser, the compile cache lies on a declared volume, the health check probes /health, and
docs/deploy.md describes each recipe."""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(f for f in os.listdir(os.path.join(ROOT, "deploy")) if f.startswith("Dockerfile."))


def _instructions(path: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, cur = [], ""
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not cur and (not line.strip() or line.lstrip().startswith("#")):
                continue
            cur += line.rstrip("\\").strip() + " "
            if not line.endswith("\\"):
                word, _, rest = cur.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
                cur = ""
    return out


def _exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


@pytest.fixture(scope="module")
def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_there_are_cpu_tpu_and_gpu_recipes():
    assert {"Dockerfile.cpu", "Dockerfile.tpu", "Dockerfile.gpu"} <= set(RECIPES), RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_step_of_the_recipe_refers_to_what_exists(recipe, pyproject):
    steps = _instructions(os.path.join(ROOT, "deploy", recipe))
    kinds = [k for k, _ in steps]
    assert kinds[0] == "FROM" and {"COPY", "RUN", "ENTRYPOINT", "CMD", "VOLUME", "HEALTHCHECK"} <= set(kinds), kinds
    extras = set(pyproject["optional-dependencies"])
    volumes, env, installed = [], {}, False
    for kind, args in steps:
        if kind == "COPY":
            *sources, _ = shlex.split(args)
            for src in sources:
                assert os.path.exists(os.path.join(ROOT, src)), f"{recipe}: COPY {src}: no such path in the repository"
        elif kind == "RUN" and "pip install" in args:
            for spec in re.findall(r'"\.\[([^\]]*)\]"', args):
                wanted = set(spec.split(","))
                assert wanted <= extras, f"{recipe}: extras {sorted(wanted - extras)} are not in pyproject.toml"
                installed = True
        elif kind == "VOLUME":
            volumes += _exec_form(args)
        elif kind == "ENV":
            key, _, value = args.partition("=")
            env[key] = value
        elif kind == "HEALTHCHECK":
            assert "/health" in args, f"{recipe}: the health check should probe /health (liveness)"
    assert installed, f'{recipe}: no `pip install ".[...]"` step'
    cache = env.get("GEMMA4_COMPILE_CACHE")
    assert cache and any(cache.startswith(v.rstrip("/") + "/") for v in volumes), (recipe, cache, volumes)
    entry = _exec_form(dict(steps)["ENTRYPOINT"])
    cmd = _exec_form(dict(steps)["CMD"])
    assert entry[0] in pyproject["scripts"], f"{recipe}: {entry[0]} is not a command of the package"
    assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "0.0.0.0", f"{recipe}: a container serves on 0.0.0.0"
    pytest.importorskip("fastapi")
    from gemma4_nnx.serve.app import build_parser

    assert entry == ["gemma4-serve"]
    build_parser().parse_args(entry[1:] + cmd)  # every flag is one gemma4-serve takes (SystemExit otherwise)
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        assert f"deploy/{recipe}" in f.read(), f"docs/deploy.md does not describe deploy/{recipe}"
