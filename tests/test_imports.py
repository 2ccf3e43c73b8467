"""The package's import graph, computed from the source (not listed by hand), has no cycles.

Every `import` / `from ... import` of a `gemma4_nnx` module in every file under `gemma4_nnx/` is an
edge, whether it runs when the module is imported (module level) or when a function is called (a
function-body import): a circle hidden inside a function is still a circle, only a later-failing one.
Relative imports are resolved, and `from pkg import name` points at `pkg.name` when that is a module,
else at `pkg` (its `__init__`). Parent packages that Python runs first are not edges (every module
would otherwise sit in a circle with `gemma4_nnx/__init__.py`).

No exceptions: `gemma4_nnx.config` imports nothing of the package outside itself, not even inside a
function (HF `config.json` is read and written by `gemma4_nnx.io.hf_config`, which imports the configs).
"""

from __future__ import annotations

import ast
import itertools
import pathlib

import gemma4_nnx

PACKAGE = pathlib.Path(gemma4_nnx.__file__).parent


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph() -> dict[str, dict[str, bool]]:
    """{module: {imported gemma4_nnx module: True when only imported inside functions}}."""
    modules = _modules()
    graph: dict[str, dict[str, bool]] = {name: {} for name in modules}
    for name, (path, is_pkg) in modules.items():
        package = name if is_pkg else name.rpartition(".")[0]

        def add(target: str, lazy: bool, name=name) -> None:
            if target != name:
                graph[name][target] = graph[name].get(target, True) and lazy

        def visit(node: ast.AST, lazy: bool, package=package, add=add) -> None:
            for child in ast.iter_child_nodes(node):
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.name.split(".")[0] == "gemma4_nnx":
                            add(alias.name, inner)
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                        source = ".".join(base + ([child.module] if child.module else []))
                    else:
                        source = child.module or ""
                    if source.split(".")[0] == "gemma4_nnx":
                        for alias in child.names:
                            sub = f"{source}.{alias.name}"
                            add(sub if sub in modules else source, inner)
                visit(child, inner)

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return graph


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for root in sorted(edges):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(edges.get(root, ()))))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            for child in children:
                if state.get(child) == 1:
                    return path[path.index(child) :] + [child]
                if not state.get(child):
                    state[child] = 1
                    path.append(child)
                    stack.append((child, iter(sorted(edges.get(child, ())))))
                    break
            else:
                state[node] = 2
                path.pop()
                stack.pop()
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, bool]]) -> str:
    steps = [f"{a} -> {b}" + ("  (inside a function)" if graph[a][b] else "") for a, b in itertools.pairwise(cycle)]
    return "import cycle:\n  " + "\n  ".join(steps)


def test_graph_sees_the_package():
    """The parser finds imports of every kind, so the cycle tests cannot pass on an empty graph."""
    graph = import_graph()
    assert len(graph) > 50, sorted(graph)
    assert graph["gemma4_nnx.io.gm"].get("gemma4_nnx.io.tensors") is False  # module level
    assert graph["gemma4_nnx.io.convert"].get("gemma4_nnx.io.gguf_import") is True  # in a function
    assert graph["gemma4_nnx"].get("gemma4_nnx.config") is False  # `from pkg import name` -> pkg
    assert "gemma4_nnx.serve.errors" in graph["gemma4_nnx.serve.media"]


def test_no_import_cycles():
    """Module-level and function-body imports together form no cycle."""
    graph = import_graph()
    edges = {a: {b for b in out if b in graph} for a, out in graph.items()}
    cycle = _find_cycle(edges)
    assert cycle is None, _describe(cycle, graph)


def test_no_module_level_import_cycles():
    """What runs at import time has no cycle, with no exceptions at all."""
    graph = import_graph()
    edges = {a: {b for b, lazy in out.items() if b in graph and not lazy} for a, out in graph.items()}
    cycle = _find_cycle(edges)
    assert cycle is None, _describe(cycle, graph)


def test_config_is_the_ground_floor():
    """`gemma4_nnx.config` imports nothing of the package outside itself, at module level or inside a
    function."""
    graph = import_graph()
    wrong = [
        f"{a} -> {b}" + (" (inside a function)" if lazy else "")
        for a, out in graph.items()
        if a == "gemma4_nnx.config" or a.startswith("gemma4_nnx.config.")
        for b, lazy in out.items()
        if not (b == "gemma4_nnx.config" or b.startswith("gemma4_nnx.config."))
    ]
    assert not wrong, "gemma4_nnx.config must stay the ground floor:\n  " + "\n  ".join(wrong)


# Third-party modules that only an extra of pyproject.toml brings (serve, audio, gguf, train): a module that
# imports one of these at module level is imported where that extra is installed and named otherwise.
EXTRAS_ONLY = {
    "fastapi",
    "starlette",
    "uvicorn",
    "prometheus_client",
    "llguidance",
    "av",
    "gguf",
    "tensorboardX",
    "tqdm",
}


def test_every_module_imports():
    """Every module of the package imports on this interpreter (the Python 3.12 leg's check that no
    syntax, standard-library or typing change breaks a module the rest of its selection never loads),
    save those that need a missing extra."""
    import importlib

    failed, need_extra = [], []
    for name in sorted(_modules()):
        try:
            importlib.import_module(name)
        except ImportError as e:
            root = (e.name or "").split(".")[0]
            (need_extra if root in EXTRAS_ONLY else failed).append(f"{name}: {e!r}")
        except Exception as e:  # any failure at import time is the finding
            failed.append(f"{name}: {e!r}")
    assert not failed, "\n".join(failed)
    assert len(need_extra) < len(_modules()) // 4, need_extra  # the check still imports most modules
